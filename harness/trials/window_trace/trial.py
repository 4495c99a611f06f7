"""EXP-021: a sliding-window model (Gemma 3 270M, window 512) on a coding-agent trace, against
``mlx_lm.server``; SmolLM2 (global attention only) on the same trace as the control.

Per model, ours (``semantic serve``) and ``mlx_lm.server`` load the same float32 directory (OpenBLAS for
both: ``harness.servers.blas``) and take the trace's steps in turn (``harness.trials.window_trace.trace``):
agents' cold first turns, their appends of tool output, sub-agents on an agent's system prompt. Every
step records client TTFT and the cached tokens each server reported. Then, with the servers stopped,
one append turn of the first model is profiled in this process
(``harness.trials.window_trace.profile``): where ours' time goes beside the forward pass alone.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import traceback
from pathlib import Path

from harness.trials.base import TrialKind, Param, register


def run(ctx) -> None:
    from harness.servers.targets import ROOT

    p = ctx.params
    # every server imports semantic from this checkout, not from wherever the venv's editable install points
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT.resolve()), *filter(None, [os.environ.get("PYTHONPATH")])])
    work = Path(tempfile.mkdtemp(prefix="exp021-", dir=p["work_dir"] or None))
    out: dict = {"models": {}, "failed": []}
    ctx.progress.total = len(p["models"]) + bool(p["profile_reps"])
    try:
        for m in p["models"]:
            try:
                out["models"][m] = _serve(m, p, work / m)
            except Exception as exc:  # recorded (a P0 fails); the other model still runs
                out["failed"].append({"part": m, "error": "".join(traceback.format_exception(exc))[-6000:]})
                print(f"EXP-021 {m} failed: {exc}", file=sys.stderr)
            ctx.progress.update(1)
        if p["profile_reps"] and p["models"][0] in out["models"]:
            from harness import models
            from harness.trials.window_trace.profile import profile_append

            m = p["models"][0]
            try:
                out["models"][m]["profile"] = profile_append(
                    models.prepared_dir(m, models.default_variant("auto")), p["profile_cached_tokens"],
                    p["tool_tokens"], p["profile_reps"])
            except Exception as exc:
                out["failed"].append({"part": f"{m} profile", "error": "".join(traceback.format_exception(exc))[-6000:]})
            ctx.progress.update(1)
    finally:
        if not p["keep_work_dir"]:
            shutil.rmtree(work, ignore_errors=True)
    _record(ctx, out)


def _serve(model: str, p: dict, work: Path) -> dict:
    from mlx_lm.utils import load_tokenizer

    from harness import models
    from harness.servers.loadgen import chat_counter
    from harness.servers.phases import Bench
    from harness.servers.targets import MLX_LM, OURS, TARGETS
    from harness.trials.window_trace.trace import Trace

    model_dir = models.prepare(model, variant=models.default_variant("auto"))
    tok = load_tokenizer(model_dir)
    count_text = lambda t: len(tok.encode(t, add_special_tokens=False))  # noqa: E731
    bench = Bench(model_dir, model, work, chat_counter(tok), count_text, {}, p["max_tokens"], {})
    trace = Trace(bench, tok, agents=p["agents"], rounds=p["rounds"], system_tokens=p["system_tokens"],
                  tool_tokens=p["tool_tokens"], subagents=p["subagents"], subagents_after=p["subagents_after"],
                  max_tokens=p["max_tokens"])
    try:
        bench.start_all([TARGETS[OURS], TARGETS[MLX_LM]], {}, "run")
        trace.run()
    except Exception as exc:
        tails = "\n".join(f"--- {s.name} ---\n{s.running.log_tail(2500)}" for s in bench.servers)
        raise RuntimeError(f"{exc!r}\n{tails}") from exc
    finally:
        bench.stop_all()
    return {"model_dir": str(model_dir), "system_tokens": p["system_tokens"], "rows": trace.rows,
            "events": bench.events}


def _record(ctx, out: dict) -> None:
    from harness.trials.window_trace.report import KINDS, checks, readme, short

    c = checks(out)
    ctx.results.checks(c)
    for m, d in out["models"].items():
        for srv in {r["server"] for r in d["rows"]}:
            for kind in KINDS:
                xs = [r["ttft_s"] for r in d["rows"] if r["server"] == srv and r["kind"] == kind and r["ttft_s"]]
                if xs:
                    ctx.results.metric(f"ttft_{short(m)}_{kind}_{srv}", xs, "s", description=f"client TTFT, {kind}, {srv}")
    for k in ("models", "failed"):
        ctx.results.output(k, out.get(k))
    (ctx.out_dir / "README.md").write_text(readme(ctx, out, c))


KIND = register(TrialKind(
    name="window_trace",
    run=run,
    params={
        "models": Param(list, ["gemma3-270m", "smollm2-135m"], "served models (registered names); the first is profiled",
                        nonempty=True),
        "agents": Param(int, 3, "agents, each with a system prompt of its own", min=1),
        "rounds": Param(int, 8, "turns per agent (the first cold, then appends)", min=2),
        "system_tokens": Param(int, 1000, "each agent's system prompt", min=16),
        "tool_tokens": Param(int, 250, "tool output appended per turn", min=16),
        "subagents": Param(int, 1, "sub-agents per agent on its system prompt", min=0),
        "subagents_after": Param(int, 4, "the round after which they start", min=1),
        "max_tokens": Param(int, 8, "max_tokens of every turn (greedy)", min=1),
        "profile_reps": Param(int, 3, "append turns profiled in this process (0: none)", min=0),
        "profile_cached_tokens": Param(int, 2000, "the profiled agent's cache before the append", min=16),
        "work_dir": Param(str, "", "servers' state (default: the system's temporary directory)"),
        "keep_work_dir": Param(bool, False, "leave the servers' state and logs behind"),
    },
    needs_model=False,
))
