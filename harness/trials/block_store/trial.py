"""EXP-017: write each block once. Two store layouts of ``semantic serve`` measured in one run, interleaved.

One server per layout (``--cache-layout blocks``: each full 256-token block written once under its chain
key, a small manifest per agent; ``--cache-layout file``: one file per agent, rewritten every turn), on
SmolLM2, each with its own cache directory, driven through the ``openai`` SDK from this process and
measured at the client (``harness.trials.block_store``). Four phases, each on a fresh pair of servers:

1. **Write amplification** (``--sync-saves``). One agent over a ~3.3K-token history, then ``wa_turns``
   turns of ~100 new tokens and a 16-token reply: per turn, the server's ``write_bytes``
   (``/proc/<pid>/io``) over the KV bytes the turn added ((new prompt tokens + reply) x KV bytes per token,
   the latter from ``/v1/cache/stats``).
2. **A shared system prompt on disk** (``--sync-saves``). ``shared_agents`` agents on one
   ``shared_system_tokens`` system prompt, one turn each: the cache directory's bytes against one copy
   of the prompt plus every agent's own tokens.
3. **Restart TTFT** (``--sync-saves``). A short and a long agent saved; per rep each server is SIGTERMed,
   its files dropped from the page cache, started again, and each agent's next turn (resumed from disk)
   timed: the median over reps of the first layout's TTFT over the second's in the same rep.
4. **A cached turn beside a save** (no ``--sync-saves``). A's fully cached ``fg_tokens`` turn right after
   B's turn (B's save running) against the same turn on an idle server.

Every turn is greedy and the same on both layouts, so their replies must be equal. With ``layout_flag``
empty no flag is passed (both "layouts" are the server's default): a check of the harness itself.
"""

from __future__ import annotations

import shutil
import signal
import sys
import tempfile
import traceback
from pathlib import Path

from harness.common.report import fmt, verdict_table
from harness.trials.base import TrialKind, Param, register
from harness.trials.block_store import disk_phases, time_phases
from harness.trials.block_store.checks import all_checks, replies_differing
from harness.trials.block_store.servers import start_servers, stop_all

# each phase, its function, and whether its servers run with --sync-saves
PHASES = {
    "write_amp": (disk_phases.write_amplification, True),
    "shared_prompt": (disk_phases.shared_prompt, True),
    "restart": (time_phases.restart_ttft, True),
    "beside_save": (time_phases.beside_save, False),
}


def validate(p: dict) -> None:
    if len(p["layouts"]) != 2 or len(set(p["layouts"])) != 2:
        raise ValueError(f"layouts must name two layouts, the candidate first: {p['layouts']}")


def run(ctx) -> None:
    from mlx_lm.utils import load_tokenizer

    from harness import models

    p = ctx.params
    model_dir = Path(p["model_dir"] or models.prepare(ctx.model_name, variant=models.default_variant(
        ctx.config.model_variant)))
    tok = load_tokenizer(model_dir)
    work = Path(tempfile.mkdtemp(prefix="exp017-", dir=p["work_dir"] or None))
    out: dict = {"layouts": p["layouts"], "layout_flag": p["layout_flag"], "work_dir": str(work)}
    ctx.progress.total = len(p["phases"])
    out["failed"] = []
    try:
        for name in (n for n in PHASES if n in p["phases"]):
            try:
                out[name] = _phase(name, p, tok, model_dir, ctx.model_name, work)
            except Exception as exc:  # recorded (a P0 fails), and the other phases still run
                out["failed"].append({"phase": name, "error": str(exc)[-8000:]})
                print(f"EXP-017 phase {name} failed: {exc}", file=sys.stderr)
            ctx.progress.update(1)
    finally:
        if not p["keep_work_dir"]:
            shutil.rmtree(work, ignore_errors=True)
    _record(ctx, out)


def _phase(name: str, p: dict, tok, model_dir: Path, model_id: str, work: Path) -> dict:
    """One phase on a fresh pair of servers (one per layout), stopped at its end whatever happens."""
    fn, sync = PHASES[name]
    base = [*(["--sync-saves"] if sync else []), "--pool-mb", str(p["pool_mb"]), "--disk-mb", str(p["disk_mb"]),
            *p["server_args"]]
    servers = []
    try:
        servers = start_servers(p["layouts"], p["layout_flag"], base, model_dir, model_id, work / name,
                                p["request_timeout_s"])
        result = fn(servers, p, tok)
        result["server_args"] = {s.layout: s.server.args for s in servers}
        result["stats"] = {s.layout: _trim(s.stats()) for s in servers}
        result["starts_s"] = {s.layout: s.server.starts for s in servers}
        return result
    except Exception as exc:
        tails = "\n".join(f"--- {s.layout} server log ---\n{s.server.log_tail(2000)}" for s in servers)
        where = "".join(traceback.format_exception(exc)[-6:])
        raise RuntimeError(f"EXP-017 phase {name} failed: {exc!r}\n{where}\n{tails}") from exc
    finally:
        stop_all(servers, signal.SIGTERM)


def _trim(stats: dict) -> dict:
    """A server's stats without its per-agent and recent-request lists."""
    return {k: v for k, v in stats.items() if k not in ("agents", "recent")}


def _record(ctx, out: dict) -> None:
    res, layouts = ctx.results, ctx.params["layouts"]
    checks = all_checks(out, layouts)
    res.checks(checks)
    _metrics(res, out, layouts)
    for k in ("layouts", "layout_flag", "failed", *PHASES):
        res.output(k, out.get(k))
    res.output("replies_differing", replies_differing(out, layouts)[1])
    _readme(ctx, checks)


def _metrics(res, out: dict, layouts: list[str]) -> None:
    for lay in layouts:
        if out.get("write_amp"):
            amps = [r["amplification"] for r in out["write_amp"]["rows"] if r["measured"] and r["layout"] == lay]
            res.metric(f"write_amp_{lay}", amps, "x", description=f"bytes written per turn / KV bytes added, {lay}")
        if out.get("restart"):
            for size in out["restart"]["sizes"]:
                ttft = [r["ttft_s"] for r in out["restart"]["rows"] if r["layout"] == lay and r["size"] == size]
                res.metric(f"restart_ttft_{lay}_{size}", ttft, "s",
                           description=f"client TTFT of a turn resumed from disk after a restart, {lay}, {size}")
        if out.get("beside_save"):
            rows = [r for r in out["beside_save"]["rows"] if r["layout"] == lay]
            for k in ("quiet", "beside"):
                res.metric(f"foreground_{k}_{lay}", [r[k]["total_s"] for r in rows], "s",
                           description=f"a fully cached turn, {k}, {lay}: the client's whole turn")


def _readme(ctx, c: dict) -> None:
    verdicts = ctx.results.evaluate()
    run_id, (cand, base) = ctx.results.doc["run_id"], ctx.params["layouts"]
    flag = ctx.params["layout_flag"]
    table = "\n".join(f"| {label} | {fmt(c.get(key.format(cand)), 'None')} | {fmt(c.get(key.format(base)), 'None')} |"
                      for label, key in _TABLE)
    note = "" if flag else ("\n**The layout flag was not passed: both columns are the server's default layout** "
                            "(a check of the harness, not of the layouts).\n")
    (ctx.out_dir / "README.md").write_text(f"""# EXP-017: write each block once

`make exp-017` (`harness run experiments/exp_017_block_store.toml`) runs `semantic serve` on
{ctx.model_name} once per store layout (`{flag or '(no flag)'} {cand}` against `{flag or '(no flag)'} {base}`),
interleaved in one run; see `harness/trials/block_store/trial.py` for the phases. This file is written by the
run. Latest run: `{run_id}` ({ctx.results.doc['created_at'][:19]} UTC), results `{run_id}.json`.
{note}
| measured | {cand} | {base} |
|---|---|---|
{table}

{cand} / {base} restart TTFT (median over reps of each rep's pair): {fmt(c.get(f'restart_{cand}_over_{base}_short'), 'None')} short
({c.get('restart_short_tokens')} tokens), {fmt(c.get(f'restart_{cand}_over_{base}_long'), 'None')} long
({c.get('restart_long_tokens')} tokens). The agents' shared prompt: {c.get('shared_tokens')} tokens, of them
{c.get('shared_full_block_tokens')} in full blocks (the rest sits in each agent's partial block). Replies
differing between the layouts: {c.get('replies_differing')}.

{verdict_table(verdicts, 'None')}
""")


_TABLE = (("bytes written per turn / KV added, max", "write_amp_{}_max"),
          ("bytes written per turn / KV added, mean", "write_amp_{}_mean"),
          ("MB written per turn", "write_mb_per_turn_{}"),
          ("disk bytes / ideal, shared system prompt", "disk_over_ideal_{}"),
          ("disk bytes / what sharing full blocks only can reach", "disk_over_full_block_ideal_{}"),
          ("disk MB, shared system prompt", "disk_mb_{}"),
          ("restart TTFT, short agent (s, median)", "restart_ttft_{}_short_s"),
          ("restart TTFT, long agent (s, median)", "restart_ttft_{}_long_s"),
          ("cached turn beside a save / quiet (whole turn, median of reps)", "beside_over_quiet_{}"),
          ("cached turn beside a save / quiet (TTFT, median of reps)", "beside_over_quiet_{}_ttft"),
          ("reps whose cached turn overlapped a save's writes", "beside_overlapped_{}"))


KIND = register(TrialKind(
    name="block_store",
    run=run,
    validate=validate,
    params={
        "layouts": Param(list, ["blocks", "file"], "the two store layouts, the candidate first"),
        "layout_flag": Param(str, "--cache-layout", "the server flag that picks a layout; empty: pass none"),
        "phases": Param(list, list(PHASES), "the phases to run", tuple(PHASES)),
        "max_tokens": Param(int, 16, "max_tokens of the measured turns of phases 1-3 (greedy)"),
        "wa_system_tokens": Param(int, 2000, "write amplification: the agent's system prompt"),
        "wa_history_tokens": Param(int, 1300, "write amplification: its earlier exchange"),
        "wa_turns": Param(int, 6, "write amplification: measured turns"),
        "wa_turn_tokens": Param(int, 100, "write amplification: tokens of each turn's new question"),
        "shared_agents": Param(int, 12, "shared prompt: agents on one system prompt"),
        "shared_system_tokens": Param(int, 2200, "shared prompt: its tokens"),
        "shared_question_tokens": Param(int, 30, "shared prompt: each agent's question"),
        "restart_short_tokens": Param(int, 2048, "restart: the short agent's history"),
        "restart_long_tokens": Param(int, 7700, "restart: the long agent's history (SmolLM2 holds 8192)"),
        "restart_reps": Param(int, 5, "restart: restarts of each layout's server"),
        "evict_page_cache": Param(bool, True, "restart: drop the cache files from the page cache first"),
        "warm_after_restart": Param(bool, True, "restart: one tiny anonymous turn before the timed ones"),
        "fg_tokens": Param(int, 7700, "beside a save: the shared system prompt of agents A and B"),
        "fg_max_tokens": Param(int, 8, "beside a save: max_tokens of A's and B's turns"),
        "fg_reps": Param(int, 8, "beside a save: quiet / beside pairs per layout"),
        "settle_s": Param(float, 0.3, "a server is idle when its write_bytes stayed put this long"),
        "settle_max_s": Param(float, 120.0, "the longest wait for a server to be idle"),
        "request_timeout_s": Param(float, 600.0, "the client's bound on every request"),
        "pool_mb": Param(int, 2048, "--pool-mb of each server"),
        "disk_mb": Param(int, 16384, "--disk-mb of each server"),
        "server_args": Param(list, [], "more arguments for every server"),
        "work_dir": Param(str, "", "where the cache directories go (default: the system's temporary directory)"),
        "keep_work_dir": Param(bool, False, "leave the cache directories and server logs behind"),
        "model_dir": Param(str, "", "a model directory to serve instead of the prepared one"),
    },
    needs_model=False,
))
