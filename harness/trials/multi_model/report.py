"""EXP-019's checks from the recorded steps, rounds and samples, and the README a run writes. Pure: the
phases' outputs in, numbers out."""

from __future__ import annotations

import statistics
from typing import Sequence

from harness.common.report import fmt, median, verdict_table

MB = 2**20
SWITCH_KINDS = ("switch_first", "switch_back")


def _ttft(row: dict | None) -> float | None:
    return row["ttft_s"] if row and row.get("error") is None and row.get("ttft_s") else None


def paired(steps: Sequence[dict], kind: str, a: str, b: str, op=lambda x, y: x / y) -> list[float]:
    """``op(a's TTFT, b's TTFT)`` of every step of ``kind`` both sides answered, in order."""
    out = []
    for s in steps:
        x, y = _ttft(s.get(a)), _ttft(s.get(b))
        if s["kind"] == kind and x is not None and y is not None:
            out.append(op(x, y))
    return out


def reuse_ok(row: dict | None, expected: int | None) -> bool | None:
    """Whether a turn found what it must cached (None: no goal, or no answer)."""
    if expected is None or not row or row.get("error") is not None or row.get("cached_tokens") is None:
        return None
    return row["cached_tokens"] >= expected


def switch_checks(sw: dict) -> dict:
    """Criteria 1, 2 and 5: the switching cost against a single-model server and mlx_lm.server, and every
    switched-back agent's cache (cached from disk, and the reply a fresh prefill gives)."""
    steps = sw.get("steps") or []
    switches = [s for s in steps if s["kind"] != "first"]
    back = [s for s in steps if s["kind"] == "switch_back"]
    c: dict = {"switch_steps": len(switches), "switch_back_steps": len(back)}
    c["switch_errors"] = sum(1 for s in steps for side in ("ours", "single", "mlx_lm", "fresh")
                             if s.get(side) and s[side]["error"] is not None)
    c["switch_turns_unloaded"] = bool(switches) and all(s["state_before"] == "unloaded" for s in switches)
    ok = [reuse_ok(s["ours"], s["ours_expected_cached"]) for s in back]
    c["cache_survives_n"] = f"{sum(bool(x) for x in ok)}/{len(ok)}"
    c["cache_survives"] = bool(ok) and all(ok)
    c["replies_differing_fresh"] = sum(1 for s in back if not s.get("fresh") or s["ours"]["text"] != s["fresh"]["text"])
    c["reply_equals_fresh"] = bool(back) and c["replies_differing_fresh"] == 0
    c["single_replies_differing"] = sum(1 for s in steps
                                       if s.get("single") and s["single"]["text"] != s["ours"]["text"])
    c["reply_model_ok"] = bool(steps) and all(s["ours"].get("model") == s["model"] for s in steps)
    for kind in SWITCH_KINDS:
        c[f"{kind}_over_single"] = median(paired(steps, kind, "ours", "single"))
        c[f"{kind}_cost_s"] = median(paired(steps, kind, "ours", "single", lambda x, y: x - y))
        c[f"{kind}_over_mlx_lm"] = median(paired(steps, kind, "ours", "mlx_lm"))
        for side in ("ours", "single", "mlx_lm"):
            c[f"{kind}_ttft_{side}_s"] = median([_ttft(s.get(side)) for s in steps if s["kind"] == kind])
        c[f"{kind}_load_s"] = median([s.get("load_s") for s in steps if s["kind"] == kind])
    peer_ok = [reuse_ok(s.get("mlx_lm"), s.get("mlx_lm_expected_cached")) for s in back if s.get("mlx_lm")]
    c["mlx_lm_cache_survives_n"] = f"{sum(bool(x) for x in peer_ok)}/{len(peer_ok)}"
    c["mlx_lm_cached_after_switch"] = median([s["mlx_lm"]["cached_tokens"] for s in back
                                              if s.get("mlx_lm") and s["mlx_lm"]["error"] is None])
    c["ours_cached_after_switch"] = median([s["ours"]["cached_tokens"] for s in back if s["ours"]["error"] is None])
    # memory after each step: RSS, and RSS beyond what the fleet counts (runtime, tokenizer, what an unload left)
    c["rss_after_steps_mb"] = [round(s["rss_after_mb"]) if s.get("rss_after_mb") else None for s in steps]
    c["rss_beyond_fleet_mb"] = [round(s["rss_after_mb"] - s["fleet_resident_mb"])
                                if s.get("rss_after_mb") and s.get("fleet_resident_mb") is not None else None
                                for s in steps]
    return c


def memory_checks(phases: dict[str, dict], overhead_bytes: int | None) -> dict:
    """Criterion 4: RSS at every sample against ``--models-mb`` + the overhead (the RSS with no model
    loaded), and the fleet's own resident bytes against its budget, per phase and over all."""
    c: dict = {"overhead_mb": overhead_bytes / MB if overhead_bytes else None}
    n = over = fleet_n = fleet_over = 0
    worst = None
    for name, ph in phases.items():
        budget = ph["models_mb"] * MB
        rss = [r["rss_bytes"] for r in ph.get("rss") or [] if r["phase"] != "idle"]
        limit = budget + (overhead_bytes or 0)
        c[f"{name}_rss_peak_mb"] = max(rss) / MB if rss else None
        c[f"{name}_rss_limit_mb"] = limit / MB
        c[f"{name}_rss_over_limit"] = sum(r > limit for r in rss)
        fl = [f for f in ph.get("fleet") or [] if f.get("resident_bytes") is not None]
        c[f"{name}_fleet_resident_peak_mb"] = max((f["resident_bytes"] for f in fl), default=0) / MB if fl else None
        c[f"{name}_fleet_over_budget"] = sum(f["budget_bytes"] is not None and f["resident_bytes"] > f["budget_bytes"]
                                             for f in fl)
        n, over = n + len(rss), over + c[f"{name}_rss_over_limit"]
        fleet_n, fleet_over = fleet_n + len(fl), fleet_over + c[f"{name}_fleet_over_budget"]
        if rss:
            worst = max(worst or -1e18, (max(rss) - budget) / MB)
    c.update(rss_samples=n, rss_over_limit_samples=over, fleet_samples=fleet_n, fleet_over_budget_samples=fleet_over)
    c["rss_within_budget"] = overhead_bytes is not None and n > 0 and over == 0
    c["fleet_within_budget"] = fleet_n > 0 and fleet_over == 0
    c["rss_peak_over_models_mb"] = worst   # MB above --models-mb at the worst sample (compare: overhead_mb)
    return c


def overhead(sw: dict) -> tuple[int | None, bool]:
    """(the fleet server's peak RSS before any request, whether that was with no model loaded)."""
    idle = [r["rss_bytes"] for r in sw.get("rss") or [] if r["phase"] == "idle"]
    fleet = [f for f in sw.get("fleet") or [] if f["phase"] == "idle"]
    empty = bool(fleet) and all(f.get("resident_bytes") == 0 for f in fleet)
    return (max(idle) if idle else None), bool(idle) and empty


def concurrent_ratios(rows: Sequence[dict]) -> dict[str, dict[int, float]]:
    """model -> round -> the round's median TTFT on the fleet ÷ on the single servers."""
    by: dict[tuple, list[float]] = {}
    for r in rows:
        if r["error"] is None and r["ttft_s"]:
            by.setdefault((r["model"], r["round"], r["config"]), []).append(r["ttft_s"])
    out: dict[str, dict[int, float]] = {}
    for (mid, rnd, config), xs in sorted(by.items()):
        other = by.get((mid, rnd, "singles"))
        if config == "fleet" and other:
            out.setdefault(mid, {})[rnd] = statistics.median(xs) / statistics.median(other)
    return out


def concurrent_checks(conc: dict) -> dict:
    """Criterion 3: per model, the median over rounds ≥ 2 (warm appends) of each round's ratio; the worse model."""
    rows = conc.get("rows") or []
    c: dict = {"concurrent_turns": len(rows), "concurrent_errors": sum(r["error"] is not None for r in rows)}
    ratios = concurrent_ratios(rows)
    for mid, per in ratios.items():
        c[f"concurrent_over_single_{mid}"] = median([v for r, v in per.items() if r >= 2])
        c[f"concurrent_first_round_over_single_{mid}"] = per.get(1)
        for config in ("fleet", "singles"):
            c[f"concurrent_ttft_{config}_{mid}_s"] = median([r["ttft_s"] for r in rows if r["model"] == mid
                                                             and r["config"] == config and r["round"] >= 2
                                                             and r["error"] is None])
    warm = [c[f"concurrent_over_single_{m}"] for m in ratios if c[f"concurrent_over_single_{m}"] is not None]
    c["concurrent_over_single"] = max(warm) if warm else None
    c["concurrent_ratios"] = {m: {str(r): round(v, 4) for r, v in per.items()} for m, per in ratios.items()}
    return c


def checks(out: dict) -> dict:
    """Every check of a run: its phases' and the P0 ones (phases that failed, requests that failed)."""
    sw, conc = out.get("switching") or {}, out.get("concurrent") or {}
    c: dict = {"parts_failed": len(out.get("failed") or []) + sum(bool(ph.get("error")) for ph in (sw, conc))}
    c.update(switch_checks(sw))
    c.update(concurrent_checks(conc))
    over, empty = overhead(sw)
    c["overhead_measured"] = over is not None and empty
    phases = {k: ph for k, ph in (("switching", sw), ("concurrent", conc)) if ph.get("models_mb")}
    c.update(memory_checks(phases, over))
    c["errors"] = c["switch_errors"] + c["concurrent_errors"]
    return c


def _switch_table(c: dict) -> str:
    rows = []
    for kind, label in (("switch_first", "an agent's first turn on the model just loaded"),
                        ("switch_back", "an agent's next turn after its model was unloaded")):
        rows.append(f"| {label} | {fmt(c.get(f'{kind}_ttft_ours_s'))} | {fmt(c.get(f'{kind}_ttft_single_s'))} | "
                    f"{fmt(c.get(f'{kind}_ttft_mlx_lm_s'))} | {fmt(c.get(f'{kind}_load_s'))} | "
                    f"**{fmt(c.get(f'{kind}_over_single'))}** ({fmt(c.get(f'{kind}_cost_s'))} s) | "
                    f"**{fmt(c.get(f'{kind}_over_mlx_lm'))}** |")
    return "\n".join(rows)


def _conc_table(c: dict, models: Sequence[str]) -> str:
    return "\n".join(f"| {m} | {fmt(c.get(f'concurrent_ttft_fleet_{m}_s'))} | "
                     f"{fmt(c.get(f'concurrent_ttft_singles_{m}_s'))} | "
                     f"**{fmt(c.get(f'concurrent_over_single_{m}'))}** | "
                     f"{fmt(c.get(f'concurrent_first_round_over_single_{m}'))} |" for m in models)


def _steps_models(run: dict) -> str:
    ids, n = list(run["models"]), run["params"]["switch_rounds"] * len(run["models"])
    return " ".join(ids[k % len(ids)] for k in range(n))


def readme(run: dict, c: dict, verdicts: Sequence[dict]) -> str:
    """The results folder's README: what ran, the tables, the verdicts. ``run``: run_id, created_at,
    models (id -> directory name), params."""
    p, models = run["params"], list(run["models"])
    named = ", ".join(f"`{m}` = {d}" for m, d in run["models"].items())
    return f"""# EXP-019: several models behind one server

`make exp-019` (`harness run experiments/exp_019_models.toml --quick`; `make exp-019-full` without
`--quick`) runs `harness/trials/multi_model/trial.py`: {named}. This file is written by the run. Latest run:
`{run['run_id']}` ({run['created_at'][:19]} UTC, {'quick' if run.get('quick') else 'full'}), results
`{run['run_id']}.json`: {p['system_tokens']}-token system prompts, {p['max_tokens']}-token greedy replies,
`--pool-mb {p['pool_mb']}` per model.

## Switching (`--models-mb {p['switch_models_mb']}`: one model fits, every turn after the first unloads the other)

Median client TTFT in seconds; each step went to ours (the fleet server), a server of that model alone
(its first turn after a start, its load done before) and `mlx_lm.server` (sent the model's directory),
in rotating order. Load: the fleet's `semantic_model_load_seconds` after the turn.

| turn | ours | single-model server | `mlx_lm.server` | ours' load (s) | ours ÷ single (ours − single) | \
ours ÷ `mlx_lm.server` |
|---|---|---|---|---|---|---|
{_switch_table(c)}

Switched-back turns that found their previous prompt and reply cached (≥ prompt + reply − {p['reply_slack']}):
ours {c.get('cache_survives_n')} (median {fmt(c.get('ours_cached_after_switch'))} tokens cached),
`mlx_lm.server` {c.get('mlx_lm_cache_survives_n')} (median {fmt(c.get('mlx_lm_cached_after_switch'))}: what its
in-RAM prompt cache kept across its switch). Replies unlike a fresh prefill: {c.get('replies_differing_fresh')};
single-model replies unlike ours: {c.get('single_replies_differing')}.

## Both models loaded, {p['conc_agents']} agents per model at once (`--models-mb {p['conc_models_mb']}`, both pinned)

Median client TTFT (s) of rounds ≥ 2 (warm appends), one server with both models against two single-model
servers on the same cores, measured alternately:

| model | one server, both models | two single-model servers | ratio (median of rounds ≥ 2) | ratio, round 1 |
|---|---|---|---|---|
{_conc_table(c, models)}

## Memory

RSS (the server and its children, every {p['sample_s'] * 1000:.0f} ms) with no model loaded, before any request
(the stated overhead): **{fmt(c.get('overhead_mb'))} MB**. Peak RSS: switching \
{fmt(c.get('switching_rss_peak_mb'))} MB
against a limit of {fmt(c.get('switching_rss_limit_mb'))} MB; both loaded {fmt(c.get('concurrent_rss_peak_mb'))} MB
against {fmt(c.get('concurrent_rss_limit_mb'))} MB; samples over the limit: {c.get('rss_over_limit_samples')} of
{c.get('rss_samples')}; worst sample {fmt(c.get('rss_peak_over_models_mb'))} MB above `--models-mb`. The fleet's own
resident bytes (weights and pools it counts): peak {fmt(c.get('switching_fleet_resident_peak_mb'))} /
{fmt(c.get('concurrent_fleet_resident_peak_mb'))} MB, over its budget in {c.get('fleet_over_budget_samples')} of
{c.get('fleet_samples')} samples. After each switching step (models {_steps_models(run)}): RSS
{c.get('rss_after_steps_mb')} MB, of it beyond what the fleet counts {c.get('rss_beyond_fleet_mb')} MB.

{verdict_table(verdicts)}
"""
