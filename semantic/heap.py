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
import functools
import mmap
import sys


# below this much in MLX's buffer cache nothing is given back while turns keep coming: a turn's working
# buffers, which the next turn of a burst reuses; emptying them at every idle spell cost a small model's next
# turn its page faults again (SmolLM2's sub-agent and regenerate turns 1.25x and 2x slower to their first token)
KEEP_BYTES = 256 << 20
# idle this long with nothing new, the worker gives back everything the process is not using: between an
# agent's turns (a tool runs, a person reads) the machine has its memory back, while the turns of a burst
# (sub-agents sent one after another) still find the last one's working buffers
QUIET_S = 0.25
# a loop that replaces a cache's buffers one layer at a time (a segment grown for a turn) gives back what it let
# go every this many bytes: the freed buffers stayed in MLX's cache and the heap, and an append that grew a
# 4K-token cache at Qwen3-Coder's geometry peaked at 1.54 copies of it (1.16 with this, EXP-023)
STEP_BYTES = 32 << 20


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


class Releasing:
    """Counts the bytes a loop lets go and gives them back every ``step``: the process holds a cache being
    rebuilt layer by layer about once, not once plus every layer it has replaced."""

    def __init__(self, step: int = STEP_BYTES):
        self.step, self.freed = step, 0

    def let_go(self, nbytes: int) -> None:
        self.freed += nbytes
        if self.freed >= self.step:
            give_back(0)
            self.freed = 0


def unresident(x, start: int) -> int:
    """Return to the system the memory pages of token slots ``start`` on of each head of ``x`` (batch, heads,
    slots, dim; evaluated, contiguous, its buffer its own), which hold zeros no turn has written yet: a
    segment's spare slots cost nothing until a turn writes them, where they held up to a sixteenth of a
    grown cache after every turn. Linux's private pages read as zeros again once dropped, so the array's
    values do not change; elsewhere (MLX's Metal or CUDA buffers) nothing is done. The bytes dropped."""
    if x.ndim != 4 or start >= x.shape[2] or not drops() or x.nbytes == 0:
        return 0  # not a positional layer's (batch, heads, slots, dim), or no spare slots
    b, h, slots, d = x.shape
    lib = libc()
    if lib is None:
        return 0
    mv = memoryview(x).cast("B")
    assert mv.c_contiguous and not mv.readonly and mv.nbytes == x.nbytes
    base = ctypes.addressof(ctypes.c_char.from_buffer(mv))
    row, page, dropped = d * x.itemsize, mmap.PAGESIZE, 0
    for head in range(b * h):
        lo = base + (head * slots + start) * row
        hi = base + (head + 1) * slots * row
        lo = -(-lo // page) * page
        hi = hi // page * page
        if hi > lo and lib.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_DONTNEED) == 0:
            dropped += hi - lo
    del mv
    return dropped


_MADV_DONTNEED = 4


@functools.cache
def drops() -> bool:
    """Whether :func:`unresident` drops pages here: dropped private pages read as zeros again on Linux, and
    only MLX's CPU arrays are host memory the process may drop."""
    import mlx.core as mx

    return sys.platform.startswith("linux") and not mx.cuda.is_available()


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
