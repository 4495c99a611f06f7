"""Putting recurrent layers back after a speculative step: keep the state, then feed the accepted tokens again.

A recurrent state (``semantic.kinds.recurrent``) summarises every token fed
and has no token axis, so a rejected draft cannot be cut out of it as
``semantic.decode.rewind`` cuts K/V. Around a speculative step of width ``W``::

    before   keep each recurrent layer's arrays (references: a pass assigns new ones)
    verify   row i feeds 1 + len(draft_i) real inputs; the rest of its W are padding that
             mlx-lm's own right padding (``ArraysCache.lengths``) keeps out of its state
    read     row i keeps k_i = 1 + accepted_i inputs; positional layers drop W - k_i (rewind)
    replay   rows that kept fewer inputs than they fed: recurrent state put back, positional
             layers drop the k_i again, and one pass of width max k_i feeds them once more

    row 0   n0 d1 d2 d3   accepts 2    keeps n0 d1 d2   replayed: state back, n0 d1 d2 fed again
    row 1   n1 d1 d2 d3   accepts 3    keeps all four   exact already: its replay width is 0
    row 2   n2 .  .  .    no draft     keeps n2         exact already (lengths: 1)

A row whose whole draft was accepted, or that had none, needs no replay, so a
step that accepts everything costs what it costs on a model without recurrent
layers. The replay is lazy (:class:`Pending`): it runs before the batch is next
read or stepped, so a stop string that ends a row inside the step (the loop's
``close``) only shortens what that row replays.

Why replay rather than capture the state at every drafted position while
verifying: measured (``harness/analysis/recurrent_spec.py``, ``results/recurrent_spec.json``,
the shared 2-core CPU) on LFM2-350M's geometry, a decode step takes 387 ms, a
verify step of 9 tokens 656, a replay of 1 or 4 tokens 288 or 342 (it computes
no logits); over edit-style turns at batch 1 (acceptance 0.94) only 4 of 44
wide steps replayed, 4.4% of the speculated turns' time (6.6% on a
Qwen3-Next-like geometry), which is all that capturing could save. Capturing needs a per-position variant of every
architecture's recurrent kernel (short convolutions, gated delta rule, Mamba's
SSD scan, each in two mlx-lm versions) and keeps a state per drafted position
(Qwen3-Next: 2 MB a layer); a replay is the model's own forward pass, on every
model whose code honours ``lengths`` (``batchprobe.replay_problem`` asks at load).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx

from semantic import compat, kinds
from semantic.decode import rewind


def replaying(batch: list) -> list:
    """The batch's caches that are put back rather than rewound (recurrent states)."""
    return [c for c in rewind.leaves(batch) if getattr(kinds.for_cache(c), "replays", False)]


def begin(batch: list, fed: Sequence[int]) -> list | None:
    """Before a speculative step whose row ``i`` feeds ``fed[i]`` real inputs: keep every replaying
    cache's state and limit its rows to those inputs. The kept states, or None when nothing replays."""
    caches = replaying(batch)
    if not caches:
        return None
    kept = [kinds.for_cache(c).keep(c) for c in caches]
    _limit(caches, fed)
    return kept


def end(batch: list) -> None:
    """After the step's forward pass is built: no row limits left for the next one."""
    _limit(replaying(batch), None)


def _limit(caches: list, lengths) -> None:
    for c in caches:
        kinds.for_cache(c).limit(c, lengths)


@dataclass(slots=True)
class Pending:
    """A speculative step's recurrent states to put right: what each row fed and kept."""

    rows: list                 # the batch's rows at the step (any hashable identity, in batch order)
    kept: list                 # per replaying cache: its arrays before the step
    inputs: list[list[int]]    # per row: its W inputs
    fed: list[int]             # per row: the real ones among them (the rest was padding)
    keeps: list[int]           # per row: the inputs its caches keep (1 + accepted drafts)

    def cut(self, row, back: int) -> None:
        """Row ``row`` keeps ``back`` fewer inputs (a stop string ended it inside the step)."""
        i = self.rows.index(row)
        assert 0 <= back < self.keeps[i], (back, self.keeps[i])
        self.keeps[i] -= back

    def replay(self, model, batch: list, rows: list) -> int:
        """Put every row of ``rows`` (the batch now: the step's rows, some gone) that kept fewer inputs than
        it fed back to its state before the step, and feed it its kept inputs again. Returns the pass's width."""
        at = [self.rows.index(r) for r in rows]
        keeps = [self.keeps[i] if self.keeps[i] < self.fed[i] else 0 for i in at]  # 0: exact already
        width = max(keeps, default=0)
        if not width:
            return 0
        rewind.rewind(batch, keeps)  # the positional layers drop what is fed again
        rewind.prepare(batch)
        caches = replaying(batch)
        index = mx.array(at)
        for c, kept in zip(caches, self.kept):
            kinds.for_cache(c).put_back(c, [a[index] for a in kept], [k > 0 for k in keeps])
        _limit(caches, keeps)
        model(mx.array([self.inputs[i][:width] for i in at]), cache=batch)  # only the caches are read
        _limit(caches, None)
        rewind.rewind(batch, [width - k for k in keeps])
        mx.eval([compat.cache_arrays(c) for c in batch])
        return width
