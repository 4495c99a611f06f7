"""Stored responses: what ``previous_response_id`` names, kept beside the agents' caches on disk.

A stored response is the conversation so far (every message, this
response's output included), the agent whose cache holds it, and the
response object as the client got it. A follow-up that names it continues
that agent, so its prompt is the stored messages plus the new input, and the
agent's cache (echo-stable: ``semantic.chat.echo``) covers all but the new part.
Records are small JSON files, one per response, under the cache directory,
namespaced by tenant (another tenant's id is not found), written atomically,
so they survive SIGTERM and SIGKILL as the caches do. At most ``limit``
are kept; the least recently written go first, and an evicted id is a 404
that says so. Blocking file I/O: the routes call it off the event loop.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import threading
from pathlib import Path

ID = re.compile(r"^resp_[0-9a-f]{24}$")


class ResponseStore:
    def __init__(self, root: Path, limit: int = 10_000):
        self.root, self.limit = Path(root), limit
        self._lock = threading.Lock()
        self._count: int | None = None  # records on disk, counted once, then kept up to date

    def _path(self, tenant: str, response_id: str) -> Path | None:
        if not ID.match(response_id or ""):
            return None
        space = hashlib.sha256(f"tenant\0{tenant}".encode()).hexdigest()[:16]
        return self.root / space / f"{response_id}.json"

    def get(self, tenant: str, response_id: str) -> dict | None:
        """The stored record, or None (never stored, another tenant's, deleted, or evicted)."""
        path = self._path(tenant, response_id)
        try:
            return json.loads(path.read_text()) if path is not None else None
        except (OSError, ValueError):
            return None

    def put(self, tenant: str, response_id: str, record: dict) -> None:
        path = self._path(tenant, response_id)
        assert path is not None, response_id
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(record, f)
        except BaseException:  # a full disk: no half-written record left behind
            os.unlink(tmp)
            raise
        with self._lock:
            if self._count is None:
                self._count = len(self._files())
            elif not path.exists():
                self._count += 1
            os.replace(tmp, path)
            if self._count > self.limit:  # only then list them all: not on every put
                files = sorted(self._files(), key=lambda p: p.stat().st_mtime)
                for old in files[: len(files) - self.limit]:
                    old.unlink(missing_ok=True)
                self._count = min(len(files), self.limit)

    def delete(self, tenant: str, response_id: str) -> bool:
        path = self._path(tenant, response_id)
        try:
            path.unlink()
        except (OSError, AttributeError):
            return False
        with self._lock:
            if self._count is not None:
                self._count -= 1
        return True

    def _files(self) -> list[Path]:
        return list(self.root.glob("*/resp_*.json"))
