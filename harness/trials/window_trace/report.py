"""EXP-021's checks from the recorded trace, and the README a run writes. Pure: rows in, numbers out."""

from __future__ import annotations

from typing import Sequence

from harness.common.report import fmt, median, verdict_table
from harness.servers.targets import MLX_LM, OURS

KINDS = ("first", "append", "subagent")
SHORT = {"gemma3-270m": "gemma", "smollm2-135m": "smollm2"}


def short(model: str) -> str:
    return SHORT.get(model, model.split("-")[0])


def paired_ratios(rows: Sequence[dict], kind: str) -> list[float]:
    """Per step both servers answered: ours' TTFT ÷ ``mlx_lm.server``'s."""
    by: dict[tuple, dict[str, float]] = {}
    for r in rows:
        if r["kind"] == kind and r["error"] is None and r["ttft_s"]:
            by.setdefault((r["user"], r["round"]), {})[r["server"]] = r["ttft_s"]
    return [v[OURS] / v[MLX_LM] for v in by.values() if OURS in v and MLX_LM in v]


def model_checks(d: dict) -> dict:
    rows = d["rows"]
    c: dict = {"errors": sum(r["error"] is not None for r in rows)}
    for kind in KINDS:
        xs = paired_ratios(rows, kind)
        c[f"{kind}_over_mlx_lm"] = median(xs)
        c[f"{kind}_ratio_min"] = min(xs, default=None)
        c[f"{kind}_ratio_max"] = max(xs, default=None)
        c[f"{kind}_pairs"] = len(xs)
        for srv, tag in ((OURS, "ours"), (MLX_LM, "mlx_lm")):
            c[f"{kind}_ttft_s_{tag}"] = median(r["ttft_s"] for r in rows
                                               if r["server"] == srv and r["kind"] == kind and r["error"] is None)
            goal = [r for r in rows if r["server"] == srv and r["kind"] == kind and r["reuse_ok"] is not None]
            if goal:
                c[f"reuse_{kind}_{tag}"] = f"{sum(bool(r['reuse_ok']) for r in goal)}/{len(goal)}"
                if srv == OURS:
                    c[f"reuse_{kind}_ok"] = all(r["reuse_ok"] for r in goal)
    prof = d.get("profile")
    if prof:
        for k in ("admit_s", "prefill_s", "keep_s", "finish_s", "forward_s"):
            c[f"profile_{k}"] = prof[k]
    return c


def checks(out: dict) -> dict:
    """Every check, per model (prefixed with its short name and an underscore: criteria paths split at dots)."""
    c: dict = {"parts_failed": len(out.get("failed") or []), "errors": 0}
    for m, d in out.get("models", {}).items():
        mc = model_checks(d)
        c["errors"] += mc["errors"]
        for k, v in mc.items():
            c[f"{short(m)}_{k}"] = v
    return c


def readme(ctx, out: dict, c: dict) -> str:
    verdicts = ctx.results.evaluate()
    doc = ctx.results.doc
    p = ctx.params
    parts = []
    for m, d in out.get("models", {}).items():
        g = short(m)
        q = lambda k: fmt(c.get(f"{g}_{k}"))  # noqa: E731
        lines = ["| turn type | pairs | ours TTFT s | mlx_lm.server TTFT s | ours ÷ mlx_lm (median) | per turn | ours reuse ok | mlx_lm reuse ok |",
                 "|---|---|---|---|---|---|---|---|"]
        for kind in KINDS:
            lines.append(f"| {kind} | {q(kind + '_pairs')} | {q(kind + '_ttft_s_ours')} | {q(kind + '_ttft_s_mlx_lm')} | "
                         f"**{q(kind + '_over_mlx_lm')}** | {q(kind + '_ratio_min')}–{q(kind + '_ratio_max')} | "
                         f"{q('reuse_' + kind + '_ours')} | {q('reuse_' + kind + '_mlx_lm')} |")
        prof = d.get("profile")
        extra = ""
        if prof:
            extra = f"""
One append turn in this process ({prof['append_tokens']} new tokens over {prof['cached_tokens']} cached, median of
{prof['reps']}): admission (reuse + rebuild) {fmt(prof['admit_s'])} s, the prefill step to the first token
{fmt(prof['prefill_s'])} s, of which pooling the passed window blocks {fmt(prof['keep_s'])} s; the finished
cache's extraction {fmt(prof['finish_s'])} s (after the first token). The same forward passes with no engine
(the passes the step loop makes: one with its head on the last row up to 256 tokens, else a cache-only
pass and the last token alone; on the same rebuilt cache) {fmt(prof['forward_s'])} s.
"""
        parts.append(f"### {m} (system prompts {d['system_tokens']} tokens)\n\n" + "\n".join(lines) + "\n" + extra)
    failed = "\n".join(f"- {f['part']}: `{f['error'].strip().splitlines()[-1][:300]}`"
                       for f in out.get("failed", [])) or "none"
    return f"""# EXP-021: sliding windows that cost nothing, a coding-agent trace against mlx_lm.server

`make exp-021` (`harness run experiments/exp_021_window_trace.toml --quick`); see
`harness/trials/window_trace/trial.py`. This file is written by the run. Latest run: `{doc['run_id']}`
({doc['created_at'][:19]} UTC), results `{doc['run_id']}.json`.

{p['agents']} agents × {p['rounds']} turns, each turn after the first appending the reply and about
{p['tool_tokens']} tokens of tool output (a `read_file` of this repository's source); each agent a system prompt
of its own (its first turn is cold); after round {p['subagents_after']}, {p['subagents']} sub-agent(s) per agent
on its system prompt. Both servers load the same float32 weights on OpenBLAS; client TTFT through the OpenAI
API, streamed, greedy, {p['max_tokens']} tokens a reply, after one unrecorded request to each server; the two
servers take every step in turn, the order rotating step by step. Ratios are medians of the per-step pairs;
"per turn" is their range.

{chr(10).join(parts)}
Parts that failed: {failed}

{verdict_table(verdicts)}
"""
