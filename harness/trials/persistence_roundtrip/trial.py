"""EXP-005: a cache saved in one process continues exactly in another; and what saving and loading cost.

Round trip: generate with the
engine, save the cache with ``cachefile.save``, load it in a fresh Python
process, continue, and compare with a fresh prefill of the same tokens run
beside it in that process.

Speed (``harness.trials.persistence_roundtrip.speed``): on the same synthetic caches in one
run, interleaved, our durable save and verified load against mlx-lm's
``save_prompt_cache`` / ``load_prompt_cache`` and a raw ``readinto`` floor.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from harness import plots
from harness.common.children import run_child
from harness.executors import logprob_diff, make_executor, run_one
from harness.prompts import history_ids
from harness.trials.base import TrialKind, Param, register
from harness.trials.persistence_roundtrip import speed
from semantic import cachefile


def run(ctx) -> None:
    p, tok, res = ctx.params, ctx.loaded.tokenizer, ctx.results
    executor = make_executor(ctx.loaded)
    first = run_one(executor, "agent", history_ids(tok, p["history_tokens"]), None, p["max_tokens"])
    T = tok.encode(p["continuation"], add_special_tokens=False)
    with tempfile.TemporaryDirectory(prefix="exp005-") as tmp:
        path = Path(tmp) / "agent.safetensors"
        cachefile.save(path, first.blocks, model_fingerprint=ctx.loaded.fingerprint)
        out = run_child("roundtrip", {"model": ctx.model_name, "variant": ctx.loaded.variant, "path": str(path),
                                      "continuation": T, "steps": p["continue_tokens"]}, "round-trip child")
        res.output("file_bytes", path.stat().st_size)
    cached, fresh = out["cached"], out["fresh"]
    diff = logprob_diff(cached["logprobs"], fresh["logprobs"])
    res.output("roundtrip", {"history_tokens": first.blocks.total_tokens, "load_ms_in_fresh_process": out["load_ms"],
                             "cached_tokens": cached["tokens"], "fresh_tokens": fresh["tokens"],
                             "prefilled_with_cache": cached["prompt_tokens"], "text": tok.decode(cached["tokens"])})
    res.check("roundtrip_tokens_match", cached["tokens"] == fresh["tokens"])
    res.check("roundtrip_max_abs_logprob_diff", diff)

    geos = p["speed_geometries"]
    ctx.progress.total = len(geos)
    summaries = []
    with tempfile.TemporaryDirectory(prefix="exp005-speed-") as tmp:
        for name in geos:
            geo = speed.measure(name, ctx.config.protocol, Path(tmp))
            for op, s in geo.samples.items():
                res.metric(f"{name}/{op}_ms", s.ms, "ms", description=f"{op}, file {geo.file_mb:.1f} MB")
            for cmp_name, (a, b) in speed.COMPARISONS.items():
                c = res.compare(f"{name}/{cmp_name}", f"{name}/{a}_ms", f"{name}/{b}_ms")
                res.check(f"{name}/{cmp_name}".replace("/", "_").replace("@", "_"), c["ratio_p50"])
            summaries.append(geo.summary())
            ctx.progress.update(1)
    res.output("speed", summaries)
    if "bars" in ctx.config.plots and summaries:
        s = summaries[-1]
        ctx.plots.append(plots.bars_plot(
            {op: s["p50_ms"][op] for op in ("floor", "floor_aligned", "load", "mlxlm_load", "save", "mlxlm_save", "mlxlm_save_fsync")},
            ctx.plot_path("speed"), "p50 ms", f"EXP-005 {s['name']}: {s['file_mb']:.0f} MB file"))


KIND = register(TrialKind(
    name="persistence_roundtrip",
    run=run,
    params={
        "history_tokens": Param(int, 96, "tokens of built-in history text generated from", min=1),
        "max_tokens": Param(int, 4, "tokens generated before saving", min=1),
        "continuation": Param(str, " The museum", "text continued in the fresh process"),
        "continue_tokens": Param(int, 16, "tokens generated after loading, compared with a fresh prefill", min=1),
        "speed_geometries": Param(list, ["smollm2-135m@2k", "smollm2-135m@8k", "gemma3-12b@8k"],
                                  "synthetic caches timed", tuple(sorted(speed.GEOMETRIES))),
    },
    plots=frozenset({"bars"}),
    trial_code=(speed.measure, speed.synthetic_blocks, cachefile.save, cachefile.load),
))
