"""Throughput on this machine: prefill and decode tokens/s of each (variant, BLAS) side.

The point is the fast path on a CPU: the exact quantized conversion on
the Linux wheel's bundled reference BLAS (what ran before) against the float32
variant on an optimized BLAS (what CPU runs use now). The BLAS is fixed when a
process first loads MLX, so each side runs in its own child process
(``harness.trials.throughput.child``), and the sides take turns, A B then B A, trial by
trial, so that machine drift hits both.

Per side: prefill tokens/s at each of ``prefill_tokens`` (a fresh cache up to
the first token, materialized) and decode tokens/s at each batch size in
``decode_batches`` (prefill excluded). Lengths of at least ``long_tokens`` are
measured only in the first ``long_trials`` trials: on the slow side a
2048-token prefill of Gemma 3 takes minutes.
"""

from __future__ import annotations

import os

import numpy as np

from harness import plots
from harness.common.children import run_child
from harness.trials.base import TrialKind, Param, register
from harness.trials.throughput import child

# side name -> (model variant, SEMANTIC_BLAS value); the first is the baseline
SIDES = {
    "quantized_bundled": ("quantized", "off"),
    "f32_openblas": ("f32", "auto"),
}
BASE, FAST = "quantized_bundled", "f32_openblas"


def _run_side(side: str, spec: dict) -> dict:
    variant, blas_env = SIDES[side]
    # The variant travels in the spec; the BLAS cannot: it must be chosen before the child imports MLX.
    env = dict(os.environ, SEMANTIC_BLAS=blas_env)
    return run_child("throughput", {**spec, "variant": variant}, f"throughput child ({side})", env)


def run(ctx) -> None:
    from harness import models

    p, res = ctx.params, ctx.results
    for variant in ("quantized", "f32"):  # prepared once here, not raced by the children
        models.prepare(ctx.model_name, variant=variant)
    trials = ctx.config.protocol.trials
    prefill = {s: {n: [] for n in p["prefill_tokens"]} for s in SIDES}
    decode = {s: {b: [] for b in p["decode_batches"]} for s in SIDES}
    about = {}
    ctx.progress.total = trials * len(SIDES)
    for trial in range(trials):
        lengths = [n for n in p["prefill_tokens"] if n < p["long_tokens"] or trial < p["long_trials"]]
        spec = {"model": ctx.model_name, "prefill_tokens": lengths, "decode_batches": p["decode_batches"],
                "decode_tokens": p["decode_tokens"], "decode_prompt_tokens": p["decode_prompt_tokens"],
                "warmup": ctx.config.protocol.warmup, "seed": p["seed"] + trial}
        order = list(SIDES) if trial % 2 == 0 else list(SIDES)[::-1]
        for side in order:
            out = _run_side(side, spec)
            for n in lengths:
                prefill[side][n].append(out["prefill_tps"][str(n)])
            for b in p["decode_batches"]:
                decode[side][b].append(out["decode_tps"][str(b)])
            about[side] = {k: out[k] for k in ("variant", "fingerprint", "blas", "matmul_gflops_f32")}
            ctx.progress.update(1)

    res.output("sides", about)
    for s in SIDES:
        for n, v in prefill[s].items():
            res.metric(f"prefill_tps_{s}_{n}", v, "tokens/s", "higher", f"prefill of {n} fresh tokens, {s}")
        for b, v in decode[s].items():
            res.metric(f"decode_tps_{s}_b{b}", v, "tokens/s", "higher", f"decode, batch of {b}, {s}")
    med = lambda xs: float(np.median(xs))  # noqa: E731
    for n in p["prefill_tokens"]:
        res.check(f"prefill_speedup_{n}", med(prefill[FAST][n]) / med(prefill[BASE][n]))
    for b in p["decode_batches"]:
        res.check(f"decode_speedup_b{b}", med(decode[FAST][b]) / med(decode[BASE][b]))
    goal = p["prefill_goal"].get(ctx.model_name)
    n_goal = p["goal_tokens"]
    res.check("prefill_goal", goal)
    res.check("prefill_goal_met", goal is None or res.doc["checks"][f"prefill_speedup_{n_goal}"] >= goal)
    res.check("fast_side_blas", about[FAST]["blas"])
    if "throughput" in ctx.config.plots:
        ctx.plots.append(plots.throughput_plot(
            {f"prefill {n}": {s: med(prefill[s][n]) for s in SIDES} for n in p["prefill_tokens"]}
            | {f"decode b={b}": {s: med(decode[s][b]) for s in SIDES} for b in p["decode_batches"]},
            ctx.plot_path("throughput"), "tokens/s (median, log scale)",
            f"{ctx.model_name}: tokens/s per side (f32 side on {about[FAST]['blas']})"))


def _validate(p: dict) -> None:
    if p["goal_tokens"] not in p["prefill_tokens"]:
        raise ValueError("goal_tokens must be one of prefill_tokens")


KIND = register(TrialKind(
    name="throughput",
    run=run,
    params={
        "prefill_tokens": Param(list, [128, 512, 2048], "prompt lengths whose prefill is timed", nonempty=True, min=1),
        "decode_batches": Param(list, [1, 8], "batch sizes whose decode is timed", nonempty=True, min=1),
        "decode_tokens": Param(int, 16, "tokens each sequence decodes (after its first)", min=2),
        "decode_prompt_tokens": Param(int, 64, "prompt length of each decoding sequence"),
        "long_tokens": Param(int, 2048, "prefill lengths from here on are timed in the first long_trials only"),
        "long_trials": Param(int, 1, "trials that time the long prefills", min=1),
        "goal_tokens": Param(int, 512, "prefill length the speedup goal is read at"),
        "prefill_goal": Param(dict, {"smollm2-135m": 10.0, "gemma3-270m": 5.0},
                              "model -> prefill speedup goal (f32+optimized BLAS over quantized+bundled)"),
        "seed": Param(int, 0, "random prompt ids"),
    },
    plots=frozenset({"throughput"}),
    needs_model=False,
    validate=_validate,
    trial_code=(_run_side, child.main, child.prefill_seconds, child.decode_tokens_per_s),
))
