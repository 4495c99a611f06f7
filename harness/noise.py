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

from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import functools
import json
import os
import time

import mlx.core as mx

# what a variant differs in: a prefill cut into chunks of these sizes (mlx-lm's prefill_step_size),
# and a batch of this many identical rows. A quantized KV cache's spread is a draw of which values land
# on the other rounding step: (3, 16) and 2 rows alone missed one the engine hit (llama, 8-bit KV), and
# with 2 OpenBLAS threads sets without 16 missed by up to 20x; (3, 7, 16) and 2 rows held every case of
# the survey in docs/tests.md under four kernel configurations
CHUNKS = (3, 7, 16)
ROWS = (2,)
# a chunked variant of a long prompt takes at most this many passes, its chunks grown to fit: its cost stays
# a few one-shot prefills (a 900-token prompt in 3-token chunks is 300 passes); the survey's prompts of
# hundreds of tokens moved as far under 16- or 24-token chunks as under 3-token ones
MAX_PASSES = 32
# every variant a survey measures (SEMANTIC_NOISE_SURVEY): chunk sizes, row counts
SURVEY = ((1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24), (2, 3, 4, 8))
# the engine's computation differs from the reference in the same ways (chunks, batch shapes), compounded
# over more of them (speculative steps of several widths, caches rebuilt from blocks): measured on the
# tests' own models, its deviation stayed under 2.6x the variants' largest (docs/tests.md, "Tolerances
# from measured noise": 3,629 comparisons under Zen, Haswell and Sandybridge kernels and 2 threads)
SAFETY = 4.0
# a floor a few float32 ulps of a logprob of ~10 wide, for a reference whose variants agreed bit for bit
FLOOR = 1e-5
# a noise this large means the reference itself is broken (a NaN, a different model): no tolerance hides it
CEILING = 0.05
# A quantized KV cache's spread is a draw of which values land on the other rounding step, and how far one
# such value moves a logprob depends on where it lands: the variants of one history may hit none where the
# engine hits one (an AMD EPYC, tiny llama and Gemma with 8-bit KV: the engine 1.2e-5 and 4.5e-5 off where
# every variant of that history moved 1.7e-6 and 5.2e-6 at most). So a quantized reference's noise is at
# least the largest its variants measure on these probe histories (seed, tokens) of the same model and
# cache, once per process: on those two, 2e-5 to 4.4e-4, the size of one step landing elsewhere
PROBES = ((1000, 48), (1001, 48), (1002, 32), (1003, 64))
PROBE_STEPS = 8


def tolerance(noise: float) -> float:
    """What two correct computations may differ by, given the spread ``noise`` measured between two others."""
    return max(SAFETY * noise, FLOOR)


def spread(xs, ys) -> float:
    """The largest |x - y| over paired arrays (mlx or numpy): the noise between two correct computations."""
    import numpy as np

    worst = 0.0
    for x, y in zip(xs, ys, strict=True):
        a, b = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
        assert a.shape == b.shape, f"shapes {a.shape} and {b.shape}"
        worst = max(worst, float(np.max(np.abs(a - b), initial=0.0)))
    return worst


def assert_within(xs, ys, noise: float, what: str = "") -> None:
    """Assert that paired arrays differ by at most the tolerance a measured ``noise`` gives."""
    tol, d = tolerance(noise), spread(xs, ys)
    _log(what, noise, tol, d, {})
    assert noise <= CEILING, f"{what}: the measured noise {noise:.2e} is not float noise"
    assert d <= tol, f"{what}: |Δ| {d:.2e} > tolerance {tol:.2e} (noise {noise:.2e})"


@dataclass(frozen=True)
class Reference:
    """A greedy generation as mlx-lm computes it, with the spread of its logprobs measured here."""

    tokens: list[int]
    logprobs: list[float]        # of each chosen token
    margins: list[float]         # top-1 minus top-2 logprob at each step
    noise: float                 # the largest |Δ logprob| of a variant (module doc)
    spreads: dict = field(default_factory=dict)  # each variant's |Δ logprob|, by name ("chunk3", "rows2")
    prompt: int = 0                                # the prompt's length, in tokens
    seconds: float = 0.0                           # CPU seconds the reference and its variants took (0: memoized)
    # a quantized cache's probes (:func:`rounding_noise`) not measured yet: they can only raise the noise, so
    # :meth:`check` measures them only for a turn the variants' noise alone would fail
    pending: Callable[[], float] | None = field(default=None, repr=False, compare=False)

    @property
    def tolerance(self) -> float:
        return tolerance(self.noise)

    def first(self, n: int) -> "Reference":
        """The first ``n`` steps: a greedy generation's prefix is the shorter generation (its noise
        measured over more steps, never less)."""
        return Reference(self.tokens[:n], self.logprobs[:n], self.margins[:n], self.noise, self.spreads, self.prompt,
                         pending=self.pending)

    def probed(self) -> "Reference":
        """This reference with its pending probes measured (itself when none are pending)."""
        if self.pending is None:
            return self
        probes = self.pending()
        return Reference(self.tokens, self.logprobs, self.margins, max(self.noise, probes),
                         {**self.spreads, "probes": probes}, self.prompt, self.seconds)

    def check(self, tokens: Sequence[int], logprobs: Sequence[float], what: str = "") -> int:
        """Assert that ``tokens`` and ``logprobs`` are this reference's, within the tolerance; returns
        how many steps were compared (all of them but after a near-tie that chose the other token).
        Pending probes are measured first when the variants' noise alone would fail them."""
        if self.pending is not None:
            try:
                return replace(self, pending=None)._check(tokens, logprobs, what, log_failure=False)
            except AssertionError:
                return self.probed()._check(tokens, logprobs, what)
        return self._check(tokens, logprobs, what)

    def _check(self, tokens: Sequence[int], logprobs: Sequence[float], what: str, log_failure: bool = True) -> int:
        tol = self.tolerance
        log = log_failure
        assert self.noise <= CEILING, f"{what}: the reference's own noise {self.noise:.2e} is not float noise"
        assert len(tokens) == len(self.tokens), f"{what}: {len(tokens)} tokens, the reference has {len(self.tokens)}"
        worst = 0.0
        try:
            for i, (t, lp) in enumerate(zip(tokens, logprobs)):
                if t != self.tokens[i]:
                    assert self.margins[i] <= tol, (
                        f"{what}: step {i} chose {t}, the reference {self.tokens[i]} by a margin of "
                        f"{self.margins[i]:.2e} (tolerance {tol:.2e}, noise {self.noise:.2e}); "
                        f"tokens {list(tokens)} vs {self.tokens}")
                    return i  # a near-tie went the other way: what follows is another continuation
                worst = max(worst, abs(lp - self.logprobs[i]))
                assert abs(lp - self.logprobs[i]) <= tol, (
                    f"{what}: step {i} logprob {lp:.7f} vs the reference's {self.logprobs[i]:.7f}: "
                    f"|Δ| {abs(lp - self.logprobs[i]):.2e} > tolerance {tol:.2e} (noise {self.noise:.2e})")
            log = True
            return len(tokens)
        finally:
            if log:
                _log(what, self.noise, tol, worst, self.spreads, self.prompt, self.seconds)


def _log(what: str, noise: float, tol: float, deviation: float, spreads: dict, prompt: int = 0,
         seconds: float = 0.0) -> None:
    """With SEMANTIC_NOISE_LOG set, one JSON line per comparison (the test, the noise, the deviation
    found): how docs/tests.md's table of measured noise is made."""
    path = os.environ.get("SEMANTIC_NOISE_LOG")
    if path:
        doc = {"test": os.environ.get("PYTEST_CURRENT_TEST", "").removesuffix(" (call)"), "what": what,
               "noise": noise, "tolerance": tol, "deviation": deviation, "spreads": spreads, "prompt": prompt, "seconds": seconds,
               "coretype": os.environ.get("OPENBLAS_CORETYPE", ""),
               "threads": os.environ.get("OPENBLAS_NUM_THREADS", "")}
        with open(path, "a") as f:
            f.write(json.dumps(doc) + "\n")


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


def _greedy_forced(model, ids: Sequence[int], tokens: Sequence[int], make_cache: Callable[[], list], chunk: int):
    """The reference's own tokens scored by one prefill of the whole sequence in chunks of ``chunk``
    (teacher forcing): each chosen token's logprob from a pass over many positions where the reference
    decoded one token a step. What the engine does when it verifies drafts or prefills a turn after a
    reply; a pass costs about one decode step, so this variant costs a few prefills, not ``n`` steps."""
    seq, start = list(ids) + list(tokens[:-1]), len(ids) - 1
    cache, out, pos = make_cache(), [], 0
    while pos < len(seq):
        end = min(pos + chunk, len(seq)) if pos >= start else min(pos + chunk, start)
        logits = model(mx.array([seq[pos:end]]), cache=cache)[0]
        if end <= start:  # the prompt: only the cache (mlx-lm's prefill evaluates no logits)
            mx.eval([c.state for c in cache])
        else:
            rows = logits[max(start - pos, 0):]
            lp = rows - mx.logsumexp(rows, axis=-1, keepdims=True)
            out.extend((int(t), lp[i]) for i, t in enumerate(tokens[max(pos, start) - start:end - start]))
        pos = end
    return out


def _spread(ref, other) -> float:
    worst = 0.0
    for (t, row), (u, other_row) in zip(ref, other):
        if t != u:
            break
        worst = max(worst, abs(row[t].item() - other_row[t].item()))
    return worst


def few_passes(ids: Sequence[int]) -> dict:
    """The variants for a reference that must stay cheap (a real model's, or one of hundreds in the model
    matrix): the prompt and the reference's own tokens prefilled in chunks of about a quarter of the prompt
    (:func:`_greedy_forced`), no batch. A decoding variant costs its ``n`` decode steps again, seconds on a
    real model; on these float32 models one such chunking moved logprobs as far as the others did, or
    nearly (docs/tests.md)."""
    return {"chunks": (), "rows": (), "forced": (max(min(16, len(ids) // 2), -(-len(ids) // 4), 1),)}


_memo: dict = {}
_probes: dict = {}


def _quantized(make_cache: Callable[[], list]) -> bool:
    return any(getattr(c, "bits", None) for c in make_cache())


def rounding_noise(model, make_cache: Callable[[], list], key, chunks: Sequence[int] = CHUNKS,
                   rows: Sequence[int] = ROWS, forced: Sequence[int] = ()) -> float:
    """The largest spread the same variants measure on :data:`PROBES` with a quantized cache of ``key``'s
    geometry (memoized per model and ``key``; None: measured again)."""
    import numpy as np

    memo_key = (id(model), key, tuple(chunks), tuple(rows), tuple(forced))
    if key is not None and memo_key in _probes and _probes[memo_key][0] is model:
        return _probes[memo_key][1]
    worst = 0.0
    for seed, n in PROBES:
        ids = [int(t) for t in np.random.default_rng(seed).integers(1, 250, n)]
        worst = max(worst, reference(model, ids, PROBE_STEPS, make_cache, None, chunks, rows, forced, probe=False).noise)
    if key is not None:
        _probes[memo_key] = (model, worst)
    return worst


def _survey() -> set[str]:
    """The variants SEMANTIC_NOISE_SURVEY asks for besides the chosen ones: "1" all of :data:`SURVEY`, or
    names separated by commas ("chunk64,rows4")."""
    value = os.environ.get("SEMANTIC_NOISE_SURVEY", "")
    if value in ("", "0"):
        return set()
    if value == "1":
        return {f"chunk{c}" for c in SURVEY[0]} | {f"rows{r}" for r in SURVEY[1]}
    return {v.strip() for v in value.split(",") if v.strip()}


def reference(model, ids: Sequence[int], n: int, make_cache: Callable[[], list], key=None,
              chunks: Sequence[int] = CHUNKS, rows: Sequence[int] = ROWS, forced: Sequence[int] = (),
              probe: bool | str = True) -> Reference:
    """mlx-lm's greedy generation of ``n`` tokens after ``ids`` in caches from ``make_cache``, and its
    noise on this machine (module doc). ``key`` names the cache geometry for the memo (None: not
    memoized); a test comparing several runs with one reference measures it once, and a shorter one
    on the same ids is its prefix. ``chunks``, ``rows`` and ``forced`` (the reference's tokens prefilled
    in chunks of that size: :func:`_greedy_forced`) choose the variants. A quantized cache's noise is at
    least :func:`rounding_noise` (``probe``; "lazy": measured only when a check needs them,
    :attr:`Reference.pending`).

    With SEMANTIC_NOISE_SURVEY set, more variants run (:func:`_survey`) and their spreads are logged
    (SEMANTIC_NOISE_LOG) beside the chosen ones, which alone make the noise: how CHUNKS and ROWS
    were chosen."""
    ids = [int(t) for t in ids]
    memo_key = (id(model), key, tuple(ids), tuple(chunks), tuple(rows), tuple(forced)) if key is not None else None
    if memo_key in _memo:
        held, out = _memo[memo_key]
        if held is model and len(out.tokens) >= n:
            return out.first(n)
    started = time.process_time()
    ref = _greedy_chunked(model, ids, n, make_cache, max(len(ids), 1))
    fit = -(-(len(ids) - 1) // MAX_PASSES)
    chosen = {f"chunk{max(c, fit)}" for c in chunks} | {f"rows{r}" for r in rows} | {f"forced{max(c, fit)}" for c in forced}
    names = chosen | _survey()
    spreads = {}
    for name in sorted(names):
        size = int(name.removeprefix("chunk").removeprefix("rows").removeprefix("forced"))
        if name.startswith("forced"):
            spreads[name] = _spread(ref, _greedy_forced(model, ids, [t for t, _ in ref], make_cache, size))
        elif name.startswith("chunk"):
            if size >= len(ids) - 1:
                continue  # the one-shot prefill again
            spreads[name] = _spread(ref, _greedy_chunked(model, ids, n, make_cache, size))
        elif size > 1:
            spreads[name] = _spread(ref, _greedy_rows(model, ids, n, make_cache, size))
    measured = [v for k, v in spreads.items() if k in chosen]
    assert measured, "no variant to measure the noise against"
    pending = None
    if probe == "lazy" and _quantized(make_cache):
        pending = functools.partial(rounding_noise, model, make_cache, key, chunks, rows, forced)
    elif probe and _quantized(make_cache):
        spreads["probes"] = rounding_noise(model, make_cache, key, chunks, rows, forced)
        measured.append(spreads["probes"])
    top2 = [mx.topk(row, 2) for _, row in ref]
    out = Reference(
        tokens=[t for t, _ in ref],
        logprobs=[row[t].item() for t, row in ref],
        margins=[abs(a - b) for a, b in (t.tolist() for t in top2)],
        noise=max(measured),
        spreads=spreads,
        prompt=len(ids),
        seconds=time.process_time() - started,
        pending=pending,
    )
    if memo_key is not None:
        _memo[memo_key] = (model, out)  # held: the model's id is never another's while its entry lives
    return out
