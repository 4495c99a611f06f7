"""EXP-009: our server side by side with the servers users would pick instead, over one HTTP workload.

Every runnable target (``harness.serving.targets``: ours, ``mlx_lm.server``,
mlx-vlm's APC, vllm-mlx) loads the same model directory with the same BLAS
and greedy decoding, and the phases of ``harness.serving.phases`` send each
step to all of them in rotating order. Targets that cannot run here (oMLX,
LM Studio, llama.cpp) keep their row with the reason. Peers' venvs are
built on demand under ``.peers/`` (git-ignored); the results record every
version, flag and the BLAS each server process mapped.

Ratios are ours over the best peer's (lower is better for TTFT and RSS), from
medians of the same run.
"""

from __future__ import annotations

import signal
import sys
import tempfile
from pathlib import Path

import numpy as np

from harness import plots
from harness.kinds.base import Kind, Param, register
from harness.serving import phases as P
from harness.serving import venvs
from harness.serving.loadgen import chat, chat_counter
from harness.serving.targets import TARGETS, ServingError

OURS = "semantic"
ALL_PHASES = ("warm", "five_turns", "agents", "shared", "restart", "concurrency", "matched")
MLX_LM = "mlx_lm.server"


def _matched(pool_mb: int) -> dict[str, dict]:
    """Every cache budget set to our pool's bytes (entries unbounded where a server counts entries)."""
    return {
        OURS: {"pool_mb": pool_mb},
        "mlx_lm.server": {"prompt_cache_size": 1000, "prompt_cache_bytes": pool_mb << 20},
        "mlx-vlm": {"apc_memory_max_gb": pool_mb / 1024},
        "vllm-mlx": {"cache_memory_mb": pool_mb},
    }


def _median(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return float(np.median(xs)) if xs else None


def five_turn_prompts(tokenizer, repeat: int, system_tokens: int, question_tokens: int) -> tuple[dict, list[dict]]:
    """One five-turn conversation's system prompt and 4 user messages.

    Each repeat's system prompt differs from its first words on, so its first turn is cold on every
    server (only the chat template's opening tokens are shared)."""
    from harness.prompts import text_of_tokens

    head = f"Ship's log {repeat + 1}. You are a careful research agent. Reference material:"
    system = {"role": "system", "content": text_of_tokens(tokenizer, system_tokens, 500 + 211 * repeat, head)}
    questions = [{"role": "user", "content": text_of_tokens(tokenizer, question_tokens, 40 * j + 7 * repeat,
                                                            f"Question {j}:")} for j in range(1, 5)]
    return system, questions


def run(ctx) -> None:
    from mlx_lm.utils import load_tokenizer

    from harness import models
    from harness.prompts import system_prompt

    p, res = ctx.params, ctx.results
    variant = models.default_variant(ctx.config.model_variant)
    model_dir = p["model_dir"] or models.prepare(ctx.model_name, variant=variant)
    phases = p["phases_by_model"].get(ctx.model_name, p["phases"])
    wanted = [TARGETS[n] for n in p["targets"]]
    runnable, skipped, versions, pythons = [], {}, {}, {}
    for t in wanted:
        if not t.runnable_here:
            skipped[t.name] = t.reason
            continue
        try:
            venv = venvs.ensure_venv(t) if t.venv else None
        except ServingError as exc:
            skipped[t.name] = f"install failed: {exc}"[:500]
            continue
        if venv is None:  # this interpreter (.venv)
            venv = venvs.Venv(Path(sys.executable), venvs.installed_versions(sys.executable), None, False)
        else:
            pythons[t.name] = venv.python
        versions[t.name] = venv.pick(t.packages)
        runnable.append(t)
    res.output("targets", {"run": [t.name for t in runnable], "not_run": skipped, "versions": versions,
                           "notes": {t.name: t.notes for t in wanted}})
    if OURS not in [t.name for t in runnable]:
        raise RuntimeError(f"our server cannot run here: {skipped.get(OURS)}")

    tokenizer = load_tokenizer(Path(model_dir))
    system = system_prompt(tokenizer, p["system_tokens"])
    work = Path(tempfile.mkdtemp(prefix="exp009-"))
    bench = P.Bench(Path(model_dir), ctx.model_name, work, chat_counter(tokenizer),
                    lambda text: len(tokenizer.encode(text, add_special_tokens=False)), system,
                    p["answer_tokens"], pythons)
    out: dict = {"phases": phases, "settings": {}}
    steps = len(phases)
    ctx.progress.total = steps
    try:
        defaults = {t.name: {} for t in runnable}
        out["settings"]["defaults"] = {t.name: t.settings() for t in runnable}
        bench.start_all(runnable, defaults, "defaults")
        if "warm" in phases:
            bench.warm(p["warm_rounds"])
            ctx.progress.update(1)
        if "five_turns" in phases:
            names = set(p["five_turns_targets"]) & {t.name for t in runnable}
            out["five_turns"] = []
            for i in range(p["five_turns_repeats"]):
                system5, questions = five_turn_prompts(tokenizer, i, p["five_turns_system_tokens"],
                                                       p["five_turns_question_tokens"])
                out["five_turns"] += bench.five_turns(2000 + i, system5, questions, p["five_turns_answer_tokens"],
                                                      names, fresh=OURS)
            ctx.progress.update(1)
        agents = range(p["agents"])
        if "agents" in phases or "restart" in phases:
            bench.agents("agents", agents, p["agent_rounds"])
            ctx.progress.update(1)
        if "shared" in phases:
            out["rss"] = bench.shared(range(100, 100 + p["shared_users"]))
            ctx.progress.update(1)
        if "restart" in phases:
            who = range(min(p["restart_users"], p["agents"]))
            bench.restart_all(signal.SIGTERM, "defaults", p["kill_after_s"])
            bench.agents("restart-sigterm", who, 1, first_round=p["agent_rounds"] + 1)
            bench.restart_all(signal.SIGKILL, "defaults", p["kill_after_s"])
            bench.agents("restart-sigkill", who, 1, first_round=p["agent_rounds"] + 2)
            ctx.progress.update(1)
        if "concurrency" in phases:
            out["concurrency"] = {}
            for i, level in enumerate(p["concurrency"]):
                out["concurrency"][level] = bench.concurrency(level, p["concurrency_rounds"], 1000 + 100 * i)
            ctx.progress.update(1)
        out["rss_end"] = bench.rss()
        bench.stop_all()
        if "matched" in phases:
            settings = {n: s for n, s in _matched(p["matched_pool_mb"]).items() if n in [t.name for t in runnable]}
            out["settings"]["matched"] = {t.name: t.settings(**settings.get(t.name, {})) for t in runnable}
            bench.start_all(runnable, settings, "matched")
            bench.agents("agents-matched", agents, p["agent_rounds"])
            bench.stop_all()
            ctx.progress.update(1)
    finally:
        bench.stop_all()
    out["events"] = bench.events
    _record(ctx, bench, out, [t.name for t in runnable])


def _record(ctx, bench: P.Bench, out: dict, names: list[str]) -> None:
    res, recs = ctx.results, bench.records
    res.output("requests", [r.row() for r in recs])
    res.output("run", {k: v for k, v in out.items() if k != "events"} | {"events": out["events"]})
    peers = [n for n in names if n != OURS]

    def ttft(phase: str, server: str, kinds=None, min_round: int = 1) -> list[float]:
        return [r.ttft_s for r in recs if r.phase == phase and r.server == server and r.error is None
                and r.round >= min_round and (kinds is None or r.kind in kinds)]

    def ratio(phase: str, against: list[str], kinds=None, min_round: int = 1) -> float | None:
        """Our median TTFT over the best median of ``against`` (None where either side has none)."""
        ours = _median(ttft(phase, OURS, kinds, min_round))
        best = min((m for n in against if (m := _median(ttft(phase, n, kinds, min_round))) is not None), default=None)
        return ours / best if ours and best else None

    metric_specs = []
    for server in names:
        for kind in ("append", "regenerate", "edit"):
            metric_specs.append((f"ttft_warm_{kind}_{server}", ttft("warm", server, {kind}, 2), f"warm rounds >= 2, {kind}"))
        metric_specs += [
            (f"ttft_agents_{server}", ttft("agents", server, None, 2), "16 agents round robin, rounds >= 2, defaults"),
            (f"ttft_agents_matched_{server}", ttft("agents-matched", server, None, 2), "agents, budgets matched in bytes"),
            (f"ttft_shared_first_{server}", ttft("shared", server), "a new agent's first turn on the shared system prompt"),
            (f"ttft_restart_sigterm_{server}", ttft("restart-sigterm", server), "next round after SIGTERM + restart"),
            (f"ttft_restart_sigkill_{server}", ttft("restart-sigkill", server), "next round after SIGKILL + restart"),
        ]
    for name, samples, desc in metric_specs:
        if samples:
            res.metric(name, samples, "s", "lower", desc)
    errors = {n: {} for n in names}
    for r in recs:
        if r.error is not None:
            errors[r.server][r.phase] = errors[r.server].get(r.phase, 0) + 1
    res.output("errors", errors)
    res.check("our_errors", sum(errors[OURS].values()))
    checks = {}
    for kind in ("append", "regenerate", "edit"):
        checks[f"warm_{kind}_vs_best"] = ratio("warm", peers, {kind}, 2)
    checks["agents_vs_mlx_lm_defaults"] = ratio("agents", ["mlx_lm.server"], None, 2)
    checks["agents_matched_vs_best"] = ratio("agents-matched", peers, None, 2)
    for sig in ("sigterm", "sigkill"):
        checks[f"restart_{sig}_vs_mlx_lm"] = ratio(f"restart-{sig}", ["mlx_lm.server"])
        checks[f"restart_{sig}_vs_best"] = ratio(f"restart-{sig}", peers)
    rss = out.get("rss")
    if rss and len(rss) > 2:
        # the slope of RSS over added agents; allocators cache freed memory, so a slope can even be
        # negative (a server that evicts): compare ours with the best peer's, floored at zero
        per_agent = {n: float(np.polyfit([x["users"] for x in rss], [x[n] for x in rss], 1)[0]) for n in names}
        res.output("rss_per_agent_bytes", per_agent)
        best = min((max(v, 0.0) for n, v in per_agent.items() if n != OURS), default=None)
        if best is not None:
            checks["rss_per_agent_excess_mib"] = (per_agent[OURS] - best) / 2**20
    conc = out.get("concurrency") or {}
    for level, by_server in conc.items():
        for n, c in by_server.items():
            itl = [x for r in recs if r.phase == f"concurrency-{level}" and r.server == n for x in r.itl_s]
            c["throughput_tok_s"] = c["output_tokens"] / c["wall_s"] if c["wall_s"] else None
            c["itl_p99_s"] = float(np.percentile(itl, 99)) if itl else None
    res.output("concurrency", conc)
    for k, v in checks.items():
        res.check(k, v)
    if out.get("five_turns"):
        _five_turns(ctx, out["five_turns"])
    _plots(ctx, recs, names, conc)


def _five_turns(ctx, rows: list[dict]) -> None:
    """The five turns' goal: ours against mlx_lm.server, per turn (medians over repeats)."""
    from harness.serving.phases import FIVE_TURNS

    res = ctx.results
    table = five_turns_table(rows)
    res.output("five_turns", {"rows": rows, "by_turn": table})
    for kind in FIVE_TURNS:
        for server in sorted({n for r in rows for n in r["servers"]}):
            xs = [r["servers"][server]["ttft_s"] for r in rows if r["kind"] == kind and server in r["servers"]]
            xs = [x for x in xs if x is not None]
            if xs:
                res.metric(f"ttft_five_turns_{kind}_{server}", xs, "s", "lower", f"five turns past the window: {kind}")
    for k, v in five_turns_checks(rows, table).items():
        res.check(k, v)
    if "five_turns" in ctx.config.plots and table and all(t.get(OURS) and t.get(MLX_LM) for t in table):
        nan = float("nan")
        series = lambda key: {n: [t[n][key] if t[n][key] is not None else nan for t in table]  # noqa: E731
                              for n in (OURS, MLX_LM)}
        ctx.plots.append(plots.turns_plot(
            [f"{t['turn']} {t['kind']}" for t in table], series("ttft_s"), series("cached_tokens"),
            [t[OURS]["prompt_tokens"] for t in table], ctx.plot_path("five-turns"),
            f"{ctx.model_name}: five turns past the window (median of {len(rows) // len(FIVE_TURNS)})"))


def five_turns_table(rows: list[dict]) -> list[dict]:
    """Per turn and server: median TTFT, cached and prompt tokens over the repeats (None where none)."""
    out = []
    for turn in sorted({r["turn"] for r in rows}):
        these = [r for r in rows if r["turn"] == turn]
        entry = {"turn": turn, "kind": these[0]["kind"]}
        for server in sorted({n for r in these for n in r["servers"]}):
            cells = [r["servers"][server] for r in these if server in r["servers"]]
            entry[server] = {key: _median(c[key] for c in cells)
                             for key in ("ttft_s", "cached_tokens", "prompt_tokens")}
        out.append(entry)
    return out


def five_turns_checks(rows: list[dict], table: list[dict]) -> dict:
    """The goal's three checks (cached margin, TTFT ratio, replies against fresh prefills) and their parts.

    ``five_turns_cached_ge_mlx_lm``: the smallest (ours - mlx_lm.server's) cached tokens over every
    turn of every repeat (>= 0 passes; None where mlx_lm.server reports none).
    ``five_turns_ttft_vs_mlx_lm``: the largest per-turn ratio of median TTFTs over turns 2-5 (the cold
    turn 1 is reported beside it, as ``five_turns_ttft_vs_mlx_lm_by_turn``).
    ``five_turns_replies_equal_fresh``: how many of our replies differ from a fresh prefill's (0 passes).
    """
    margins = [r["servers"][OURS]["cached_tokens"] - r["servers"][MLX_LM]["cached_tokens"] for r in rows
               if OURS in r["servers"] and MLX_LM in r["servers"]
               and None not in (r["servers"][OURS]["cached_tokens"], r["servers"][MLX_LM]["cached_tokens"])]
    by_turn = {}
    for t in table:
        ours, theirs = (t.get(n, {}).get("ttft_s") for n in (OURS, MLX_LM))
        by_turn[f"{t['turn']}_{t['kind']}"] = ours / theirs if ours and theirs else None
    later = [v for k, v in by_turn.items() if not k.startswith("1_")]
    fresh = [r["fresh"] for r in rows if "fresh" in r]
    return {
        "five_turns_cached_ge_mlx_lm": min(margins) if margins else None,
        "five_turns_ttft_vs_mlx_lm": max(later) if later and None not in later else None,
        "five_turns_ttft_vs_mlx_lm_by_turn": by_turn,
        "five_turns_replies_equal_fresh": sum(not f["equal"] for f in fresh) if fresh else None,
        # a fresh reference that found anything cached would not be fresh
        "five_turns_fresh_cached_max": max((f["cached_tokens"] or 0) for f in fresh) if fresh else None,
    }


def _plots(ctx, recs, names: list[str], conc: dict) -> None:
    if "ttft_rounds" in ctx.config.plots:
        series = {}
        for n in names:
            rows = sorted((r.round, r.ttft_s) for r in recs if r.phase == "warm" and r.server == n
                          and r.kind in ("first", "append") and r.error is None)
            if rows:
                series[n] = ([x for x, _ in rows], [y for _, y in rows], None)
        if series:
            ctx.plots.append(plots.scaling_plot(series, ctx.plot_path("ttft-rounds"), "round", "TTFT (s, client)",
                                                f"{ctx.model_name}: warm multi-turn TTFT per round", logy=True))
    if "ttft_cdf" in ctx.config.plots:
        for phase in sorted({r.phase for r in recs if not r.phase.startswith("five_turns")}):  # see _five_turns
            samples = {n: [r.ttft_s for r in recs if r.phase == phase and r.server == n and r.error is None]
                       for n in names}
            samples = {k: v for k, v in samples.items() if v}
            if samples:
                ctx.plots.append(plots.cdf_plot(samples, ctx.plot_path(f"cdf-{phase}"), "TTFT (s, client)",
                                                f"{ctx.model_name}: TTFT CDF, phase {phase}"))
    if "throughput" in ctx.config.plots and conc:
        groups = {f"C={lvl}": {n: c["throughput_tok_s"] or 0.0 for n, c in by.items()} for lvl, by in conc.items()}
        ctx.plots.append(plots.throughput_plot(groups, ctx.plot_path("concurrency"), "output tokens/s",
                                               f"{ctx.model_name}: throughput at C concurrent clients"))


def _validate(p: dict) -> None:
    unknown = [n for n in p["targets"] if n not in TARGETS]
    if unknown or OURS not in p["targets"]:
        raise ValueError(f"targets must include {OURS!r} and name known targets ({sorted(TARGETS)}), not {unknown}")
    for ph in [*p["phases"], *(x for v in p["phases_by_model"].values() for x in v)]:
        if ph not in ALL_PHASES:
            raise ValueError(f"unknown phase {ph!r}; phases: {ALL_PHASES}")
    if OURS not in p["five_turns_targets"] or p["five_turns_repeats"] < 1:
        raise ValueError(f"five_turns_targets must include {OURS!r} (its replies are checked) "
                         "and five_turns_repeats >= 1")
    if p["agents"] < 1 or p["agent_rounds"] < 2 or p["warm_rounds"] < 2:
        raise ValueError("agents >= 1, agent_rounds >= 2 and warm_rounds >= 2 (round 1 has no cache of its own)")


KIND = register(Kind(
    name="serving",
    run=run,
    params={
        "targets": Param(list, [OURS, "mlx_lm.server", "mlx-vlm", "vllm-mlx", "omlx", "lmstudio-mlx-engine", "llama.cpp"],
                         "servers to compare (harness.serving.targets); those not runnable here keep a row"),
        "phases": Param(list, list(ALL_PHASES), f"phases to run, of {ALL_PHASES}"),
        "phases_by_model": Param(dict, {}, "model -> phases, overriding `phases` for that model"),
        "system_tokens": Param(int, 600, "tokens of the system prompt every user shares"),
        "answer_tokens": Param(int, 32, "max_tokens of every reply (greedy)"),
        "warm_rounds": Param(int, 4, "rounds of the warm phase's user (each: append, regenerate, edit)"),
        "five_turns_targets": Param(list, [OURS, MLX_LM],
                                    "servers the five_turns phase asks (its goal compares ours with mlx_lm.server)"),
        "five_turns_repeats": Param(int, 3,
                                    "five-turn conversations, each with its own system prompt (medians over them)"),
        "five_turns_system_tokens": Param(int, 560,
                                          "the five turns' system prompt (with the question: past a 512-token window)"),
        "five_turns_question_tokens": Param(int, 10, "tokens of each user message of the five turns"),
        "five_turns_answer_tokens": Param(int, 8, "max_tokens of each five-turn reply (greedy)"),
        "agents": Param(int, 16, "users in round robin (mlx_lm.server keeps 10 caches by default)"),
        "agent_rounds": Param(int, 2, "rounds per user in the agents phase"),
        "shared_users": Param(int, 6, "new users whose first turn shares the system prompt (RSS growth)"),
        "restart_users": Param(int, 16, "users whose next round follows each restart"),
        "kill_after_s": Param(float, 2.0, "idle seconds between the last round and the signal"),
        "concurrency": Param(list, [1, 4, 8], "concurrent clients per level"),
        "concurrency_rounds": Param(int, 2, "rounds per concurrent client"),
        "matched_pool_mb": Param(int, 1024, "the cache budget every server gets in the matched pass (our pool)"),
        "model_dir": Param(str, "", "a model directory to serve instead of the prepared one (tests: a tiny model)"),
    },
    plots=frozenset({"ttft_rounds", "ttft_cdf", "throughput", "five_turns"}),
    needs_model=False,
    validate=_validate,
    trial_code=(P.Bench.warm, P.Bench.five_turns, P.Bench.agents, P.Bench.concurrency, chat),
))
