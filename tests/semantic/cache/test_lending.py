"""A segment grown for a turn, one layer at a time, holds its cache about once while it grows and after."""

from __future__ import annotations

import os

import mlx.core as mx
import pytest

from semantic import heap
from semantic.cache import lending
from semantic.cache.blocks import Segment

pytestmark = pytest.mark.skipif(
    getattr(heap.libc(), "malloc_trim", None) is None or not os.path.exists("/proc/self/statm"),
    reason="reads RSS from /proc; gives back through glibc's malloc_trim")

LAYERS, HEADS, TOKENS, DIM = 48, 4, 4096, 128  # 384 MiB of bfloat16 K and V, Qwen3-Coder's geometry at 4K


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_segment_grown_layer_by_layer_never_holds_the_old_cache_beside_the_new(monkeypatch):
    # RSS, read as each layer is replaced: the freed layers stay resident (MLX's buffer cache, glibc's heap)
    # unless given back as the loop goes; held, they were 0.6x of the cache at the loop's end. The second of
    # two grows is measured: the first raises glibc's mmap threshold past a layer, as a server's first turns do
    seg = Segment({i: (mx.ones((1, HEADS, TOKENS, DIM), mx.bfloat16), mx.ones((1, HEADS, TOKENS, DIM), mx.bfloat16))
                   for i in range(LAYERS)}, TOKENS)
    mx.eval([a for kv in seg.layer_data.values() for a in kv])
    lending.grow(seg, 256)
    tokens = seg.n_tokens = TOKENS + 256  # a turn filled the room
    cache = sum(k.nbytes + v.nbytes for k, v in seg.layer_data.values())
    heap.give_back(0)
    seen, widened = [], lending._widened
    monkeypatch.setattr(lending, "_widened", lambda x, n, more: (seen.append(_rss()), widened(x, n, more))[1])
    before = _rss()
    more = 256
    lending.grow(seg, more)
    after = _rss()
    added = cache * more // tokens
    layer = cache // LAYERS
    assert all(k.shape[2] == tokens + more for k, _ in seg.layer_data.values())
    assert max(seen) - before <= added + heap.STEP_BYTES + 2 * layer + (16 << 20), (max(seen) - before) / cache
    assert after - before <= added + (16 << 20), (after - before) / cache


@pytest.mark.skipif(not heap.drops(), reason="drops pages only where dropped pages read as zeros again (Linux, CPU)")
def test_a_grown_segments_spare_slots_take_no_memory_until_a_turn_writes_them():
    # the spare slots after a segment's tokens held up to a sixteenth of a grown cache after every turn
    layers = 8
    seg = Segment({i: (mx.ones((1, HEADS, TOKENS, DIM), mx.float32), mx.ones((1, HEADS, TOKENS, DIM), mx.float32))
                   for i in range(layers)}, TOKENS)
    mx.eval([a for kv in seg.layer_data.values() for a in kv])
    cache = sum(k.nbytes + v.nbytes for k, v in seg.layer_data.values())
    heap.give_back(0)
    before = _rss()
    lending.grow(seg, TOKENS)  # as many spare slots as tokens: a copy's worth, were they resident
    assert _rss() - before <= cache // 8, (_rss() - before) / cache
    k, v = seg.layer_data[0]
    assert k.shape[2] == 2 * TOKENS
    assert mx.array_equal(k[..., :TOKENS, :], mx.ones((1, HEADS, TOKENS, DIM))).item()
    assert not mx.any(k[..., TOKENS:, :]).item()  # the dropped pages read as the zeros they held
    k[..., TOKENS:TOKENS + 3, :] = 2.0  # a turn writes its tokens in place: they stay
    mx.eval(k)
    assert mx.sum(k[..., TOKENS:, :]).item() == 2.0 * HEADS * 3 * DIM
