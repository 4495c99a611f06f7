"""Taking a batch's newest tokens back out of its caches, a different number per row.

A speculative decode step feeds ``W`` tokens to every row; row ``i`` keeps
only its first ``W - drop[i]`` (the tokens the model agreed with). The
batch caches are right-aligned (every row's newest token sits at ``_idx - 1``;
the ``left_padding`` slots before a row's first token are masked), so one
row cannot just lose its tail. All rows first drop what they all drop; a
row that drops ``d`` more is then shifted right by ``d`` and pads ``d`` more
slots, so its rejected keys wrap into its padding, where the mask hides them::

    drop = [1, 2]        the common 1 off      row 1 shifted right by 1
    row 0  [a b c d e]  ─►  [a b c d]     ─►   [a b c d]     left_padding 0
    row 1  [. q r s t]  ─►  [. q r s]     ─►   [s . q r]     left_padding 2 (was 1)
                                                └─┴ masked

The shift copies that row's cache, so it is paid only by rows that kept
fewer tokens than another row; a batch of one never pays it.

Every batch cache the step loop uses is handled (``BatchKVCache``,
``BatchRotatingKVCache``, ``batchquant.BatchQuantizedKVCache``; a row-wise
``rows.RowsKVCache`` just moves each row's end back), with the
fields both supported mlx-lm versions share. A rotating cache is put back
in temporal order first (its ring then is a plain right-aligned buffer);
its left padding may be negative (a full window: every slot holds a
token), and counts from 0 when a row is shifted. A recurrent state has no
token axis to cut: its layers are skipped here and put back by
``semantic.decode.replay``.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
from mlx_lm.models import cache as C

from semantic import kinds
from semantic.kinds.batchquant import BatchQuantizedKVCache
from semantic.kinds.rows import RowsKVCache


def prepare(batch: list) -> None:
    """Ready the caches for a step of several tokens per row: rotating rings in temporal order."""
    for c in _leaves(batch):
        if isinstance(c, C.BatchRotatingKVCache) and c.keys is not None:
            c._temporal_order()


def rewind(batch: list, drop: Sequence[int]) -> None:
    """Remove the newest ``drop[i]`` tokens of row ``i`` from every layer's cache in ``batch``."""
    if not any(drop):
        return
    common = min(drop)
    extra = [d - common for d in drop]
    for c in _leaves(batch):
        if isinstance(c, RowsKVCache):  # each row in its own buffers: its end moves back, no shift, no copy
            c.rewind(drop)
            continue
        if common:
            _trim_all(c, common)
        if any(extra):
            _shift_rows(c, extra)


def leaves(batch: list) -> list:
    """The batch caches, a ``CacheList``'s children in its place."""
    return [leaf for c in batch for leaf in (c.caches if isinstance(c, C.CacheList) else (c,))]


def _leaves(batch: list) -> list:
    """The batch caches that take tokens back out (every positional one)."""
    return [leaf for leaf in leaves(batch) if _rewinds(kinds.for_cache(leaf))]


def _rewinds(kind) -> bool:
    return kind is None or kind.rewinds  # None: a positional batch class, which no kind names


def _trim_all(c, n: int) -> None:
    if isinstance(c, C.BatchRotatingKVCache):
        c._temporal_order()
        assert c._idx == c.keys.shape[2] >= n, (c._idx, c.keys.shape, n)
        c.keys, c.values = c.keys[..., : c._idx - n, :], c.values[..., : c._idx - n, :]
        c._offset -= n
    else:  # BatchKVCache, BatchQuantizedKVCache: the slots past _idx are rewritten by the next update
        assert isinstance(c, (C.BatchKVCache, BatchQuantizedKVCache)), type(c).__name__
        assert c._idx >= n, (c._idx, n)
    c._idx -= n
    c.offset = c.offset - n


def _shift_rows(c, extra: list[int]) -> None:
    if isinstance(c, C.BatchRotatingKVCache):
        c._temporal_order()
        c.left_padding = mx.maximum(c.left_padding, 0)  # a full window's negative padding: none
    n = c._idx
    arrays = (*c.keys, *c.values) if isinstance(c, BatchQuantizedKVCache) else (c.keys, c.values)
    for row, d in enumerate(extra):
        if d:  # only this row is copied: its d rejected keys wrap round to its front
            for x in arrays:
                x[row : row + 1, :, :n, :] = mx.roll(x[row : row + 1, :, :n, :], d, axis=2)
    shifts = mx.array(extra)
    c.left_padding = c.left_padding + shifts
    c.offset = c.offset - shifts
