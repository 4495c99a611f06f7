"""What a cache takes from the block pool, in bytes: the one accounting that the pool, admission and the
scheduler's planner share, so none of them can promise what another refuses.

A block holds one layer group's tokens (``semantic.cache.blocks``), so a block costs its group's bytes:
a global group of 3 layers costs a fifth of a sliding group of 15. A group that resumes only from a
snapshot (a recurrent state) costs one snapshot a block::

    Gemma 3 (f32, 256 tokens a block)   sliding x15: 4.7 MiB a block   global x3: 0.9 MiB a block
    Qwen3.5 (bf16)                      global x10: 5 MiB a block      recurrent x30: one state, 18 MiB

How many blocks an agent's cache of ``n`` tokens holds at most, per group, while its next turn runs
(the turn's new blocks beside the agent's own cache, which it extends)::

    a group that keeps every token    ceil(n / B) + 2      its blocks, the own cache's tail, the tail copied
    a sliding window of W             min(the above, 2 x (ceil(W / B) + 1))   two windows: old and new
    a snapshot group                  2 x K                the own cache's K snapshots, the turn's K

The longest cache the pool can hold (:func:`longest_cache`) is what admission promises; the planner
reserves each turn's :func:`turn_need`, which never exceeds it, so a turn admitted on an idle server
always finds room.
"""

from __future__ import annotations

from semantic import kinds
from semantic.cache.spec import ModelCacheSpec

# The snapshots one cache carries per snapshot group, its end included (``SnapshotPositions.carried`` picks
# them): as many as SNAPSHOT_BUDGET holds, at least the end and the prompt's last token but one, at most
# one per place a later turn starts over. A Qwen3.5-35B-A3B snapshot is 64 MB: 4; an LFM2 one, 6.
SNAPSHOT_BUDGET = 256 << 20
MOST_CARRIED = 6


def size(nbytes: float) -> str:
    """Bytes as people read them in an error: 24 KiB, 1.5 MiB, 12.0 GiB."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{int(nbytes)} B"


def block_costs(spec: ModelCacheSpec, block_tokens: int) -> dict[str, int]:
    """Bytes one block of each layer group holds at most: its layers' K/V for ``block_tokens`` tokens,
    or, for a group that resumes only from a snapshot, one whole snapshot of its layers."""
    out = {}
    for group, layers in spec.groups().items():
        first = spec.layers[layers[0]]
        if first.snapshot_only(block_tokens):
            # the whole cache: a recurrent state, or a window shorter than a block
            out[group] = sum(spec.layers[i].bytes_held(1 << 40) for i in layers)
        else:
            out[group] = int(sum(spec.layers[i].token_bytes() for i in layers) * block_tokens)
        out[group] = max(out[group], 1)
    return out


def window_blocks(spec: ModelCacheSpec, group: str, block_tokens: int) -> int | None:
    """Blocks a windowed group's cache holds however long its history (None: it keeps every token)."""
    layer = spec.layers[spec.groups()[group][0]]
    if not layer.windowed:
        return None
    far = 1 << 40  # any history far past the window
    return sum(-(-(b - a) // block_tokens) + 1 for a, b in layer.held_ranges(far))


def snapshots_carried(spec: ModelCacheSpec, block_tokens: int, budget: int = SNAPSHOT_BUDGET) -> int:
    """K: how many snapshots one cache carries per snapshot group, its end included (0: none)."""
    costs = block_costs(spec, block_tokens)
    state = sum(costs[g] for g in spec.snapshot_groups(block_tokens))
    return max(2, min(MOST_CARRIED, budget // state)) if state else 0


def held_blocks(spec: ModelCacheSpec, group: str, tokens: int, block_tokens: int) -> int:
    """Blocks of ``group`` an agent's cache of ``tokens`` tokens holds at most while its next turn runs
    (the module doc's table)."""
    if spec.layers[spec.groups()[group][0]].snapshot_only(block_tokens):
        return 2 * snapshots_carried(spec, block_tokens)  # the own cache's and the turn's
    grows = -(-tokens // block_tokens) + 2
    window = window_blocks(spec, group, block_tokens)
    return grows if window is None else min(grows, 2 * window)


def cache_bytes(spec: ModelCacheSpec, tokens: int, block_tokens: int) -> int:
    """Pool bytes one agent of ``tokens`` tokens holds at most while its next turn runs: its blocks, and the
    copy its turn holds of the layers that cannot run in the pool's buffers (:func:`held_copy`), which
    admission charges the pool for."""
    costs = block_costs(spec, block_tokens)
    return sum(cost * held_blocks(spec, g, tokens, block_tokens) for g, cost in costs.items()) + held_copy(spec, tokens)


def longest_cache(spec: ModelCacheSpec, capacity: int, block_tokens: int, ceiling: int = 1 << 24) -> int:
    """The most tokens one agent's cache may hold with ``capacity`` pool bytes (0: not even one block),
    up to ``ceiling``. Windowed and snapshot groups stop growing, so a model of those alone fits any length."""
    if cache_bytes(spec, 1, block_tokens) > capacity:
        return 0
    if cache_bytes(spec, ceiling, block_tokens) <= capacity:
        return ceiling
    lo, hi = 1, ceiling  # cache_bytes(lo) fits, cache_bytes(hi) does not; it only grows with tokens
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if cache_bytes(spec, mid, block_tokens) <= capacity else (lo, mid)
    return lo


def turn_need(spec: ModelCacheSpec, misses: dict[str, int], prompt: int, completion: int, block_tokens: int) -> int:
    """Pool bytes a turn takes at most: per group, the prompt's blocks the pool misses (``misses``, from
    ``blockclaim.claim_blocks``) and the blocks its ``completion`` tokens may fill, capped by what that
    group's cache can hold (a window; a snapshot group's K)."""
    costs = block_costs(spec, block_tokens)
    need = 0
    for group, cost in costs.items():
        if spec.layers[spec.groups()[group][0]].snapshot_only(block_tokens):
            blocks = snapshots_carried(spec, block_tokens)
        else:
            # the tail block the prompt ends in is counted again: its copy, when another cache holds it
            blocks = misses.get(group, 0) + -(-(prompt + completion) // block_tokens) - prompt // block_tokens
            window = window_blocks(spec, group, block_tokens)
            if window is not None:
                blocks = min(blocks, window)
        need += cost * blocks
    return need


def row_bytes(spec: ModelCacheSpec, tokens: int, apart: bool = False) -> int:
    """Bytes one row of a merged batch holds for a cache of ``tokens``: every layer's K/V it attends over
    (a window's at most) and each recurrent state. A batch of two or more rows is a copy of its rows, padded
    to the longest (mlx-lm's ``BatchKVCache.merge`` and ``extend``); a turn decoding alone is its own. With
    ``apart`` (the executor keeps rows apart, ``kinds.rows``), the layers that keep each row in its own
    buffers hold no copy."""
    return sum(layer.bytes_held(tokens) for layer in spec.layers
               if not (apart and kinds.of(layer).keeps_rows(layer)))


def merged_bytes(rows: list[int]) -> int:
    """A merged batch's bytes, its rows' :func:`row_bytes` given: each padded to the longest; none alone."""
    return len(rows) * max(rows) if len(rows) > 1 else 0


def held_copy(spec: ModelCacheSpec, tokens: int) -> int:
    """Bytes a resumed turn of a cache of ``tokens`` holds beyond the pool in the layers whose kind writes no
    buffer of the pool's in place (quantized K/V, windows, recurrent states): a copy of what they hold, as
    ``convert.held_outside`` counts it. Layers that take room run in the pool's buffers: nothing."""
    return sum(layer.bytes_held(tokens) for layer in spec.layers if not kinds.of(layer).takes_room(layer))
