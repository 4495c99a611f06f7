"""Snapshot positions: where a prompt's prefill stops so its cache can be kept, and which windows a chunk passes.

A global layer's cache after ``T`` tokens holds every earlier position, so
any prefix of it can serve. Two kinds cannot be cut back:

- a recurrent layer (``ArraysCache``) holds one state that summarises
  ``[0, T)``; it resumes only at a position where that state was copied;
- a sliding window shorter than a block holds ``[T - W, T)``; no pooled block
  of other positions rebuilds an earlier window.

So the step loop ends a prefill chunk at the positions where agents resume,
and the executor pools the whole cache there (``executor._checkpoint``)::

    history   [ system | tools | q1 a1 | q2 a2 | q3 ]
    snapshots          ^ boundary      ^ boundary ^ last token - 1
              ^ ... every ``interval`` tokens (a long prefill) ...

- a boundary the service found (the system prompt's end: a second agent; the
  last message's start: an edit of it), from ``Request.boundaries``;
- the prompt's last token but one: a regenerate prefills only the last token (when the prompt brings
  more than ``FEW_NEW`` new tokens: else the regenerate resumes where the turn did);
- a grid: every ``interval`` tokens, spaced by what a snapshot costs against
  a block of KV (an LFM2 state is a few KiB: every block; a Qwen3.5 state is
  ~12 blocks of KV: every 12 blocks);
- the turn's end is kept by the finished cache itself.

A finished cache carries the snapshots a later turn starts over from (:meth:`SnapshotPositions.carried`), so its
save keeps them beside its end and they survive a restart: the prompt's last token but one (a
regenerate, a reply the client renders otherwise), the boundaries (an edit of the last message, a
second agent on the system prompt), and the position it resumed from (the finished cache ends before
the reply's last token, a stop token or not, so a history rendered without it resumes there too). The
grid's snapshots stay in the pool (a restart
loses them). K of them in all (``room.snapshots_carried``): a big state
(Qwen3.5-35B-A3B: 64 MB) keeps the first four, whose rereads cost most to prefill again.

A sliding window of a block or more never stops a prefill. Its full blocks serve any later
position, so what a later turn needs is every full block the window held at some block boundary
of the prompt; a chunk's attention leaves the newest ``W - 1`` positions before the chunk and the
whole chunk in the cache (mlx-lm trims a ring only before the next chunk), so after each chunk
the executor pools the blocks the window held at the boundaries inside it (:meth:`SnapshotPositions.passed`,
``convert.keep_passed``)::

    chunk      [512 ............................ 2560)      window 512, blocks of 256
    buffer  [1' .. 512 ............................ 2560)   1' = 512 - 511
    passed     768 1024 ... 2560: the windows [256, 768) ... [2048, 2560), all in the buffer
"""

from __future__ import annotations

import math
from typing import Sequence

from semantic.cache import room
from semantic.cache.spec import ModelCacheSpec

# the sparsest grid, in blocks: a long prefill still leaves a snapshot every 16 blocks
MAX_GRID_BLOCKS = 16
# a prompt with at most this many new tokens takes no snapshot at its last token but one: the stop costs
# every such turn a second forward over the whole context (a 2-token turn after a 32K restore of
# Qwen3.5's geometry: 1.14 s where one forward is 0.6 s), and a regenerate resumes where the turn did
# (carried) and prefills those few tokens again in one forward, about what the stop cost
FEW_NEW = 16


class SnapshotPositions:
    """Where one model's prompts take snapshots, and the windows their chunks pass (see the module doc)."""

    def __init__(self, spec: ModelCacheSpec, block_tokens: int):
        self.block_tokens = block_tokens
        self.required = any(l.snapshot_only(block_tokens) for l in spec.layers)
        self.windows = any(l.windowed and not l.snapshot_only(block_tokens) for l in spec.layers)
        block_bytes = spec.token_bytes() * block_tokens
        state = spec.state_bytes()
        blocks = math.ceil(state / block_bytes) if block_bytes else MAX_GRID_BLOCKS
        self.interval = block_tokens * min(max(blocks, 1), MAX_GRID_BLOCKS)
        self.most = room.snapshots_carried(spec, block_tokens) if self.required else 0

    def carried(self, fed: int, total: int, boundaries: Sequence[int] = ()) -> tuple[int, ...]:
        """The earlier positions whose snapshots a prompt of ``total`` tokens, resumed at ``fed``, carries
        into its finished cache, most valuable first: the last token but one, the boundaries (latest
        first), ``fed``; at most K - 1 (the end is the K-th). The grid's snapshots stay in the pool only:
        one inside the last message would serve an edit that keeps its start, for one more file a turn."""
        if not self.required:
            return ()
        out: list[int] = []
        for p in (self._last_but_one(fed, total), *sorted(boundaries, reverse=True), fed):
            if 0 < p < total and p not in out:
                out.append(p)
        return tuple(out[: self.most - 1])

    def taken(self, fed: int, total: int, boundaries: Sequence[int] = ()) -> list[int]:
        """Positions ``p`` with ``fed < p < total`` where the prefill of a prompt of ``total`` tokens,
        ``fed`` of them cached, stops to take a snapshot."""
        if not self.required:
            return []
        out = {*boundaries, self._last_but_one(fed, total)}
        out.update(range(fed // self.interval * self.interval + self.interval, total, self.interval))
        return sorted(p for p in out if fed < p < total)

    @staticmethod
    def _last_but_one(fed: int, total: int) -> int:
        """The prompt's last token but one, where its prefill stops for a regenerate; 0 (none) when it
        brings at most ``FEW_NEW`` new tokens."""
        return total - 1 if total - fed > FEW_NEW else 0

    def passed(self, fed: int, total: int, start: int, end: int) -> list[int]:
        """The block boundaries ``p``, ``fed < p < total``, that a chunk of tokens ``[start, end)`` of
        that prompt reaches: their windows are pooled from the cache the chunk leaves (none for a
        model without sliding windows of a block or more)."""
        if not self.windows:
            return []
        bt = self.block_tokens
        first = max(fed, start) // bt * bt + bt
        return list(range(first, min(end, total - 1) + 1, bt))
