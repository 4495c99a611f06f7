"""EXP-015: nothing lost under chaos. One ``semantic serve`` under injected faults, agents talking throughout.

The server runs with ``--sync-saves`` (and ``--cache-layout``: block files and a manifest per agent
by default) on a size-limited tmpfs this run mounts (and unmounts),
a RAM budget of about a quarter of the agents' working set (KV bytes per token × their history
tokens), a small ``--max-queued``, and a disk budget ample for the live agents. ``agents`` agents
talk through the official SDKs (:mod:`harness.trials.chaos.agents`) while the injector
(:mod:`harness.trials.chaos.injector`) kills it (SIGKILL, SIGTERM) and starts it again, fills its disk,
makes it read-only, hangs up streams, floods it past its queue, and damages files while it is down:
a block file several agents share, an agent's manifest, a block file only one agent uses
(:mod:`harness.trials.chaos.damage`). Then a last, crash-free life of ``calm_turns`` turns measures RSS,
and a SIGTERM ends the run.

What must hold (:mod:`harness.trials.chaos.ledger`; :mod:`harness.trials.chaos.checks` judges it): no 5xx, no
hang (every request answered or refused within the client timeout), no durable turn lost (a reply
that said ``cache_save: saved`` is found cached after every restart, unless a file of its cache was
damaged: then that file is quarantined, and the agent resumes from the blocks before it), sampled
replies equal to the same request sent anonymously under a fresh salt, RSS at the end within 1.2x
the last life's after its first ``rss_baseline_turns`` turns, no writer's temporary file left (in
the cache folder or its block folders) after a start or the shutdown, and while the disk is full:
200s, resident bytes within the budget, and every cache saved before it still loads afterwards.

The run writes its results document, a timeline plot, and ``README.md`` beside them with the verdicts.
"""

from __future__ import annotations

import json
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from harness import storefiles
from harness.common.report import verdict_table
from harness.servers.ours import OurServer
from harness.trials.base import TrialKind, Param, register
from harness.trials.chaos import fs
from harness.trials.chaos.agents import AgentParams, Fleet
from harness.trials.chaos.checks import answered_turns, checks, rss_checks
from harness.trials.chaos.injector import FaultPlan, Injector
from harness.trials.chaos.ledger import FAILURES, Ledger
from harness.trials.chaos.timeline import timeline_plot

MB = 1 << 20


def sizes(p: dict, model_dir: Path, variant: str) -> dict:
    """The server's budgets from the model's KV bytes per token and the agents' history tokens.

    An agent's history at the end of its longest session: the system prompt and template, plus per
    turn a question (~30 tokens), a reply (``max_tokens``; a tool call's ``tool_max_tokens`` on some)
    and the template's glue (~10)."""
    from semantic.cache.spec import ModelCacheSpec

    cfg = json.loads((model_dir / "config.json").read_text())
    spec = ModelCacheSpec.from_config(cfg, dtype="float32" if variant == "f32" else None)
    per_token = int(spec.token_bytes())
    reply = (1 - p["tools_prob"]) * p["max_tokens"] + p["tools_prob"] * p["tool_max_tokens"]
    history = int(p["system_tokens"] + 20 + p["turns_per_session"][1] * (30 + reply + 10))
    working_set = p["agents"] * history * per_token
    ram_mb = max(1, int(p["ram_share"] * working_set / MB))
    disk_mb = p["disk_mb"] or max(64, int(2 * working_set / MB))   # the live agents twice over: ample
    return {"kv_bytes_per_token": per_token, "history_tokens": history, "working_set_bytes": working_set,
            "ram_mb": ram_mb, "disk_mb": disk_mb, "tmpfs_mb": int(disk_mb * 1.25) + 16}


def run(ctx) -> None:
    """The rig built, then its phases: chaos, the calm last life, the shutdown; the teardown whatever happens."""
    p = ctx.params
    rig = _rig(ctx)
    out: dict = {"sizes": rig.size, "server_args": rig.args, "skipped": rig.skipped, "work": str(rig.work)}
    ctx.progress.total = 3
    try:
        out["plan"] = _chaos(rig)
        ctx.progress.update(1)
        out.update(_calm_life(rig, p))
        ctx.progress.update(1)
        out.update(_shutdown(rig, out["last_life"]))
    finally:
        _teardown(rig, out)
    out["phases"] = rig.injector.phases
    _record(ctx, rig.ledger, out, p)
    ctx.progress.update(1)


@dataclass(slots=True)
class _Rig:
    """One run's pieces: its scratch folder, the cache folder (on the tmpfs unless ``mount`` is None), the
    server, the agents, the injector, and the RSS sampler's stop."""

    size: dict
    args: list[str]
    work: Path
    mount: Path | None
    cache_dir: Path
    skipped: dict
    server: OurServer
    ledger: Ledger
    fleet: Fleet
    injector: Injector
    sampling: threading.Event = field(default_factory=threading.Event)


def _rig(ctx) -> _Rig:
    """The model and its agents' system prompt, the budgets, the cache filesystem, and the pieces on them."""
    from mlx_lm.utils import load_tokenizer

    from harness import models
    from harness.prompts import system_prompt

    p = ctx.params
    variant = models.default_variant(ctx.config.model_variant)
    model_dir = Path(p["model_dir"] or models.prepare(ctx.model_name, variant=variant))
    system = system_prompt(load_tokenizer(model_dir), p["system_tokens"])["content"]
    size = sizes(p, model_dir, variant)
    work, mount, cache_dir, skipped = _cache_fs(p, size["tmpfs_mb"])
    args = ["--sync-saves", "--cache-layout", p["cache_layout"],
            "--ram-mb", str(size["ram_mb"]), "--disk-mb", str(size["disk_mb"]),
            "--max-queued", str(p["max_queued"]), "--max-batch", str(p["max_batch"])]
    server = OurServer(model_dir, ctx.model_name, cache_dir, work / "server.log", args)
    ledger = Ledger()
    agent_p = AgentParams(max_tokens=p["max_tokens"], tool_max_tokens=p["tool_max_tokens"],
                          turns_per_session=tuple(p["turns_per_session"]), tools_prob=p["tools_prob"],
                          stream_prob=p["stream_prob"], check_prob=p["check_prob"], timeout_s=p["request_timeout_s"])
    fleet = Fleet(server, ledger, system, p["agents"], agent_p, p["seed"])
    plan = FaultPlan(**{k: p[k] for k in ("sigkill", "sigterm", "corrupt", "disk_full", "read_only", "hangup",
                                          "flood", "hold_s", "flood_requests")}, duration_s=p["chaos_s"])
    injector = Injector(server, fleet, ledger, plan, mount, cache_dir, p["seed"], p["max_queued"])
    return _Rig(size, args, work, mount, cache_dir, skipped, server, ledger, fleet, injector)


def _cache_fs(p: dict, tmpfs_mb: int) -> tuple[Path, Path | None, Path, dict]:
    """A scratch folder, and the cache folder on a tmpfs mounted in it: (work, mount, cache_dir, skipped).
    Without the tmpfs (no root, or the faults off) the mount is None and the filesystem faults are skipped."""
    work = Path(tempfile.mkdtemp(prefix="exp015-"))
    mount = work / "cachefs"
    why = fs.mount_tmpfs(mount, tmpfs_mb) if p["filesystem_faults"] else "params.filesystem_faults is off"
    skipped = {"disk_full": why, "read_only": why} if why else {}
    cache_dir = (work / "cache") if why else (mount / "cache")
    cache_dir.mkdir(parents=True, exist_ok=True)
    return work, None if why else mount, cache_dir, skipped


def _chaos(rig: _Rig) -> list[str]:
    """The first life starts, RSS is sampled from now on, the agents talk, and the injector runs its plan."""
    rig.ledger.event("start", life=1, start_s=round(rig.server.start(), 3), temp_files=fs.temp_files(rig.cache_dir))
    threading.Thread(target=_sample_rss, args=(rig.server, rig.fleet, rig.ledger, rig.sampling), daemon=True).start()
    rig.fleet.start()
    return rig.injector.run()


def _calm_life(rig: _Rig, p: dict) -> dict:
    """The last life: crash-free, long enough for its RSS after the first turns to compare with its end;
    then the agents stop."""
    rig.injector.crash(signal.SIGTERM, cause="the last life begins")
    last = rig.server.life
    deadline = time.monotonic() + p["calm_timeout_s"]
    while rig.fleet.turns_in(last) < p["calm_turns"] and time.monotonic() < deadline:
        time.sleep(0.5)
    rss_end = rig.server.rss_bytes()
    rig.ledger.rss.append((rig.ledger.now(), last, rig.fleet.turns_in(last), rss_end))
    return {"rss_end_bytes": rss_end, "agents_not_stopped": rig.fleet.stop(p["request_timeout_s"] + 10),
            "last_life": last}


def _shutdown(rig: _Rig, last: int) -> dict:
    """A SIGTERM ends the last life: its exit, whether it was clean, the temporaries and quarantine it left."""
    final_stats = rig.server.stats(timeout_s=30)
    ev = rig.ledger.event("shutdown", life=last)
    ev["exit"] = rig.server.stop(signal.SIGTERM)
    ev["clean"] = ev["exit"] in (0, -signal.SIGTERM) and "Application shutdown complete" in rig.server.log_tail(20000)
    ev["temp_files"] = fs.temp_files(rig.cache_dir)
    return {"final_stats": final_stats, "quarantine_dir": fs.quarantined_files(rig.cache_dir),
            "cache_files_at_end": len(fs.cache_files(rig.cache_dir)),
            "manifests_at_end": len(storefiles.manifests(rig.cache_dir)),
            "block_files_at_end": len(storefiles.block_files(rig.cache_dir))}


def _teardown(rig: _Rig, out: dict) -> None:
    """However the run ended: sampler and agents stopped, the server killed (its log's tail kept), the tmpfs
    unmounted, the scratch folder removed."""
    rig.sampling.set()
    rig.fleet.stop(5)
    rig.server.kill_now()
    out["server_log_tail"] = rig.server.log_tail(6000)
    if rig.mount is not None:
        out["unmount_error"] = fs.unmount(rig.mount)
    shutil.rmtree(rig.work, ignore_errors=True)


def _sample_rss(server: OurServer, fleet: Fleet, ledger: Ledger, done: threading.Event) -> None:
    while not done.wait(1.0):
        rss = server.rss_bytes()
        if rss:
            life = server.life
            ledger.rss.append((round(ledger.now(), 3), life, fleet.turns_in(life), rss))


def _record(ctx, ledger: Ledger, out: dict, p: dict) -> None:
    """The checks, the outputs, the TTFT metric, the timeline plot and the README."""
    res = ctx.results
    found, not_quarantined = checks(ledger, out, p["rss_baseline_turns"])
    res.checks(found)
    _outputs(res, ledger, out, not_quarantined)
    ttft = [r["ttft_s"] for r in answered_turns(ledger.requests) if r.get("stream")]
    if ttft:
        res.metric("ttft_s", ttft, "s", description="client TTFT of streamed agent turns, faults and all")
    ctx.plots.append(timeline_plot(ledger.requests, ledger.events, ledger.rss, ctx.plot_path("timeline"),
                                   f"EXP-015 chaos soak, {ctx.model_name}: {found['turns']} turns, "
                                   f"{found['crashes']} crashes"))
    _readme(ctx, found)


def _outputs(res, ledger: Ledger, out: dict, not_quarantined: list[str]) -> None:
    """What the run saw, kept whole in the results: the plan, every event, request and resumption, RSS."""
    res.output("sizes", out["sizes"])
    res.output("server_args", out["server_args"])
    res.output("plan", out.get("plan"))
    res.output("skipped_faults", out["skipped"])
    res.output("events", ledger.events)
    res.output("phases", out["phases"])
    res.output("resumptions", ledger.resumptions)
    res.output("correctness_checks", ledger.checks)
    res.output("failures", [r for r in ledger.requests if r["outcome"] in FAILURES][:200])
    res.output("requests", ledger.requests)
    res.output("rss", ledger.rss)
    res.output("final_stats", out.get("final_stats"))
    res.output("corruptions_not_quarantined", not_quarantined)
    res.output("server_log_tail", out.get("server_log_tail"))
    res.output("unmount_error", out.get("unmount_error"))


def _readme(ctx, c: dict) -> None:
    """``README.md`` beside the results: what the run did and each goal's verdict."""
    verdicts = ctx.results.evaluate()
    run_id = ctx.results.doc["run_id"]
    text = f"""# EXP-015: nothing lost under chaos

`make exp-015` (`harness run experiments/exp_015_chaos.toml`) runs one `semantic serve` on
{ctx.model_name} with `--sync-saves` on a size-limited tmpfs, {ctx.params['agents']} agents talking
through the `openai` and `anthropic` SDKs, and a seeded fault injector: SIGKILL and SIGTERM then a
restart, a file truncated or overwritten while the server is down (in turn a block file several agents
share, an agent's manifest, a block file one agent uses; `--cache-layout {ctx.params['cache_layout']}`),
the disk filled until ENOSPC,
the cache filesystem made read-only, streams cut by their clients, and floods past the queue. A last,
crash-free life measures RSS. See `harness/trials/chaos/trial.py` for what each goal means.

This file is written by the run. Latest run: `{run_id}` ({ctx.results.doc['created_at'][:19]} UTC),
results `{run_id}.json`, timeline `{run_id}-timeline.png`.

| | |
|---|---|
| requests / agent turns answered | {c['requests']} / {c['turns']} |
| crashes (SIGKILL / SIGTERM) | {c['crashes']} ({c['faults_sigkill']} / {c['faults_sigterm']}) |
| files corrupted (manifests / block files, shared) / set aside / unread | {c['corrupted_files']} ({c['corrupted_manifests']} / {c['corrupted_block_files']}, {c['corrupted_shared_block_files']}) / {c['corruptions_quarantined']} / {c['corruptions_unread']} |
| files in quarantine/ | {c['quarantined_files']} |
| disk full / read-only / hang-ups / floods | {c['faults_disk_full_start']} / {c['faults_read_only_start']} / {c['faults_hangup']} / {c['faults_flood']} |
| skipped faults | {c['skipped_faults'] or 'none'} |
| server down / interrupted / 429 / 503 while shutting down | {c['server_down']} / {c['interrupted']} / {c['refused_429']} / {c['refused_shutting_down']} |
| 5xx / 4xx / hangs / disconnects / stream errors | {c['http_5xx']} / {c['http_4xx']} / {c['hang']} / {c['disconnect']} / {c['stream_error']} |
| resumptions checked / lost durable turns / excused (damaged; of them hits on a cache written again) | {c['resumptions_checked']} / {c['lost_durable_turns']} / {c['resumptions_excused_corrupt']} ({c['resumptions_excused_rebuilt']}) |
| replies re-checked / wrong | {c['correctness_checked']} / {c['wrong_replies']} |
| cache_save states of named replies | {c['cache_save_states']} |
| RSS after {c['rss_baseline_turns']} turns of the last life / at its end / max | {_mb(c['rss_baseline_bytes'])} / {_mb(c['rss_end_bytes'])} / {_mb(c['rss_max_bytes'])} |
| temporary files left | {c['temp_files_left']} |

![timeline]({run_id}-timeline.png)

{verdict_table(verdicts, 'None')}
"""
    (ctx.out_dir / "README.md").write_text(text)


def _mb(v) -> str:
    return f"{v / MB:.0f} MiB" if v else "n/a"


def _validate(p: dict) -> None:
    if p["corrupt"] > p["sigkill"]:
        raise ValueError("corrupt counts SIGKILLs that also damage a file: at most sigkill")


KIND = register(TrialKind(
    name="chaos",
    run=run,
    params={
        "agents": Param(int, 16, "agents talking at once, each on its own thread", min=1),
        "system_tokens": Param(int, 300, "tokens of the system prompt every agent shares"),
        "turns_per_session": Param(list, [3, 5], "turns under one agent id before it starts a new one, [low, high]",
                                   pair=True, min=1),
        "max_tokens": Param(int, 12, "max_tokens of a turn without tools (greedy)"),
        "tool_max_tokens": Param(int, 40, "max_tokens of a turn that offers the tool (a call in JSON)"),
        "tools_prob": Param(float, 0.3, "share of turns that offer a function tool"),
        "stream_prob": Param(float, 0.5, "share of turns streamed"),
        "check_prob": Param(float, 0.05, "share of turns re-sent anonymously under a fresh salt and compared"),
        "request_timeout_s": Param(float, 120.0, "the client's bound on every request: past it is a hang"),
        "chaos_s": Param(float, 480.0, "seconds the faults are spread over", min=0, strict=True),
        "sigkill": Param(int, 14, "SIGKILLs and restarts (besides the one after each disk-full phase)"),
        "sigterm": Param(int, 6, "SIGTERMs and restarts (besides the one before the last life)"),
        "corrupt": Param(int, 5, "of the SIGKILLs, those that damage a file while the server is down (a shared "
                               "block file, a manifest, one agent's block file, in turn)"),
        "cache_layout": Param(str, "blocks", "--cache-layout: blocks (block files and manifests) or file",
                              choices=("blocks", "file")),
        "disk_full": Param(int, 1, "disk-full phases (each then a SIGKILL and a restart)"),
        "read_only": Param(int, 1, "read-only phases"),
        "hangup": Param(int, 4, "rounds of streams cut by their clients"),
        "flood": Param(int, 3, "floods past the queue"),
        "hold_s": Param(float, 20.0, "seconds a disk-full or read-only phase holds"),
        "flood_requests": Param(int, 48, "requests released at once in a flood"),
        "calm_turns": Param(int, 300, "agent turns of the last, crash-free life", min=1),
        "calm_timeout_s": Param(float, 400.0, "the most seconds the last life waits for its turns"),
        "rss_baseline_turns": Param(int, 100, "turns of the last life after which its RSS is the baseline"),
        "ram_share": Param(float, 0.25, "--ram-mb as a share of the agents' working set"),
        "disk_mb": Param(int, 0, "--disk-mb (0: twice the working set)"),
        "max_queued": Param(int, 12, "--max-queued: small, so a flood gets 429s"),
        "max_batch": Param(int, 8, "--max-batch"),
        "filesystem_faults": Param(bool, True, "mount a tmpfs for the disk-full and read-only faults (needs root)"),
        "seed": Param(int, 0, "seed of the agents' turns and of the fault plan"),
        "model_dir": Param(str, "", "a model directory to serve instead of the prepared one"),
    },
    plots=frozenset({"timeline"}),
    needs_model=False,
    validate=_validate,
    trial_code=(_rig, _cache_fs, _chaos, _calm_life, _shutdown, _teardown, Fleet, Injector, FaultPlan, Ledger,
                rss_checks, sizes),
))
