"""Prompt-lookup drafts: the next tokens a sequence will probably write, copied from its own context.

A coding agent's reply repeats its context: the file it edits, the test it
re-runs, the path it names again. When the newest ``n`` tokens of a
sequence (prompt and generated) occurred earlier, the tokens that followed
them there are a cheap guess at what comes next; the step loop feeds the
guess beside the real next token and keeps the longest prefix the model
agrees with (``semantic.runner.steploop``), so the output is the model's own::

    context  ... def load ( path ) : ...... return load ( path ) : ?
                     └── earlier: "load ( path )" was followed by ") :" ...
    suffix                                     "load ( path )"  ─► draft  ": \\n    return"

How many tokens to draft is a bet, made for the whole batch: every row of
a step is as wide as the longest draft. A step of ``B`` rows over ``1 + k``
positions costs about ``1 + cost * sqrt(B) * k`` plain steps (a 2-core CPU,
SmolLM2: cost 0.16 at one row, 0.29 a position at four; a GPU is bound by
reading the weights, so its cost is near 0), and row ``i`` gains, if each
of its drafted tokens is accepted with probability ``p_i``,
``p_i + p_i^2 + ...`` up to its draft's length. ``k`` is the one with the
most tokens per unit of cost (:func:`batch_draft_len`), and 0 (no draft, no
cost) when nothing pays: a sequence whose drafts keep failing stops
drafting, and its rate drifts back towards the prior so it tries again later.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

PRIOR_ACCEPTED, PRIOR_PROPOSED = 1.0, 2.0   # a rate of 0.5 before any evidence
DECAY = 0.98                                 # per step: old evidence fades, so a stopped drafter tries again


@dataclass(frozen=True, slots=True)
class SpecConfig:
    """Prompt-lookup speculation for greedy sequences.

    ``max_draft``: most tokens drafted per step; ``ngram``: the longest
    suffix looked up (shorter ones are tried down to ``min_ngram``);
    ``position_cost``: one more position's cost relative to a decode step.
    """

    max_draft: int = 8
    ngram: int = 4
    min_ngram: int = 2
    position_cost: float = 0.15

    def __post_init__(self):
        if not (self.max_draft >= 1 and self.ngram >= self.min_ngram >= 1 and self.position_cost >= 0):
            raise ValueError(f"invalid speculation settings: {self}")


def batch_draft_len(rows: list[tuple[float, int]], cost: float) -> int:
    """The draft length of a step whose rows are ``(acceptance rate, tokens it can draft)`` (0 for a row
    with no draft): the most expected tokens per unit of cost over all rows."""
    width_cost = cost * math.sqrt(len(rows))
    gains = [0.0] * len(rows)   # row i's expected accepted tokens at the current k
    terms = [1.0] * len(rows)
    best, best_rate = 0, float(len(rows))
    for k in range(1, max((n for _, n in rows), default=0) + 1):
        for i, (p, n) in enumerate(rows):
            if k <= n:
                terms[i] *= p
                gains[i] += terms[i]
        rate = (len(rows) + sum(gains)) / (1.0 + width_cost * k)
        if rate > best_rate * 1.02:  # a bet that barely pays is not worth the wider pass
            best, best_rate = k, rate
    return best


class Drafter:
    """One sequence's context, indexed by its n-grams, and its acceptance record."""

    __slots__ = ("config", "tokens", "_index", "accepted", "proposed", "drafted", "taken")

    def __init__(self, tokens, config: SpecConfig):
        self.config = config
        self.tokens: list[int] = []
        # n -> {n-gram: the position just after its latest occurrence that is not the suffix itself}
        self._index: dict[int, dict[tuple, int]] = {n: {} for n in range(config.min_ngram, config.ngram + 1)}
        self.accepted = self.proposed = 0.0   # the evidence, fading
        self.drafted = self.taken = 0         # totals, for the counters
        self.extend(tokens)

    def extend(self, tokens) -> None:
        for t in tokens:
            self.tokens.append(int(t))
            end = len(self.tokens) - 1  # index the n-grams ending just before the new token: never the suffix
            for n, index in self._index.items():
                if end >= n:
                    index[tuple(self.tokens[end - n : end])] = end

    def truncate(self, length: int) -> None:
        """Forget the tokens after ``length`` (a sequence ended inside a step's accepted tokens)."""
        assert length <= len(self.tokens)
        kept, self.tokens = self.tokens[:length], []
        for index in self._index.values():  # rebuilt: a later occurrence had replaced an earlier one
            index.clear()
        self.extend(kept)

    @property
    def rate(self) -> float:
        """The drafted tokens' acceptance rate this sequence has shown lately."""
        return (self.accepted + PRIOR_ACCEPTED) / (self.proposed + PRIOR_PROPOSED)

    def propose(self, room: int) -> list[int]:
        """What followed the newest tokens' latest earlier occurrence: up to ``room`` and ``max_draft``
        tokens ([] when nothing matches). Each call is a step: old evidence fades."""
        self.accepted *= DECAY
        self.proposed *= DECAY
        k = min(room, self.config.max_draft)
        if k <= 0:
            return []
        toks = self.tokens
        for n in range(self.config.ngram, self.config.min_ngram - 1, -1):
            if len(toks) <= n:
                continue
            at = self._index[n].get(tuple(toks[-n:]))
            if at is not None:
                return toks[at : at + k]
        return []

    def record(self, drafted: int, accepted: int) -> None:
        self.proposed += drafted
        self.accepted += accepted
        self.drafted += drafted
        self.taken += accepted
