"""Prepared model directories in the cache dir: their state, fingerprints, and hub snapshots."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from harness.models.registry import REGISTRY

CONVERTER_VERSION = 1  # bump when conversion output changes, to re-prepare
DEQUANTIZER_VERSION = 1  # bump when the f32 variant's output changes


def cache_root() -> Path:
    env = os.environ.get("SEMANTIC_MODELS_DIR")
    return Path(env) if env else Path.home() / ".cache" / "semantic-kv"


def prepared_dir(name: str, variant: str = "quantized") -> Path:
    return cache_root() / "models" / (name if variant == "quantized" else f"{name}-{variant}")


def _is_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def hub_mode() -> bool:
    """``SEMANTIC_MODEL_SOURCE=hub``: registered models come from their mlx-community hub ids."""
    return os.environ.get("SEMANTIC_MODEL_SOURCE", "auto") == "hub"


def is_prepared(name: str) -> bool:
    """Whether ``name`` loads without a download: converted here, or (hub mode) in the hub cache."""
    if gguf_prepared(name):
        return True
    if hub_mode():
        try:
            _hub_snapshot(REGISTRY[name].hf_repo)
            return True
        except Exception:  # not downloaded yet (or no huggingface_hub)
            return False
    return False


def gguf_prepared(name: str) -> bool:
    """Whether our GGUF conversion of ``name`` is in the cache dir (it wins over the hub)."""
    info = _manifest(prepared_dir(name))
    return info is not None and info.get("converter_version") == CONVERTER_VERSION


def variant_prepared(name: str, variant: str) -> bool:
    """Whether ``name``'s ``variant`` is ready to load without converting anything."""
    if variant == "quantized":
        return is_prepared(name)
    info = _manifest(prepared_dir(name, variant))
    return info is not None and info.get("dequantizer_version") == DEQUANTIZER_VERSION


def _manifest(path: Path) -> dict | None:
    try:
        info = json.loads((path / "prepared.json").read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) and _is_model_dir(path) else None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def fingerprint(path: str | Path) -> str:
    """sha256 over the model's ``*.safetensors`` files (names and contents).

    The digest of each file is remembered in ``.fingerprint.json`` beside it,
    keyed by size and mtime, so a 300 MB model is hashed once.
    """
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
            memo[key] = _sha256(f)
            changed = True
        h.update(f.name.encode() + b"\0" + memo[key].encode() + b"\n")
    if changed:
        try:
            memo_file.write_text(json.dumps(memo))
        except OSError:
            pass  # a read-only model directory still gets a fingerprint
    return h.hexdigest()


def _hub_snapshot(repo: str, weights_only: bool = True) -> Path:
    from huggingface_hub import snapshot_download

    patterns = ["*.safetensors"] if weights_only else None
    return Path(snapshot_download(repo, allow_patterns=patterns, local_files_only=True))
