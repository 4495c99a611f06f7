"""Stored responses: what ``previous_response_id`` names, kept beside the agents' caches on disk.

A stored response is the conversation so far (every message, this
response's output included), the agent whose cache holds it, and the
response object as the client got it. A follow-up that names it continues
that agent, so its prompt is the stored messages plus the new input, and the
agent's cache (echo-stable: ``semantic.echo``) covers all but the new part.
Records are small JSON files, one per response, under the cache directory,
namespaced by tenant (another tenant's id is not found), written atomically,
so they survive SIGTERM and SIGKILL as the caches do. At most ``limit``
are kept; the least recently written go first, and an evicted id is a 404
that says so.
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
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
        os.replace(tmp, path)
        self._evict()

    def delete(self, tenant: str, response_id: str) -> bool:
        path = self._path(tenant, response_id)
        try:
            path.unlink()
            return True
        except (OSError, AttributeError):
            return False

    def _evict(self) -> None:
        with self._lock:
            files = sorted(self.root.glob("*/resp_*.json"), key=lambda p: p.stat().st_mtime)
            for path in files[: max(0, len(files) - self.limit)]:
                path.unlink(missing_ok=True)
