"""EXP-019: several models behind one ``semantic serve`` (issue 40), measured from the client.

Two models (``main``: Gemma 3 270M, ``small``: SmolLM2-135M, float32 weights), two phases, each on its own
servers (``harness.trials.multi_model``):

1. **Switching** (``switching``): a fleet server whose ``--models-mb`` holds one model, so each turn after
   the first unloads one model and loads the other; its first turn on each model against a server of that
   model alone (first turn after a start) and ``mlx_lm.server`` doing the same switch; each agent's next
   turn after its model came back, which must find its previous prompt and reply cached (from disk) and
   reply as a fresh prefill does.
2. **Both loaded** (``concurrent``): both models pinned in one server against two single-model servers on
   the same cores, measured alternately, ``conc_agents`` agents per model at once: per-model TTFT.

Throughout, the fleet server's RSS and ``/v1/cache/stats`` ``fleet`` are sampled every ``sample_s``; its RSS
before any request, with no model loaded, is the overhead allowed above ``--models-mb``.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import traceback
from pathlib import Path

from harness.trials.base import TrialKind, Param, register

PHASES = ("switching", "concurrent")
MB = 2**20


def budgets(p: dict, loaded_mb: dict[str, float], fixed_mb: float = 0.0) -> dict[str, int]:
    """``--models-mb`` of each phase where the config leaves it 0: switching holds the largest model and
    ``switch_fit`` of the smallest (never both); both loaded holds both with ``conc_slack`` to spare.
    A model counts as the fleet counts it before a load (``semantic.serve.fleet.footprint``): ``loaded_mb``
    (weights, pool, a turn's working memory) beside ``fixed_mb`` (the runtime and both kept tokenizers)."""
    need = sorted(loaded_mb.values())
    return {"switch_models_mb": p["switch_models_mb"] or int(fixed_mb + need[-1] + p["switch_fit"] * need[0]),
            "conc_models_mb": p["conc_models_mb"] or int((fixed_mb + sum(need)) * (1 + p["conc_slack"]))}


def footprints(dirs: dict[str, Path], pool_mb: int) -> tuple[dict[str, float], float]:
    """Each model's loaded MB and the fixed MB (the runtime, every tokenizer), as the fleet estimates them."""
    from semantic.serve.fleet import footprint

    fp = {m: footprint.footprint(d, pool_mb * MB) for m, d in dirs.items()}
    return ({m: f.loaded / MB for m, f in fp.items()},
            (footprint.RUNTIME_BYTES + sum(f.tokenizer for f in fp.values())) / MB)


def run(ctx) -> None:
    from mlx_lm.utils import load_tokenizer

    from harness import models as registry
    from harness.trials.multi_model.servers import model_mb
    from harness.prompts import system_prompt

    p = dict(ctx.params)
    variant = registry.default_variant(ctx.config.model_variant)
    dirs = {"main": Path(p["main_dir"] or registry.prepare(p["main_model"], variant=variant)),
            "small": Path(p["small_dir"] or registry.prepare(p["small_model"], variant=variant))}
    p.update(budgets(p, *footprints(dirs, p["pool_mb"])))
    systems = {m: system_prompt(load_tokenizer(d), p["system_tokens"]) for m, d in dirs.items()}
    work = Path(tempfile.mkdtemp(prefix="exp019-", dir=p["work_dir"] or None))
    out: dict = {"models": {m: str(d) for m, d in dirs.items()},
                 "weights_mb": {m: model_mb(d) for m, d in dirs.items()},
                 "switch_models_mb": p["switch_models_mb"], "conc_models_mb": p["conc_models_mb"], "failed": []}
    ctx.progress.total = len(p["phases"])
    try:
        for name in (n for n in PHASES if n in p["phases"]):
            try:
                out[name] = _phase(name, p, dirs, systems, work / name)
                if out[name].get("error"):
                    print(f"EXP-019 {name} stopped early: {out[name]['error'][:2000]}", file=sys.stderr)
            except Exception as exc:  # recorded (a P0 fails); the other phase still runs
                out["failed"].append({"part": name, "error": "".join(traceback.format_exception(exc))[-6000:]})
                print(f"EXP-019 {name} failed: {exc}", file=sys.stderr)
            ctx.progress.update(1)
    finally:
        if not p["keep_work_dir"]:
            shutil.rmtree(work, ignore_errors=True)
    _record(ctx, p, out)


def _phase(name: str, p: dict, dirs: dict, systems: dict, work: Path) -> dict:
    from harness.trials.multi_model.concurrent import run_concurrent
    from harness.trials.multi_model.switching import run_switching

    return (run_switching if name == "switching" else run_concurrent)(p, dirs, systems, work)


def compact(phase: dict) -> dict:
    """A phase's samples, small enough to commit: ``[t, phase, RSS MB, of it mapped files MB]`` per sample,
    the fleet's resident MB and loading model only where they changed."""
    out = {k: v for k, v in phase.items() if k not in ("rss", "fleet")}
    out["rss_mb"] = [[r["t"], r["phase"], round(r["rss_bytes"] / MB, 1), round(r.get("file_bytes", 0) / MB, 1)]
                     for r in phase.get("rss") or []]
    fleet, last = [], None
    for f in phase.get("fleet") or []:
        key = (f["phase"], f.get("resident_bytes"), f.get("loading"), f.get("budget_bytes"))
        if key != last:
            resident = None if f.get("resident_bytes") is None else round(f["resident_bytes"] / MB, 1)
            fleet.append([f["t"], f["phase"], resident, f.get("loading"), f.get("states")])
            last = key
    out["fleet_changes"] = fleet
    return out


def _record(ctx, p: dict, out: dict) -> None:
    from harness.trials.multi_model.report import checks, readme

    res = ctx.results
    c = checks(out)
    res.checks(c)
    _metrics(res, out)
    for k in ("models", "weights_mb", "switch_models_mb", "conc_models_mb", "failed"):
        res.output(k, out.get(k))
    for k in PHASES:
        res.output(k, compact(out[k]) if out.get(k) else None)
    _plot(ctx, out)
    run = {"run_id": res.doc["run_id"], "created_at": res.doc["created_at"], "params": p, "quick": ctx.config.quick,
           "models": {m: Path(d).name for m, d in out["models"].items()}}
    (ctx.out_dir / "README.md").write_text(readme(run, c, res.evaluate()))


def _metrics(res, out: dict) -> None:
    steps = (out.get("switching") or {}).get("steps") or []
    for kind in ("switch_first", "switch_back"):
        for side in ("ours", "single", "mlx_lm"):
            xs = [s[side]["ttft_s"] for s in steps if s["kind"] == kind and s.get(side) and s[side]["error"] is None]
            if xs:
                res.metric(f"ttft_{kind}_{side}", xs, "s", description=f"client TTFT, {kind}, {side}")
    rows = (out.get("concurrent") or {}).get("rows") or []
    for config in ("fleet", "singles"):
        for mid in out["models"]:
            xs = [r["ttft_s"] for r in rows if r["config"] == config and r["model"] == mid and r["round"] >= 2
                  and r["error"] is None]
            if xs:
                res.metric(f"ttft_concurrent_{config}_{mid}", xs, "s",
                           description=f"client TTFT of warm appends, both models' agents at once, {config}, {mid}")


def _plot(ctx, out: dict) -> None:
    """RSS and the fleet's resident bytes over time, each phase against its limit."""
    from harness import plots  # first: it sets the Agg backend
    import matplotlib.pyplot as plt

    phases = [k for k in PHASES if out.get(k) and out[k].get("rss")]
    if not phases:
        return
    fig, axes = plt.subplots(1, len(phases), figsize=(6 * len(phases), 3.6), squeeze=False)
    for ax, name in zip(axes[0], phases):
        ph = out[name]
        ax.plot([r["t"] for r in ph["rss"]], [r["rss_bytes"] / MB for r in ph["rss"]], lw=1, label="RSS")
        ax.plot([r["t"] for r in ph["rss"]], [r.get("file_bytes", 0) / MB for r in ph["rss"]], lw=0.8,
                label="of it mapped files")
        fl = [f for f in ph.get("fleet") or [] if f.get("resident_bytes") is not None]
        ax.step([f["t"] for f in fl], [f["resident_bytes"] / MB for f in fl], where="post", lw=1,
                label="fleet resident")
        ax.axhline(ph["models_mb"], ls="--", c="k", lw=0.8, label="--models-mb")
        ax.set(title=f"EXP-019 {name}", xlabel="s", ylabel="MB")
        ax.legend(fontsize=7)
    ctx.plots.append(plots.save(fig, ctx.plot_path("memory"), dpi=110))


KIND = register(TrialKind(
    name="multi_model",
    run=run,
    params={
        "main_model": Param(str, "gemma3-270m", "the model served as main (a registered name)"),
        "small_model": Param(str, "smollm2-135m", "the model served as small"),
        "main_dir": Param(str, "", "a model directory for main instead of the prepared one"),
        "small_dir": Param(str, "", "a model directory for small instead of the prepared one"),
        "phases": Param(list, list(PHASES), "the phases to run", PHASES),
        "peers": Param(list, ["mlx_lm.server"], "peers of the switching phase (mlx_lm.server or none: only it "
                                                "switches models on request)", ("mlx_lm.server",)),
        "system_tokens": Param(int, 1000, "each model's agents' system prompt"),
        "max_tokens": Param(int, 16, "max_tokens of every turn (greedy)"),
        "pool_mb": Param(int, 128, "--pool-mb of every model, fleet and single servers alike"),
        "switch_models_mb": Param(int, 0, "--models-mb while switching (0: the largest model + switch_fit of "
                                          "the other)"),
        "switch_fit": Param(float, 0.5, "how much of the smaller model the switching budget holds beside the "
                                         "larger (below 1: it leaves the second model out)", min=0, max=1, strict=True),
        "switch_rounds": Param(int, 4, "switching: turns per agent (one agent per model, turns alternate)"),
        "conc_models_mb": Param(int, 0, "--models-mb with both loaded (0: both, conc_slack to spare)"),
        "conc_slack": Param(float, 0.1, "room above both models in the both-loaded budget"),
        "conc_agents": Param(int, 3, "both loaded: agents per model, all sending at once"),
        "conc_rounds": Param(int, 4, "both loaded: rounds (each configuration once per round)"),
        "reply_slack": Param(int, 1, "the previous reply's tokens a resumed turn may miss (its last, unfed)"),
        "sample_s": Param(float, 0.1, "the RSS and fleet sampling period"),
        "idle_samples": Param(int, 20, "RSS samples before the first request (the overhead)"),
        "settle_max_s": Param(float, 120.0, "the longest wait for saves between configurations"),
        "request_timeout_s": Param(float, 600.0, "the client's bound on every request"),
        "ready_timeout_s": Param(float, 300.0, "the bound on a server's start"),
        "server_args": Param(list, [], "more arguments for every semantic server"),
        "work_dir": Param(str, "", "the servers' state (default: the system's temporary directory)"),
        "keep_work_dir": Param(bool, False, "leave the servers' state and logs behind"),
    },
    needs_model=False,
))
