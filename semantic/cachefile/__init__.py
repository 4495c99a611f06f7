"""Cache files: one agent's blocks in a crash-safe, verified safetensors file.

    fileformat   the layout, the header document, and the checks a header must pass
    atomic       crash-safe writes (temp name, fsync, rename) and startup recovery
    saving       prepare_save (the MLX work) and save (the write, no MLX work)
    loading      read, verify and pool a file's blocks

The public names are re-exported here: ``cachefile.save``, ``cachefile.load``,
``cachefile.read_header``, ...
"""

from semantic.cachefile.atomic import TMP_SUFFIX, settle, temp_name
from semantic.cachefile.fileformat import (
    DOC_HASH_KEY,
    DOC_KEY,
    FORMAT_VERSION,
    READABLE_VERSIONS,
    HASH,
    SUFFIX,
    CacheFileInfo,
    TensorSlot,
    layout,
    read_header,
)
from semantic.cachefile.loading import load
from semantic.cachefile.saving import PreparedSave, prepare_save, save

__all__ = [
    "DOC_HASH_KEY",
    "DOC_KEY",
    "FORMAT_VERSION",
    "READABLE_VERSIONS",
    "HASH",
    "SUFFIX",
    "TMP_SUFFIX",
    "CacheFileInfo",
    "PreparedSave",
    "TensorSlot",
    "layout",
    "load",
    "prepare_save",
    "read_header",
    "save",
    "settle",
    "temp_name",
]
