"""Giving memory the process freed back to the system, so that a server's resident set follows what it holds.

Freed buffers stay resident in two places: MLX's buffer cache (kept for reuse until ``mx.clear_cache``) and
glibc's heap, which keeps freed blocks below its mmap threshold (raised up to 32 MiB by the largest block
freed: one layer's K of a few thousand tokens) until ``malloc_trim``. A turn that grows a pooled cache one
layer at a time, or a first turn's prefill, frees about a cache's worth of such blocks, which stayed
resident beside the pool (a second copy seen from outside, though MLX held one). :func:`give_back` returns
both; the scheduler calls it once each time its worker goes idle, off every turn's path.
"""

from __future__ import annotations

import ctypes


def give_back() -> None:
    """Empty MLX's buffer cache, then return the heap's free pages (every arena's) to the system."""
    try:
        import mlx.core as mx

        mx.clear_cache()
    except (ImportError, AttributeError):
        pass
    trim = getattr(libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


def libc():
    """The C library this process runs on (None where it cannot be opened)."""
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None
