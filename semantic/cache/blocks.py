"""Token blocks of KV data, and the set of blocks that make up one agent's cache.

Layers are grouped by cache shape (see ``LayerSpec.group``): all global
layers form one group, sliding layers with the same window another. A block
holds one token span for every layer of one group::

    tokens      0 ........ 255 | 256 ...... 511 | 512 .. 600
    global      [ block 7     ] [ block 2      ] [ block 9 ]   all layers of the group
    sliding     (evicted)       [ block 4 ~~~~ ] [ block 5 ]   window 512: only what is held

Full blocks and tails are hash-chained and shareable (see ``pool``). A
sliding group's window edge references the pooled full block that covers
it, so its first block may start before the window; when that block was
never pooled whole, the edge is a private partial block.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from semantic.cache.spec import ModelCacheSpec

# (keys, values): each an mx.array of shape (1, heads, n_tokens, dim), or for a
# quantized layer a (packed, scales, biases) tuple of such arrays.
LayerKV = tuple[Any, Any]


def _nbytes(x) -> int:
    return sum(a.nbytes for a in x) if isinstance(x, tuple) else x.nbytes


def _rows(x, a: int, b: int):
    """Rows ``[a, b)`` of one side of a layer's K/V (a quantized side: each of its parts)."""
    if isinstance(x, tuple):
        return tuple(p[..., a:b, :] for p in x)
    return x[..., a:b, :]


def _first(x):
    return x[0] if isinstance(x, tuple) else x


@dataclass(slots=True, eq=False)
class Segment:
    """One contiguous buffer per layer of a layer group holding a run of its blocks, made by one
    extraction (or one restore of block files, read straight into it: ``store.blockread``), or a
    finished turn's own buffer, pooled as it is.

    Its blocks hold positions in it, not arrays, so the segment's arrays are the only holders of its
    bytes: reconstruction hands a layer its whole run as one slice, or, when the run is the whole
    filled part from position 0, the buffer itself, with the slots past ``n_tokens`` as the turn's
    room (``lent``): MLX then writes the turn's tokens there in place, since nothing else holds the
    buffer, and the turn's new blocks become positions in it too::

        segment (layer i keys)   [ t0 ........................ n_tokens | spare .... capacity )
        blocks                   [ blk 3 ][ blk 8 ][ blk 4 )
        lent to a turn           the same array; the turn writes from n_tokens on

    A segment lives while any block's position in it does; ``lent``: a turn writes into it now
    (``lending.Loan``), so no other may.
    """

    layer_data: dict[int, LayerKV]
    n_tokens: int
    lent: bool = False
    # the mlx-lm caches the last turn lent it was handed, by layer: the next turn gets them again while their
    # buffers are still the segment's (a small resumed turn's rebuild was mostly making and checking them)
    handed: dict = field(default_factory=dict)

    @property
    def capacity(self) -> int:
        """Token slots in its buffers (``n_tokens`` filled; the rest is room a turn lent it may write)."""
        return _first(next(iter(self.layer_data.values()))[0]).shape[2]

    def replace(self, layer: int, kv: LayerKV) -> None:
        """Layer ``layer``'s buffers from now on (grown, widened, joined); the cache handed over the old ones
        lets go of them too, so they go once their last holder does."""
        self.handed.pop(layer, None)
        self.layer_data[layer] = kv

    def rows(self, layer: int, a: int, b: int) -> LayerKV:
        """Layer ``layer``'s (keys, values) rows ``[a, b)``: new views, made now."""
        k, v = self.layer_data[layer]
        return _rows(k, a, b), _rows(v, a, b)


@dataclass(frozen=True, slots=True, eq=False)
class SegmentView:
    """Where a block's data sit in a segment: its first held token is ``segment``'s index ``start``."""

    segment: Segment
    start: int

    def __post_init__(self):
        assert 0 <= self.start < self.segment.n_tokens, (self.start, self.segment.n_tokens)


@dataclass(slots=True, eq=False)
class KVBlock:
    """Tokens ``[start, start + n_tokens)`` of one layer group.

    ``layer_data`` maps each layer index of the group to its K/V arrays: the block's own (a snapshot, a
    block made alone), or, for a block at a position in a segment (``segment_view``), views of it made
    when asked, so no array but the segment's holds its bytes. ``token_hash`` is set when the block is
    registered for sharing (full, or a tail); ``token_ids`` are kept to confirm every hash hit.
    """

    block_id: int
    group: str
    start: int
    n_tokens: int
    token_ids: tuple[int, ...]
    own_data: dict[int, LayerKV]
    token_hash: int | None = None
    segment_view: SegmentView | None = None  # when its data sit in a segment
    parent: int | None = None  # keyed blocks: the key of the prefix before ``start`` (None: unsalted root)

    def __post_init__(self):
        assert self.n_tokens > 0 and self.start >= 0, (self.start, self.n_tokens)
        assert len(self.token_ids) == self.n_tokens

    @property
    def end(self) -> int:
        return self.start + self.n_tokens

    def kv(self, layer: int) -> LayerKV:
        """Layer ``layer``'s (keys, values) for this block's tokens."""
        where = self.segment_view
        if where is None:
            return self.own_data[layer]
        return where.segment.rows(layer, where.start, where.start + self.n_tokens)

    @property
    def layers(self) -> list[int]:
        where = self.segment_view
        return list((self.own_data if where is None else where.segment.layer_data).keys())

    @property
    def layer_data(self) -> dict[int, LayerKV]:
        return {i: self.kv(i) for i in self.layers}

    @layer_data.setter
    def layer_data(self, data: dict[int, LayerKV]) -> None:
        """The block's own arrays from now on (it no longer sits in a segment)."""
        self.own_data, self.segment_view = data, None

    @property
    def nbytes(self) -> int:
        where = self.segment_view
        if where is None:
            return sum(_nbytes(k) + _nbytes(v) for k, v in self.own_data.values())
        seg = where.segment  # every part of a side grows by the same bytes a token
        return sum(_nbytes(k) + _nbytes(v) for k, v in seg.layer_data.values()) // seg.capacity * self.n_tokens


@dataclass(eq=False)
class AgentBlocks:
    """One agent's cache: the token ids it covers and its blocks per group.

    It holds one pool reference per block; :meth:`release` (or dropping the
    object) gives them back. Not slotted, so it can be weakly referenced.
    """

    spec: ModelCacheSpec
    token_ids: tuple[int, ...]
    groups: dict[str, list[KVBlock]]
    block_tokens: int
    _release: Callable[[list[KVBlock]], None] | None = field(default=None, repr=False)
    _finalizer: Any = field(default=None, repr=False)
    salt_root: int | None = None   # the hash chain's salt (a tenant's), None unsalted: see blockclaim.chain_keys

    def __post_init__(self):
        self.token_ids = tuple(map(int, self.token_ids))
        if self._release is not None:
            self._finalizer = weakref.finalize(self, self._release, self.unique_blocks())

    @property
    def total_tokens(self) -> int:
        return len(self.token_ids)

    def num_layers(self) -> int:
        return self.spec.n_layers

    def blocks_for_layer(self, layer: int) -> list[KVBlock]:
        """Blocks holding this layer's K/V, in token order."""
        return self.groups[self.spec.layers[layer].group]

    def unique_blocks(self) -> list[KVBlock]:
        return [b for blocks in self.groups.values() for b in blocks]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.unique_blocks())

    @property
    def released(self) -> bool:
        return self._finalizer is not None and not self._finalizer.alive

    def release(self) -> None:
        """Return this cache's blocks to the pool; later calls do nothing."""
        if self._finalizer is not None:
            self._finalizer()


@dataclass(frozen=True, slots=True)
class Run:
    """Tokens ``[start, stop)`` of ``source``'s layer data: a segment, or a block
    whose data are not a view of one."""

    source: Segment | KVBlock
    start: int
    stop: int

    def __post_init__(self):
        assert 0 <= self.start < self.stop, (self.start, self.stop)


def segment_runs(pieces: Sequence[tuple[KVBlock, int, int]], layer: int) -> list[Run]:
    """``layer``'s pieces ``(block, first, end)`` (block-local token indices), in order,
    with consecutive views of one segment merged into one run of it.

    A fresh extraction, a loaded file or a restore from block files is then one run per layer, which
    reconstruction and saving hand on as one slice instead of many pieces.
    """
    out: list[Run] = []
    for blk, s, e in pieces:
        where = blk.segment_view
        if where is None:
            out.append(Run(blk, s, e))
            continue
        a = where.start + s
        if out and out[-1].source is where.segment and out[-1].stop == a:
            out[-1] = Run(where.segment, out[-1].start, a + e - s)
        else:
            out.append(Run(where.segment, a, a + e - s))
    return out
