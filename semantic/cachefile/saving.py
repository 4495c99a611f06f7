"""Saving one agent's blocks as a cache file (see ``fileformat`` for the layout).

The MLX work (gathering each tensor's arrays as byte views) is :func:`prepare`,
so a write-behind thread can call :func:`save` with it and do no MLX work of
its own; the write itself is ``atomic.write``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from semantic.cache.blockclaim import block_spans, snapshot_span
from semantic.cache.blocks import AgentBlocks, KVBlock, segment_runs
from semantic.cachefile import atomic
from semantic.cachefile.fileformat import (
    MX_DTYPES,
    CacheFileInfo,
    TensorSlot,
    document,
    file_info,
    header_bytes,
    layout,
    refuse_recurrent,
)
from semantic.errors import CacheMismatchError, CacheShapeError, InvalidRequestError
from semantic.cache.spec import ModelCacheSpec


def stored_from(blocks: AgentBlocks) -> dict[str, int]:
    """Per sliding group whose first window block starts before the window (a shared
    edge block, see ``blockclaim``), where that block starts: the file stores it whole."""
    out = {}
    for group, layers in blocks.spec.groups().items():
        layer = blocks.spec.layers[layers[0]]
        ranges = layer.held_ranges(blocks.total_tokens)
        if not layer.windowed or not ranges or layer.snapshot_only(blocks.block_tokens):
            continue
        first = next((b for b in blocks.groups.get(group, []) if b.end > ranges[-1][0]), None)
        if first is not None and first.start < ranges[-1][0]:
            out[group] = first.start
    return out


def _sources(blocks: AgentBlocks, slots: list[TensorSlot], edges: dict[str, int]) -> list[list[mx.array]]:
    """Per slot, the arrays that hold its layer's tokens in order (bfloat16
    reinterpreted as uint16, for numpy).

    Blocks that are consecutive views of one segment (``blocks.Segment``)
    become one slice of it, so a fresh extraction is one array per layer.
    """
    spec, total, bt = blocks.spec, blocks.total_tokens, blocks.block_tokens
    snapshots = set()
    for group, layers in spec.groups().items():
        layer = spec.layers[layers[0]]
        if layer.snapshot_only(bt):  # the group's snapshot after exactly ``total`` tokens, last
            have = [(blk.start, blk.end) for blk in blocks.groups.get(group, [])]
            if have[-1:] != ([snapshot_span(total, bt)] if total else []):
                raise CacheShapeError(f"group {group}: blocks hold {have[:4]}..., a snapshot after {total} tokens needs "
                                      f"{[snapshot_span(total, bt)] if total else []}")
            snapshots.add(group)
            continue
        want = [(a, b) for a, b, _ in block_spans(layer, total, bt)]
        if group in edges:  # the window's first block is the shared block from the edge's block start
            window = layer.held_ranges(total)[-1][0]
            want = [(edges[group], b) if a == window else (a, b) for a, b in want]
        have = [(blk.start, blk.end) for blk in blocks.groups.get(group, [])]
        if have != want:
            raise CacheShapeError(f"group {group}: blocks hold {have[:4]}..., the layout of {total} tokens needs {want[:4]}...")
    out = []
    for s in slots:
        group = blocks.groups[s.group]
        if s.group in snapshots:
            arrays = [_snapshot_part(group[-1], s)]
        else:
            for blk in group:
                _check_block(blk, s)
            arrays = _runs(group, s)
        out.append([a.view(mx.uint16) if a.dtype == mx.bfloat16 else a for a in arrays])
    mx.eval(out)  # slices and reinterpretations: views, no copies
    return out


def earlier_snapshots(blocks: AgentBlocks) -> list[KVBlock]:
    """The snapshot blocks ``blocks`` carries before each snapshot group's last one (its snapshots at earlier
    positions of the same history: where a regenerate, or a client that re-renders the reply, resumes),
    checked: each a snapshot span (``blockclaim.snapshot_span``) of the history's tokens, ends ascending."""
    out = []
    spec, total, bt = blocks.spec, blocks.total_tokens, blocks.block_tokens
    for group, layers in spec.groups().items():
        if not spec.layers[layers[0]].snapshot_only(bt):
            continue
        before, prev = blocks.groups.get(group, [])[:-1], 0
        for blk in before:
            if not (prev < blk.end < total and (blk.start, blk.end) == snapshot_span(blk.end, bt)
                    and blk.token_ids == blocks.token_ids[blk.start:blk.end]):
                raise CacheShapeError(f"group {group}: an earlier snapshot [{blk.start}, {blk.end}) after {prev} is no "
                                      f"snapshot of this history of {total} tokens")
            prev = blk.end
        out.extend(before)
    return out


@dataclass(frozen=True, slots=True)
class PreparedSnapshot:
    """An earlier snapshot block's tensors as file-ordered byte views (``slots``: as a file after ``end``
    tokens holds that group, ``fileformat.layout``)."""

    group: str
    start: int
    end: int
    slots: list[TensorSlot]
    chunks: list[list[memoryview]]


def _prepare_earlier(blocks: AgentBlocks) -> tuple[PreparedSnapshot, ...]:
    out, arrays = [], []
    for blk in earlier_snapshots(blocks):
        slots = [s for s in layout(blocks.spec, blk.end) if s.group == blk.group]
        parts = [_snapshot_part(blk, s) for s in slots]
        parts = [a.view(mx.uint16) if a.dtype == mx.bfloat16 else a for a in parts]
        arrays.extend(parts)
        out.append((blk, slots, parts))
    mx.eval(arrays)
    return tuple(PreparedSnapshot(blk.group, blk.start, blk.end, slots, [_chunks([a]) for a in parts])
                 for blk, slots, parts in out)


def _snapshot_part(blk: KVBlock, s: TensorSlot):
    """The array of slot ``s`` in a snapshot block (``convert``: a recurrent layer's ``(arrays, ())``, a
    short window's ``(keys, values)`` of every token it holds), checked against the slot."""
    first, second = blk.kv(s.layer)
    if s.side == "state":
        a = first[s.part] if isinstance(first, tuple) and s.part < len(first) else None
    else:
        a = _part((first, second), s)
    if a is None or tuple(a.shape) != s.shape or a.dtype != MX_DTYPES[s.dtype]:
        got = None if a is None else (tuple(a.shape), a.dtype)
        raise CacheShapeError(f"layer {s.layer} {s.side} snapshot [{blk.start}, {blk.end}): {got}, the spec needs "
                              f"{s.shape} {s.dtype}")
    return a


def _check_block(blk: KVBlock, s: TensorSlot) -> None:
    i = s.layer
    a = _part(blk.kv(i), s)
    shape = (1, s.shape[1], blk.n_tokens, s.shape[3])
    if tuple(a.shape) != shape or a.dtype != MX_DTYPES[s.dtype]:
        raise CacheShapeError(
            f"layer {i} {s.side} [{blk.start}, {blk.end}): {tuple(a.shape)} {a.dtype}, the spec needs {shape} {s.dtype}"
        )


def _part(kv, s: TensorSlot):
    x = kv[0 if s.side == "keys" else 1]
    return x if s.part is None else x[s.part]


def _runs(group: list[KVBlock], s: TensorSlot) -> list[mx.array]:
    """The slot layer's arrays over the group's blocks, merging consecutive views of one segment."""
    out = []
    for run in segment_runs([(blk, 0, blk.n_tokens) for blk in group], s.layer):
        x = _part(run.source.layer_data[s.layer], s)
        out.append(x if isinstance(run.source, KVBlock) else x[..., run.start : run.stop, :])
    return out


def _chunks(arrays: list[mx.array]) -> list[memoryview]:
    """The bytes of one (1, heads, tokens, dim) tensor in file order: one
    contiguous piece per head and array. Arrays may be strided views (slices
    of a segment), but each head's tokens are contiguous: no copy."""
    out = []
    if any(0 in a.shape for a in arrays):  # a zero-wide tensor (deepseek_v32's indexer values): no bytes
        return []
    nps = [np.asarray(memoryview(a)) for a in arrays]
    if nps[0].ndim != 4:  # a recurrent layer's state array: one piece
        return [memoryview(np.ascontiguousarray(x)).cast("B") for x in nps]
    for h in range(nps[0].shape[1]):
        for x in nps:
            piece = x[0, h]
            if not piece.flags.c_contiguous:  # not a view we know: copy this piece
                piece = np.ascontiguousarray(piece)
            out.append(memoryview(piece).cast("B"))
    return out


@dataclass(frozen=True, slots=True)
class PreparedSave:
    """A cache's tensors as file-ordered byte views: all the MLX work of a save.

    The views keep their arrays alive; writing them needs no MLX call, so
    another thread can do it while MLX keeps computing.
    """

    spec: ModelCacheSpec
    token_ids: tuple[int, ...]
    slots: list[TensorSlot]
    chunks: list[list[memoryview]]
    stored_from: dict[str, int]
    # the snapshots before each snapshot group's last (``earlier_snapshots``): the block layout keeps them too
    earlier: tuple[PreparedSnapshot, ...] = ()

    @property
    def nbytes(self) -> int:
        """The tensor bytes the file will hold (its header adds a few KiB; earlier snapshots not counted)."""
        return sum(v.nbytes for views in self.chunks for v in views)

    @property
    def released(self) -> bool:
        return len(self.chunks) != len(self.slots)

    def release(self) -> None:
        """Let go of the byte views once they are written: while a view of a pool buffer lives, MLX copies
        that buffer at a turn's first write into it instead of writing in place (``lending.Loan``)."""
        self.chunks.clear()
        for snap in self.earlier:
            snap.chunks.clear()


def prepare_save(blocks: AgentBlocks) -> PreparedSave:
    """The byte views :func:`save` writes for ``blocks`` (no copy of segment views)."""
    if blocks.released:
        raise CacheMismatchError("these AgentBlocks were released; their blocks may be reused")
    edges = stored_from(blocks)
    slots = layout(blocks.spec, blocks.total_tokens, edges)
    chunks = [_chunks(arrays) for arrays in _sources(blocks, slots, edges)]
    return PreparedSave(blocks.spec, blocks.token_ids, slots, chunks, edges, _prepare_earlier(blocks))


def save(
    path: str | os.PathLike,
    blocks: AgentBlocks,
    *,
    model_fingerprint: str,
    agent_id: str | None = None,
    durable: bool = True,
    prepared: PreparedSave | None = None,
) -> CacheFileInfo:
    """Write ``blocks`` to ``path`` atomically.

    The data goes to a temporary file in the same directory while a second
    thread checksums it; the header (with the checksums) is written last,
    then the file is fsynced, renamed over ``path``, and the directory is
    fsynced. A crash at any point leaves ``path`` absent, old, or new.

    Args:
        path: the file to write; its directory must exist.
        blocks: one agent's cache; it is only read.
        model_fingerprint: identifies the model weights; ``load`` refuses
            the file for any other fingerprint.
        agent_id: recorded in the document (the store lists agents by it).
        durable: fsync file and directory. Without it a process crash is
            still safe, but a power loss may lose the newest file.
        prepared: ``prepare_save(blocks)``, made earlier on the thread that runs
            MLX, so this call does no MLX work (a write-behind thread).

    Returns:
        The written file's :class:`CacheFileInfo`.
    """
    if blocks.released:
        raise CacheMismatchError("these AgentBlocks were released; their blocks may be reused")
    if not isinstance(model_fingerprint, str) or not model_fingerprint:
        raise InvalidRequestError(f"model_fingerprint must be a non-empty string, got {model_fingerprint!r}")
    if agent_id is not None and not isinstance(agent_id, str):
        raise InvalidRequestError(f"agent_id must be a string or None, got {agent_id!r}")
    refuse_recurrent(blocks.spec)
    path = os.fspath(path)
    if prepared is None:
        prepared = prepare_save(blocks)
    elif prepared.token_ids != blocks.token_ids or prepared.spec != blocks.spec:
        raise InvalidRequestError("prepared bytes belong to another cache than these blocks")
    elif prepared.released:
        raise CacheMismatchError("these prepared bytes were written and let go: prepare the save again")
    slots = prepared.slots
    doc = document(
        blocks.spec, blocks.token_ids, model_fingerprint, agent_id, {s.name: "0" * 32 for s in slots}, blocks.salt_root,
        prepared.stored_from,
    )

    def header(digests: list[str]) -> bytes:
        doc["tensors"] = {s.name: d for s, d in zip(slots, digests)}
        return header_bytes(doc, slots)

    st, data_offset = atomic.write(path, header_bytes(doc, slots), prepared.chunks, header, durable)
    return file_info(path, doc, blocks.spec, slots, st, data_offset)
