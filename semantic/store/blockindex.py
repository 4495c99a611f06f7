"""The block files on disk, who uses them, and what a save must write (plain state, no I/O).

Each block file is indexed by its key and by the block it sits in
(``(parent, group)``: the chain key before the block names its position and
everything before it, as in the pool). A save walks the positions each group
holds and, block by block, uses the longest stretch some block file already
holds for this history; what none holds becomes a new block file::

    history        [ block 0 ][ block 1 ][ block 2 ...... | 612 ..... 700 )
    on disk        [ A       ][ B       ][ C: 512..612   ]
    extents        A 0..256    B 256..512  C 512..612       new: 612..700

A group that resumes only from a snapshot has one extent per snapshot the
cache carries: the snapshot files of its cache after earlier positions of the
history (where a regenerate resumes), then after the whole history
(``blockformat.snapshot_key``), each written unless some save of the same
history wrote it already.

A file is referenced by every manifest whose extents name it, and pinned
while a save that plans to use it is between planning and its manifest. A
file neither referenced nor pinned is garbage: the store deletes it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from semantic.cache.blockclaim import snapshot_span, stored_ranges
from semantic.cache.spec import ModelCacheSpec
from semantic.store.blockformat import BlockInfo, block_key, snapshot_key
from semantic.store.manifest import Extent


@dataclass(frozen=True, slots=True)
class NewBlock:
    """A block file a save must write: positions ``[start, end)`` of ``group`` (``buffer``: where
    ``start`` sits in the group's saved buffer)."""

    key: int
    group: str
    parent: int | None
    block_start: int
    start: int
    end: int
    buffer: int
    snapshot: bool = False  # the group's whole cache after ``end`` (``start``: the block start)


@dataclass(frozen=True, slots=True)
class SaveFiles:
    extents: dict[str, tuple[Extent, ...]]
    new: tuple[NewBlock, ...]
    reused: frozenset[int]
    snapshots: frozenset[str] = frozenset()  # the groups whose extent is a snapshot file


@dataclass(slots=True)
class Held:
    """One indexed agent: its manifest (or, until converted, its single cache file)."""

    path: Path
    nbytes: int
    keys: frozenset[int] = frozenset()
    legacy: bool = False
    written: int = 0                                # bytes the save that made it wrote
    pins: frozenset[int] = field(default=frozenset(), repr=False)  # held until put


class BlockIndex:
    """The indexed block files, their references and pins (the store's lock guards every call)."""

    def __init__(self):
        self.infos: dict[int, BlockInfo] = {}
        self.children: dict[tuple[int | None, str], set[int]] = {}
        self.refs: Counter[int] = Counter()
        self.pins: Counter[int] = Counter()

    def add(self, info: BlockInfo) -> None:
        self.infos[info.key] = info
        self.children.setdefault((info.parent, info.group), set()).add(info.key)

    def drop(self, key: int) -> BlockInfo | None:
        """Forget a block file (deleted, or quarantined); its references stay with their manifests."""
        info = self.infos.pop(key, None)
        if info is not None:
            kids = self.children.get((info.parent, info.group))
            if kids is not None:
                kids.discard(key)
                if not kids:
                    del self.children[(info.parent, info.group)]
        return info

    def reference(self, add: set[int], remove: set[int]) -> None:
        self.refs.update(add)
        self.refs.subtract(remove)
        for k in remove:
            if self.refs[k] <= 0:
                del self.refs[k]

    def pin(self, keys) -> None:
        self.pins.update(keys)

    def unpin(self, keys) -> None:
        self.pins.subtract(keys)
        for k in keys:
            if self.pins[k] <= 0:
                del self.pins[k]

    def take_garbage(self) -> list[BlockInfo]:
        """The files neither referenced nor pinned, dropped from the index (the caller deletes them)."""
        dead = [k for k in self.infos if not self.refs.get(k) and not self.pins.get(k)]
        return [self.drop(k) for k in dead]

    def total_bytes(self) -> int:
        return sum(i.nbytes for i in self.infos.values())

    def shared_bytes(self) -> tuple[int, int]:
        """Bytes of files used by two manifests or more, and by one."""
        shared = unique = 0
        for k, info in self.infos.items():
            n = self.refs.get(k, 0)
            if n >= 2:
                shared += info.nbytes
            elif n == 1:
                unique += info.nbytes
        return shared, unique

    # ------------------------------------------------------------ a save's files

    def files_for(self, spec: ModelCacheSpec, tokens: Sequence[int], chain: Sequence[int], salt_root: int | None,
             stored_from: dict[str, int], bt: int, earlier: dict[str, Sequence[int]] | None = None) -> SaveFiles:
        """The extents of a history and the block files it lacks (nothing changes; the caller pins).
        ``earlier``: per snapshot group, the ends of its snapshots before the history's end, ascending."""
        extents, new, reused, snapshots = {}, [], set(), set()
        earlier = earlier or {}
        for group, layers in spec.groups().items():
            if spec.layers[layers[0]].snapshot_only(bt):
                snapshots.add(group)
                extents[group] = tuple(
                    e for end in [*earlier.get(group, ()), len(tokens)]
                    for e in self._snapshot(group, tokens[:end], chain, salt_root, bt, new, reused))
                continue
            out: list[Extent] = []
            buffered = 0
            for a, b in stored_ranges(spec.layers[layers[0]], len(tokens), stored_from.get(group)):
                p = a
                while p < b:
                    bs = p - p % bt
                    q = min(b, bs + bt)
                    parent = chain[bs // bt - 1] if bs else salt_root
                    got, u = self._best(parent, group, tokens[bs:q], bs, p, q)
                    if got is None:
                        u = self._next_held(parent, group, tokens[bs:q], bs, p, q)
                        key = block_key(parent, tokens[bs:u], p - bs, group)
                        if key in self.infos:
                            reused.add(key)
                        else:
                            new.append(NewBlock(key, group, parent, bs, p, u, buffered + p - a))
                        out.append(Extent(key, p, u))
                    else:
                        reused.add(got)
                        out.append(Extent(got, p, u))
                    p = u
                buffered += b - a
            extents[group] = tuple(out)
        return SaveFiles(extents, tuple(new), frozenset(reused), frozenset(snapshots))

    def _snapshot(self, group, tokens, chain, salt_root, bt, new: list, reused: set) -> tuple[Extent, ...]:
        """A snapshot group's extent after all of ``tokens``: the file of its cache then (reused when indexed)."""
        if not tokens:
            return ()
        s, t = snapshot_span(len(tokens), bt)
        parent = chain[s // bt - 1] if s else salt_root
        key = snapshot_key(parent, tokens[s:t], group)
        if key in self.infos:
            reused.add(key)
        else:
            new.append(NewBlock(key, group, parent, s, s, t, 0, snapshot=True))
        return (Extent(key, s, t),)

    def _best(self, parent, group, tokens, bs, p, q) -> tuple[int | None, int]:
        """The file holding the most of ``[p, q)`` for this history from ``p`` on, and how far it goes."""
        best, far = None, p
        for k in self.children.get((parent, group), ()):
            info = self.infos[k]
            if info.start <= p < info.end and not info.snapshot:
                u = info.usable_end(tokens, parent, q)
                if u > far:
                    best, far = k, u
        return best, far

    def _next_held(self, parent, group, tokens, bs, p, q) -> int:
        """Where a file that this history can use starts after ``p`` (else ``q``): a new file stops there."""
        out = q
        for k in self.children.get((parent, group), ()):
            info = self.infos[k]
            if p < info.start < out and not info.snapshot and info.usable_end(tokens, parent, q) > info.start:
                out = info.start
        return out
