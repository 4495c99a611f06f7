"""Which weights a cache belongs to: a sha256 over a model directory's ``*.safetensors`` files.

The digest of each file is remembered in ``.fingerprint.json`` beside it,
keyed by name, size and mtime, so a model of hundreds of MB is hashed once.
The harness (prepared models) and the server (``semantic serve``) use this one
function, so the same directory gets the same fingerprint in both.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def weights_fingerprint(path: str | Path) -> str:
    """sha256 over the directory's ``*.safetensors`` files (names and contents)."""
    path = Path(path)
    memo_file = path / ".fingerprint.json"
    try:
        memo = json.loads(memo_file.read_text())
    except (OSError, ValueError):
        memo = {}
    h = hashlib.sha256()
    changed = False
    for f in sorted(path.glob("*.safetensors")):
        st = f.stat()
        key = f"{f.name}:{st.st_size}:{st.st_mtime_ns}"
        if key not in memo:
            memo[key] = sha256_file(f)
            changed = True
        h.update(f.name.encode() + b"\0" + memo[key].encode() + b"\n")
    if changed:
        try:
            memo_file.write_text(json.dumps(memo))
        except OSError:
            pass  # a read-only model directory still gets a fingerprint
    return h.hexdigest()
