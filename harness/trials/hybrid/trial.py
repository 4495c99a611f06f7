"""EXP-018: hybrid recurrent models (and a window shorter than a block): reuse on every turn type, against
the peers.

Per geometry (``harness.trials.hybrid.model``: LFM2-350M's, gpt-oss's pattern with window 128; random float32
weights, SmolLM2's tokenizer), ours (``semantic serve``) and ``mlx_lm.server`` (and vllm-mlx where its venv
is built under ``.peers/``) load the same directory and take turns step by step (``harness.trials.hybrid.turns``):
warm append / regenerate / edit, new agents on the shared system prompt, 12 agents round robin, and a
SIGKILL + restart of every server (ours resumes from disk; the same prompt under a fresh cache salt is the
cold prefill beside it). Every turn records client TTFT, the cached tokens the server reported and the
fewest it must have found; every turn of ours, its ``/v1/cache/stats`` RAM and pool bytes.

Then, without weights (``harness.trials.hybrid.sizes``): one snapshot's bytes at Qwen3.5-35B-A3B's and
Qwen3-Coder-Next's geometries beside a 256-token block of KV and the KV of 4K / 32K tokens, and the time
to save and restore such a snapshot through the block store (synthetic arrays of the real shapes).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import traceback
from pathlib import Path

from harness.trials.base import TrialKind, Param, register

PHASES = ("warm", "shared", "agents", "restart")


def validate(p: dict) -> None:
    from harness.trials.hybrid.model import GEOMETRIES
    from harness.trials.hybrid.sizes import BIG

    bad = [g for g in p["geometries"] if g not in GEOMETRIES] + [g for g in p["big_geometries"] if g not in BIG]
    if bad:
        raise ValueError(f"unknown geometries {bad}; known: {list(GEOMETRIES)} and {list(BIG)}")


def run(ctx) -> None:
    from harness.servers.targets import ROOT

    p = ctx.params
    # every server imports semantic from this checkout, not from wherever the venv's editable install points
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT.resolve()), *filter(None, [os.environ.get("PYTHONPATH")])])
    work = Path(tempfile.mkdtemp(prefix="exp018-", dir=p["work_dir"] or None))
    out: dict = {"geometries": {}, "failed": [], "work_dir": str(work)}
    ctx.progress.total = len(p["geometries"]) + 1
    try:
        for g in p["geometries"]:
            try:
                out["geometries"][g] = _serve(g, p, work / g)
            except Exception as exc:  # recorded (a P0 fails); the other parts still run
                out["failed"].append({"part": g, "error": "".join(traceback.format_exception(exc))[-6000:]})
                print(f"EXP-018 {g} failed: {exc}", file=sys.stderr)
            ctx.progress.update(1)
        try:
            out["sizes"] = _sizes(p, work)
        except Exception as exc:
            out["failed"].append({"part": "sizes", "error": "".join(traceback.format_exception(exc))[-6000:]})
        ctx.progress.update(1)
    finally:
        if not p["keep_work_dir"]:
            shutil.rmtree(work, ignore_errors=True)
    _record(ctx, out)


# ------------------------------------------------------------------ servers

def _peers(p: dict) -> tuple[list, dict, dict]:
    """(targets to run, python per peer venv, name -> why not run). Peer venvs are used where built
    (``.peers/<venv>`` here or under ``peers_root``), never installed by this kind."""
    from harness.servers import venvs
    from harness.servers.targets import OURS, TARGETS

    run_, pythons, skipped = [TARGETS[OURS]], {}, {}
    for name in p["peers"]:
        t = TARGETS[name]
        if t.venv is None:
            run_.append(t)
            continue
        roots = [Path(r) for r in (p["peers_root"], str(venvs.ROOT)) if r]
        found = [r for r in roots if (venvs.venv_dir(t, r) / "bin" / "python").exists()]
        if not found:
            skipped[name] = (f"its venv is not built ({', '.join(str(venvs.venv_dir(t, r)) for r in roots)} absent) "
                             "and this run installs nothing (make exp-009 builds it from the package index)")
            continue
        pythons[name] = venvs.venv_dir(t, found[0]) / "bin" / "python"
        run_.append(t)
    return run_, pythons, skipped


def _serve(geometry: str, p: dict, work: Path) -> dict:
    from mlx_lm.utils import load_tokenizer

    from harness import models
    from harness.prompts import system_prompt
    from harness.servers.loadgen import chat_counter
    from harness.servers.phases import Bench
    from harness.trials.hybrid import model as hm
    from harness.trials.hybrid.turns import Workload

    tok_dir = Path(p["tokenizer_dir"] or models.prepare("smollm2-135m", variant=models.default_variant("auto")))
    model_dir = hm.write_model(geometry, Path(p["model_root"]) / f"hybrid-{geometry}-f32" if p["model_root"]
                               else hm.default_dir(geometry), tok_dir)
    tok = load_tokenizer(model_dir)
    targets, pythons, skipped = _peers(p)
    system = system_prompt(tok, p["system_tokens"])
    bench = Bench(model_dir, geometry, work, chat_counter(tok), lambda t: len(tok.encode(t, add_special_tokens=False)),
                  system, p["max_tokens"], pythons)
    w = Workload(bench, tok, p["max_tokens"])
    out = {"model_dir": str(model_dir), "config": hm.GEOMETRIES[geometry], "layer_counts": hm.layer_counts(hm.GEOMETRIES[geometry]),
           "servers": [t.name for t in targets], "skipped": skipped, "system_tokens": w.system_end}
    try:
        ours = {"ram_mb": p["ram_mb"] or None, "pool_mb": p["pool_mb"] or None}
        bench.start_all(targets, {"semantic": {k: v for k, v in ours.items() if v}}, "run")
        if "warm" in p["phases"]:
            w.warm(p["rounds"])
        if "shared" in p["phases"]:
            w.shared(range(100, 100 + p["shared_agents"]))
        if "agents" in p["phases"]:
            w.agents(range(200, 200 + p["agents"]), p["agent_rounds"])
        if "restart" in p["phases"]:
            out["restart"] = w.restart(p["restart_reps"])
    except Exception as exc:
        tails = "\n".join(f"--- {s.name} ---\n{s.running.log_tail(2500)}" for s in bench.servers)
        raise RuntimeError(f"{exc!r}\n{tails}") from exc
    finally:
        out["rows"], out["stats"], out["events"] = w.rows, w.stats, bench.events
        bench.stop_all()
    return out


# ------------------------------------------------------------------ sizes

def _sizes(p: dict, work: Path) -> dict:
    from harness.trials.hybrid.sizes import BIG, size_row, spec_of, time_store

    rows, timing = [], {}
    for name in p["big_geometries"]:
        spec = spec_of(BIG[name])
        rows.append(size_row(name, spec))
        if p["store_reps"]:
            timing[name] = {
                "with_snapshot": time_store(spec, p["store_tokens"], p["store_reps"], work),
                "kv_only": time_store(spec_of(BIG[name], attention_only=True), p["store_tokens"], p["store_reps"], work),
            }
    return {"rows": rows, "store": timing}


# ------------------------------------------------------------------ results

def _record(ctx, out: dict) -> None:
    from harness.trials.hybrid.report import checks, readme

    c = checks(out)
    ctx.results.checks(c)
    for g, d in out["geometries"].items():
        for srv in d["servers"]:
            for phase in ("warm", "shared", "agents", "restart"):
                xs = [r["ttft_s"] for r in d["rows"] if r["server"] == srv and r["phase"] == phase and r["ttft_s"]]
                if xs:
                    ctx.results.metric(f"ttft_{g}_{phase}_{srv}", xs, "s", description=f"client TTFT, {phase}, {srv}")
    for k in ("geometries", "sizes", "failed"):
        ctx.results.output(k, out.get(k))
    (ctx.out_dir / "README.md").write_text(readme(ctx, out, c))


KIND = register(TrialKind(
    name="hybrid_reuse",
    run=run,
    validate=validate,
    params={
        "geometries": Param(list, ["lfm2-350m"], "served geometries (harness.trials.hybrid.model.GEOMETRIES)"),
        "peers": Param(list, ["mlx_lm.server", "vllm-mlx"], "peers beside ours (a peer venv not built is skipped)"),
        "peers_root": Param(str, "", "another checkout whose .peers/ holds built peer venvs"),
        "phases": Param(list, list(PHASES), "the phases to run", PHASES),
        "system_tokens": Param(int, 2000, "the shared system prompt"),
        "max_tokens": Param(int, 16, "max_tokens of every turn (greedy)"),
        "rounds": Param(int, 4, "warm: rounds (append, regenerate, edit each after the first)"),
        "shared_agents": Param(int, 3, "new agents' first turns on the shared prompt"),
        "agents": Param(int, 12, "agents round robin"),
        "agent_rounds": Param(int, 2, "rounds of the agents"),
        "restart_reps": Param(int, 2, "SIGKILL + restarts"),
        "ram_mb": Param(int, 0, "ours' --ram-mb (0: its default)"),
        "pool_mb": Param(int, 0, "ours' --pool-mb (0: its default)"),
        "big_geometries": Param(list, ["qwen3.5-35b-a3b", "qwen3-coder-next"], "snapshot sizes from configs"),
        "store_tokens": Param(int, 256, "the saved agent's tokens (one block and, hybrid, one snapshot)"),
        "store_reps": Param(int, 3, "saves and restores of it (0: sizes only)"),
        "tokenizer_dir": Param(str, "", "the tokenizer's directory (default: the prepared SmolLM2)"),
        "model_root": Param(str, "", "where the model directories go (default: beside the prepared models)"),
        "work_dir": Param(str, "", "servers' state (default: the system's temporary directory)"),
        "keep_work_dir": Param(bool, False, "leave the servers' state and logs behind"),
    },
    needs_model=False,
))
