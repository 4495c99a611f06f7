"""blockread.unwritten: arrays a restore reads into, made without writing a byte of them first."""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
import pytest

from semantic import heap
from semantic.store import blockread


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not heap.drops() or not os.path.exists("/proc/self/statm"),
                    reason="arrays made unwritten on Linux's CPU only; reads RSS from /proc")
def test_arrays_made_to_be_read_into_take_no_memory_until_written_and_take_what_is_written():
    # the zeros a restore made first faulted in and wrote every page before the read wrote it again
    shapes = [((1, 8, 8192, 128), mx.bfloat16), ((1, 8, 8192, 128), mx.float32), ((1, 2, 100, 4), mx.uint32)]
    mx.clear_cache()
    before = _rss()
    arrays = blockread.unwritten(shapes)
    nbytes = sum(a.nbytes for a in arrays)
    assert [(tuple(a.shape), a.dtype) for a in arrays] == shapes
    assert _rss() - before < nbytes // 16, (_rss() - before) / nbytes  # 48 MiB made, none of it touched
    for k, a in enumerate(arrays):
        view = np.frombuffer(blockread.writable(a), dtype=np.uint8)
        view[:] = k + 1
    assert _rss() - before >= nbytes * 0.9  # written where the arrays are: no copy between
    for k, a in enumerate(arrays):
        assert mx.all(a.view(mx.uint8) == k + 1).item()


def test_arrays_made_to_be_read_into_have_the_shapes_and_dtypes_asked_for_everywhere():
    shapes = [((1, 2, 5, 3), mx.float16), ((4,), mx.int8), ((1, 1, 0, 8), mx.float32)]
    arrays = blockread.unwritten(shapes)
    assert [(tuple(a.shape), a.dtype) for a in arrays] == shapes
    assert [blockread.writable(a).nbytes for a in arrays] == [a.nbytes for a in arrays]
