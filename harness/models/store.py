"""Prepared model directories in the cache dir: their state, fingerprints, and hub snapshots."""

from __future__ import annotations

import json
import os
from pathlib import Path

from harness.models.registry import REGISTRY
from semantic.store.fingerprint import sha256_file as _sha256  # noqa: F401  (prepare.py checks GGUF digests with it)
from semantic.store.fingerprint import weights_fingerprint as fingerprint  # noqa: F401

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


def _hub_snapshot(repo: str, weights_only: bool = True) -> Path:
    from huggingface_hub import snapshot_download

    patterns = ["*.safetensors"] if weights_only else None
    return Path(snapshot_download(repo, allow_patterns=patterns, local_files_only=True))
