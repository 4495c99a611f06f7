"""Prompt-lookup drafts: the next tokens a sequence will probably write, copied from its own context.

A coding agent's reply repeats its context: the file it edits, the test it
re-runs, the path it names again. When the newest ``n`` tokens of a
sequence (prompt and generated) occurred earlier, the tokens that followed
them there are a cheap guess at what comes next; the step loop feeds the
guess beside the real next token and keeps the longest prefix the model
agrees with (``semantic.steploop``), so the output is the model's own::

    context  ... def load ( path ) : ...... return load ( path ) : ?
                     └── earlier: "load ( path )" was followed by ") :" ...
    suffix                                     "load ( path )"  ─► draft  ": \\n    return"

How many tokens to draft is a bet. A forward pass over ``1 + k`` tokens
costs about ``1 + cost * k`` decode steps (memory-bound on a GPU: cost is
near 0; about 0.15 on a 2-core CPU) and gains, if each drafted token is
accepted with probability ``p``, ``p + p^2 + ... + p^k`` tokens. ``k`` is
the one maximizing tokens per unit of cost under the sequence's own
acceptance rate, and 0 (no draft, no cost) when nothing pays: a sequence
whose drafts keep failing stops drafting, and its rate drifts back towards
the prior so it tries again later.
"""

from __future__ import annotations

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


def best_draft_len(p: float, cost: float, most: int) -> int:
    """The ``k`` in ``0..most`` with the most expected tokens per unit of cost: (1 + p + ... + p^k) / (1 + cost*k)."""
    best, best_rate, gain, term = 0, 1.0, 1.0, 1.0
    for k in range(1, most + 1):
        term *= p
        gain += term
        rate = gain / (1.0 + cost * k)
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

    def draft(self, room: int) -> list[int]:
        """Up to ``room`` tokens to verify after the newest one; [] when no bet pays or nothing matches."""
        self.accepted *= DECAY
        self.proposed *= DECAY
        rate = (self.accepted + PRIOR_ACCEPTED) / (self.proposed + PRIOR_PROPOSED)
        k = best_draft_len(rate, self.config.position_cost, min(room, self.config.max_draft))
        if k == 0:
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
