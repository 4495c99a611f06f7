"""heap.give_back: what the process freed leaves it, past what a turn reuses."""

from __future__ import annotations

import ctypes
import os

import mlx.core as mx
import pytest

from semantic import heap

pytestmark = pytest.mark.skipif(getattr(heap.libc(), "mallinfo2", None) is None, reason="needs glibc's mallinfo2")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_blocks_freed_between_live_ones_leave_the_process_once_more_than_keep_are_free():
    # MLX's CPU allocator frees a cache's buffers into glibc's heap, where blocks between live ones stay
    # resident (only the heap's top is trimmed by itself): a copy freed looked like a second cache from outside
    lib = heap.libc()
    lib.malloc.restype, lib.malloc.argtypes, lib.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
    size, n = 100 << 10, 400  # below the mmap threshold: heap blocks
    ptrs = [lib.malloc(size) for _ in range(2 * n)]
    try:
        for p in ptrs:
            ctypes.memset(p, 1, size)  # resident
        mx.clear_cache()
        base = heap.heap_free()  # free blocks earlier tests left (this worker's heap is shared with them)
        for p in ptrs[::2]:
            lib.free(p)
        assert heap.heap_free() >= base + 0.95 * n * size  # another thread may take a little of it meanwhile
        before = _rss()
        assert not heap.give_back(keep=base + 2 * n * size)  # less than keep: a turn's working memory, kept
        assert _rss() >= before - n * size // 10
        assert heap.give_back(keep=base + n * size // 2)
        assert before - _rss() >= n * size * 0.8
    finally:
        for p in ptrs[1::2]:
            lib.free(p)
