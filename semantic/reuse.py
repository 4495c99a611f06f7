"""Which cached prefix a new prompt can start from.

A turn arrives as the agent's whole token history. Two sources can cover a
prefix of it:

- **own**: the agent's cache from its previous turn, cut at the first token
  where the histories differ (an edited or removed message). Everything at
  and after that point is dropped; a sliding layer whose window has moved
  past the cut cannot be cut there (see ``convert.covers``), so that source
  is refused rather than approximated;
- **pool**: the longest whole-block prefix whose blocks the pool holds for
  every layer, whoever stored them: another agent's identical system prompt
  and tools, or this agent's older blocks still cached in the pool.

The longer one wins; at least one token is always left to prefill::

    cached history   [ sys+tools | turn 1 | turn 2 ......... ]
    new history      [ sys+tools | turn 1 | turn 2 (edited) ...... ]
                                          ^ first difference d
    own              [0, d)              if every layer still holds it
    pool             [0, k * 256)        k * 256 <= d, every block a verified hit

Nothing after ``d`` is reused by either source: a pooled block's key chains
every token before it, and every hit is confirmed by its token ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from semantic import convert
from semantic.blocks import AgentBlocks
from semantic.pool import BlockPool

OWN, OWN_CUT, POOL, NONE = "own", "own-cut", "pool", "none"


@dataclass(slots=True)
class Reuse:
    """What a request starts from: ``cached`` tokens from ``source``.

    ``blocks`` are the blocks to rebuild the first ``cached`` tokens from
    (the agent's own, or new pool references the caller must release when
    ``owned`` is true).
    """

    source: str
    cached: int
    blocks: AgentBlocks | None = None
    owned: bool = False

    def __post_init__(self):
        assert self.source in (OWN, OWN_CUT, POOL, NONE), self.source
        assert (self.blocks is None) == (self.cached == 0), (self.source, self.cached)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def choose_start(
    pool: BlockPool, token_ids: Sequence[int], own: AgentBlocks | None, release=None, root: int | None = None
) -> Reuse:
    """The longest reusable prefix of ``token_ids`` (see the module doc).

    Takes pool references only for a ``POOL`` result (``owned``); nothing
    else changes. Pooled blocks are looked up under ``root`` (a tenant's
    salt), and an own cache keyed under another root is not used. The caller holds the pool's lock, if threads share it.
    """
    ids = tuple(map(int, token_ids))
    limit = len(ids) - 1  # the last token must be prefilled to produce logits
    own_len = 0
    if own is not None and not own.released and limit > 0 and own.root == root:
        own_len = min(common_prefix(own.token_ids, ids), limit)
        if own_len and not convert.covers(own, own_len):
            own_len = 0
    shared = convert.prefix_cache(pool, ids, release, longer_than=own_len, root=root)
    if shared is not None:
        return Reuse(POOL, shared.total_tokens, shared, owned=True)
    if own_len:
        source = OWN if own_len == own.total_tokens else OWN_CUT
        return Reuse(source, own_len, own)
    return Reuse(NONE, 0)
