"""EXP-009's results from the bench's records: TTFT metrics, errors, ratio checks, RSS, throughput and plots.

Ratios are ours over the best peer's (or mlx_lm.server's), from medians of the
same run; lower is better for TTFT and RSS.
"""

from __future__ import annotations

from functools import partial

import numpy as np

from harness import plots
from harness.servers.phases import FIVE_TURNS, Bench
from harness.servers.targets import MLX_LM, OURS


def _median(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return float(np.median(xs)) if xs else None


def record(ctx, bench: Bench, out: dict, names: list[str]) -> None:
    """Everything the run measured into ``ctx.results`` (``out``: what the phases returned) and its plots."""
    res, recs = ctx.results, bench.records
    res.output("requests", [r.row() for r in recs])
    res.output("run", {k: v for k, v in out.items() if k != "events"} | {"events": out["events"]})
    peers = [n for n in names if n != OURS]
    _ttft_metrics(res, recs, names)
    _errors(res, recs, names)
    checks = _ratio_checks(recs, peers)
    excess = _rss_per_agent_excess_mib(res, out.get("rss"), names)
    if excess is not None:
        checks["rss_per_agent_excess_mib"] = excess
    conc = _with_throughput(recs, out.get("concurrency") or {})
    res.output("concurrency", conc)
    res.checks(checks)
    if out.get("five_turns"):
        _five_turns(ctx, out["five_turns"])
    _plots(ctx, recs, names, conc)


def _ttft(recs, phase: str, server: str, kinds=None, min_round: int = 1) -> list[float]:
    return [r.ttft_s for r in recs if r.phase == phase and r.server == server and r.error is None
            and r.round >= min_round and (kinds is None or r.kind in kinds)]


def _ratio(recs, phase: str, against: list[str], kinds=None, min_round: int = 1) -> float | None:
    """Our median TTFT over the best median of ``against`` (None where either side has none)."""
    ttft = partial(_ttft, recs)
    ours = _median(ttft(phase, OURS, kinds, min_round))
    best = min((m for n in against if (m := _median(ttft(phase, n, kinds, min_round))) is not None), default=None)
    return ours / best if ours and best else None


def _ttft_metrics(res, recs, names: list[str]) -> None:
    """Every server's TTFT samples per phase (the warm phase's per kind of turn), where it has any."""
    ttft = partial(_ttft, recs)
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


def _errors(res, recs, names: list[str]) -> None:
    """Failed requests per server and phase; ours must have none."""
    errors = {n: {} for n in names}
    for r in recs:
        if r.error is not None:
            errors[r.server][r.phase] = errors[r.server].get(r.phase, 0) + 1
    res.output("errors", errors)
    res.check("our_errors", sum(errors[OURS].values()))


def _ratio_checks(recs, peers: list[str]) -> dict:
    """Our median TTFT over the best peer's (or mlx_lm.server's) in the warm, agents and restart phases."""
    ratio = partial(_ratio, recs)
    checks = {}
    for kind in ("append", "regenerate", "edit"):
        checks[f"warm_{kind}_vs_best"] = ratio("warm", peers, {kind}, 2)
    checks["agents_vs_mlx_lm_defaults"] = ratio("agents", ["mlx_lm.server"], None, 2)
    checks["agents_matched_vs_best"] = ratio("agents-matched", peers, None, 2)
    for sig in ("sigterm", "sigkill"):
        checks[f"restart_{sig}_vs_mlx_lm"] = ratio(f"restart-{sig}", ["mlx_lm.server"])
        checks[f"restart_{sig}_vs_best"] = ratio(f"restart-{sig}", peers)
    return checks


def _rss_per_agent_excess_mib(res, rss: list[dict] | None, names: list[str]) -> float | None:
    """Our RSS slope over added agents less the best peer's, in MiB (None without 3 points or a peer)."""
    if not rss or len(rss) <= 2:
        return None
    # the slope of RSS over added agents; allocators cache freed memory, so a slope can even be
    # negative (a server that evicts): compare ours with the best peer's, floored at zero
    per_agent = {n: float(np.polyfit([x["users"] for x in rss], [x[n] for x in rss], 1)[0]) for n in names}
    res.output("rss_per_agent_bytes", per_agent)
    best = min((max(v, 0.0) for n, v in per_agent.items() if n != OURS), default=None)
    return (per_agent[OURS] - best) / 2**20 if best is not None else None


def _with_throughput(recs, conc: dict) -> dict:
    """The concurrency phase's results, each server's output tokens/s and p99 inter-token latency added."""
    for level, by_server in conc.items():
        for n, c in by_server.items():
            itl = [x for r in recs if r.phase == f"concurrency-{level}" and r.server == n for x in r.itl_s]
            c["throughput_tok_s"] = c["output_tokens"] / c["wall_s"] if c["wall_s"] else None
            c["itl_p99_s"] = float(np.percentile(itl, 99)) if itl else None
    return conc


def _five_turns(ctx, rows: list[dict]) -> None:
    """The five turns' goal: ours against mlx_lm.server, per turn (medians over repeats)."""
    res = ctx.results
    table = five_turns_table(rows)
    res.output("five_turns", {"rows": rows, "by_turn": table})
    for kind in FIVE_TURNS:
        for server in sorted({n for r in rows for n in r["servers"]}):
            xs = [r["servers"][server]["ttft_s"] for r in rows if r["kind"] == kind and server in r["servers"]]
            xs = [x for x in xs if x is not None]
            if xs:
                res.metric(f"ttft_five_turns_{kind}_{server}", xs, "s", "lower", f"five turns past the window: {kind}")
    res.checks(five_turns_checks(rows, table))
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
