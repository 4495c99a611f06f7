"""Giving memory the process freed back to the system, so that a server's resident set follows what it holds.

Freed buffers stay resident in two places: MLX's buffer cache (kept for reuse until ``mx.clear_cache``) and
glibc's heap, which keeps freed blocks below its mmap threshold (raised up to 32 MiB by the largest block
freed: one layer's K of a few thousand tokens) until ``malloc_trim`` when they are not at its top. MLX's CPU
allocator hands most freed buffers straight back to ``free``, so on Linux the heap is where a freed cache
stays: a first turn's prefill, a segment grown one layer at a time, a copy a save held, each leave about a
cache's worth of free blocks between live ones. :func:`give_back` returns each place's free memory when it
holds more than a turn's working buffers (``KEEP_BYTES``); the scheduler calls it when its worker goes idle
and after each save, and a segment's growth after it (``cache.lending``).
"""

from __future__ import annotations

import ctypes


# below this much in MLX's buffer cache nothing is given back: a turn's working buffers, which the next turn
# reuses; emptying them cost a small model's next turn its page faults again (SmolLM2's sub-agent and
# regenerate turns 1.25x and 2x slower to their first token)
KEEP_BYTES = 256 << 20
# a prefill this long leaves working memory (attention over its chunks) a later turn of the agent does not
# reuse: 230 MB free heap after 4,096 tokens at Qwen3-Coder's geometry, under KEEP_BYTES, so it stayed; after
# one, the idle worker keeps only AFTER_LONG_PREFILL. Lowering KEEP_BYTES itself to 64 MiB made SmolLM2's
# sub-agent and edit turns 1.06x slower (EXP-022), whose prefills are shorter
LONG_PREFILL = 2048
AFTER_LONG_PREFILL = 64 << 20


def give_back(keep: int = KEEP_BYTES) -> bool:
    """Empty MLX's buffer cache when it holds more than ``keep`` bytes, and return the heap's free pages (every
    arena's) to the system when, then, more than ``keep`` bytes of it are free (a cache's worth freed: a grown
    segment's old buffers, a copy a save held). True when it gave anything back."""
    try:
        import mlx.core as mx
    except ImportError:
        return False
    gave = False
    if mx.get_cache_memory() > keep:
        mx.clear_cache()  # into the heap: trimmed below
        gave = True
    lib = libc()
    trim = getattr(lib, "malloc_trim", None)
    if trim is not None and (gave or heap_free(lib) > keep):
        trim(0)
        gave = True
    return gave


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def heap_free(lib=None) -> int:
    """Bytes free in glibc's heap (every arena), resident until trimmed; 0 where glibc cannot say."""
    info = getattr(lib or libc(), "mallinfo2", None)
    if info is None:
        return 0
    info.restype = _MallInfo2
    return int(info().fordblks)


def libc():
    """The C library this process runs on (None where it cannot be opened)."""
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None
