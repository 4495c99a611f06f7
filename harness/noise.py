"""How far a correct computation moves, measured where it runs, and the tolerance it gives.

Float sums taken in another order move a logprob in its last bits. How far depends on the BLAS
kernels this CPU gets (OpenBLAS picks them by CPU: ``OPENBLAS_CORETYPE``), its threads, the batch
shape and the prefill's chunking; a quantized KV cache amplifies it (a value near a rounding edge
lands on the other step, and every later token attends over it). A constant that held on one
machine fails on another, so a comparison against a reference measures the reference's own spread
on the running machine::

    reference   mlx-lm's generate_step: one-shot prefill, a batch of one, greedy
    variants    the same prefilled in chunks (CHUNKS), and decoded as a batch of identical rows
    noise       the largest |Δ logprob| of the chosen tokens between the reference and a variant,
                over the steps before their first different token
    tolerance   SAFETY x noise, at least FLOOR

Tokens are then compared exactly wherever the reference's top-2 margin is wider than the
tolerance; at a near-tie either token is correct, and what follows a different one is another
continuation, so the comparison ends there (:meth:`Reference.check`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import mlx.core as mx

# what a variant differs in: a prefill cut into chunks of these sizes (mlx-lm's prefill_step_size),
# and a batch of this many identical rows
CHUNKS = (3, 16)
ROWS = 2
# the engine's computation differs from the reference in the same ways (chunks, batch shapes), compounded
# over more of them (speculative steps of several widths, caches rebuilt from blocks): measured on the
# tests' own models, its deviation stayed under 3x the variants' largest (EXP in docs/tests.md)
SAFETY = 4.0
# a floor a few float32 ulps of a logprob of ~10 wide, for a reference whose variants agreed bit for bit
FLOOR = 1e-5
# a noise this large means the reference itself is broken (a NaN, a different model): no tolerance hides it
CEILING = 0.05


@dataclass(frozen=True)
class Reference:
    """A greedy generation as mlx-lm computes it, with the spread of its logprobs measured here."""

    tokens: list[int]
    logprobs: list[float]        # of each chosen token
    margins: list[float]         # top-1 minus top-2 logprob at each step
    noise: float                 # the largest |Δ logprob| of a variant (module doc)

    @property
    def tolerance(self) -> float:
        return max(SAFETY * self.noise, FLOOR)

    def check(self, tokens: Sequence[int], logprobs: Sequence[float], what: str = "") -> int:
        """Assert that ``tokens`` and ``logprobs`` are this reference's, within the tolerance; returns
        how many steps were compared (all of them but after a near-tie that chose the other token)."""
        tol = self.tolerance
        assert self.noise <= CEILING, f"{what}: the reference's own noise {self.noise:.2e} is not float noise"
        assert len(tokens) == len(self.tokens), f"{what}: {len(tokens)} tokens, the reference has {len(self.tokens)}"
        for i, (t, lp) in enumerate(zip(tokens, logprobs)):
            if t != self.tokens[i]:
                assert self.margins[i] <= tol, (
                    f"{what}: step {i} chose {t}, the reference {self.tokens[i]} by a margin of "
                    f"{self.margins[i]:.2e} (tolerance {tol:.2e}, noise {self.noise:.2e}); "
                    f"tokens {list(tokens)} vs {self.tokens}")
                return i  # a near-tie went the other way: what follows is another continuation
            assert abs(lp - self.logprobs[i]) <= tol, (
                f"{what}: step {i} logprob {lp:.7f} vs the reference's {self.logprobs[i]:.7f}: "
                f"|Δ| {abs(lp - self.logprobs[i]):.2e} > tolerance {tol:.2e} (noise {self.noise:.2e})")
        return len(tokens)


def _greedy_chunked(model, ids: Sequence[int], n: int, make_cache: Callable[[], list], chunk: int):
    """mlx-lm's own generate_step, its prefill in chunks of ``chunk``: (token, logprob row) per step."""
    from mlx_lm.generate import generate_step

    out = []
    steps = generate_step(mx.array(list(ids)), model, prompt_cache=make_cache(), prefill_step_size=chunk,
                          sampler=lambda x: mx.argmax(x, -1))
    for (tok, row), _ in zip(steps, range(n)):
        out.append((int(tok), row))
    return out


def _greedy_rows(model, ids: Sequence[int], n: int, make_cache: Callable[[], list], rows: int):
    """The same generation as a batch of ``rows`` identical rows (other matmul shapes); row 0's steps."""
    cache = make_cache()
    logits = model(mx.array([list(ids)] * rows), cache=cache)[:, -1, :]
    out = []
    for _ in range(n):
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        tok = int(mx.argmax(lp[0]).item())
        out.append((tok, lp[0]))
        logits = model(mx.array([[tok]] * rows), cache=cache)[:, -1, :]
    return out


def _spread(ref, other) -> float:
    worst = 0.0
    for (t, row), (u, other_row) in zip(ref, other):
        if t != u:
            break
        worst = max(worst, abs(row[t].item() - other_row[t].item()))
    return worst


_memo: dict = {}


def reference(model, ids: Sequence[int], n: int, make_cache: Callable[[], list], key=None) -> Reference:
    """mlx-lm's greedy generation of ``n`` tokens after ``ids`` in caches from ``make_cache``, and its
    noise on this machine (module doc). ``key`` names the cache geometry for the memo (None: not
    memoized); a test comparing several runs with one reference measures it once."""
    memo_key = (id(model), key, tuple(ids), n) if key is not None else None
    if memo_key in _memo:
        return _memo[memo_key]
    ref = _greedy_chunked(model, ids, n, make_cache, max(len(ids), 1))
    variants = [_greedy_chunked(model, ids, n, make_cache, c) for c in CHUNKS if c < len(ids) - 1]
    variants.append(_greedy_rows(model, ids, n, make_cache, ROWS))
    tokens = [t for t, _ in ref]
    top2 = [mx.topk(row, 2) for _, row in ref]
    out = Reference(
        tokens=tokens,
        logprobs=[row[t].item() for t, row in ref],
        margins=[abs(a - b) for a, b in (t.tolist() for t in top2)],
        noise=max(_spread(ref, v) for v in variants),
    )
    if memo_key is not None:
        _memo[memo_key] = out
    return out
