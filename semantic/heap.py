"""Giving memory the process freed back to the system, so that a server's resident set follows what it holds.

Freed buffers stay resident in two places: MLX's buffer cache (kept for reuse until ``mx.clear_cache``) and
glibc's heap, which keeps freed blocks below its mmap threshold (raised up to 32 MiB by the largest block
freed: one layer's K of a few thousand tokens) until ``malloc_trim``. A turn that grows a pooled cache one
layer at a time, or a first turn's prefill, frees about a cache's worth of such blocks, which stayed
resident beside the pool (a second copy seen from outside, though MLX held one). :func:`give_back` returns
both when MLX's cache holds more than a turn's working buffers (``KEEP_BYTES``); the scheduler calls it when
its worker goes idle and after each save, and a segment's growth after it (``cache.lending``).
"""

from __future__ import annotations

import ctypes


# below this much in MLX's buffer cache nothing is given back: a turn's working buffers, which the next turn
# reuses; emptying them cost a small model's next turn its page faults again (SmolLM2's sub-agent and
# regenerate turns 1.25x and 2x slower to their first token)
KEEP_BYTES = 256 << 20


def give_back(keep: int = KEEP_BYTES) -> bool:
    """Empty MLX's buffer cache, then return the heap's free pages (every arena's) to the system, when the cache
    holds more than ``keep`` bytes (a cache's worth freed: a grown segment's old buffers, a copy a save held).
    True when it did."""
    try:
        import mlx.core as mx
    except ImportError:
        return False
    if mx.get_cache_memory() <= keep:
        return False
    mx.clear_cache()
    trim = getattr(libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)
    return True


def libc():
    """The C library this process runs on (None where it cannot be opened)."""
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None
