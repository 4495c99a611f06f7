"""EXP-018's checks from the recorded turns, and the README a run writes. Pure: rows in, numbers out."""

from __future__ import annotations

from typing import Sequence

from harness.common.report import fmt, median, verdict_table
from harness.trials.hybrid.turns import OURS

MLX_LM = "mlx_lm.server"
WARM_KINDS = ("append", "regenerate", "edit")


def best_peer_ratios(rows: Sequence[dict], phase: str, kind: str, peers: Sequence[str]) -> list[float]:
    """Per step that ours and at least one peer answered: ours' TTFT ÷ the fastest peer's."""
    by: dict[tuple, dict[str, float]] = {}
    for r in rows:
        if r["phase"] == phase and r["kind"] == kind and r["error"] is None and r["ttft_s"]:
            by.setdefault((r["user"], r["round"], r.get("rep")), {})[r["server"]] = r["ttft_s"]
    out = []
    for v in by.values():
        have = [v[p] for p in peers if p in v]
        if OURS in v and have:
            out.append(v[OURS] / min(have))
    return out


def reuse_share(rows: Sequence[dict], server: str, phases: Sequence[str], kinds: Sequence[str]) -> tuple[int, int]:
    """(turns that found what they must, turns with a goal) of ``server``."""
    goal = [r for r in rows if r["server"] == server and r["phase"] in phases and r["kind"] in kinds
            and r["reuse_ok"] is not None]
    return sum(bool(r["reuse_ok"]) for r in goal), len(goal)


def geometry_checks(d: dict) -> dict:
    """The checks of one served geometry."""
    rows, peers = d["rows"], [s for s in d["servers"] if s != OURS]
    c: dict = {"peers": peers, "errors": sum(r["error"] is not None for r in rows)}
    for kind in WARM_KINDS:
        c[f"{kind}_over_best_peer"] = median(best_peer_ratios(rows, "warm", kind, peers))
    c["shared_over_best_peer"] = median(best_peer_ratios(rows, "shared", "first", peers))
    if MLX_LM in peers:
        c["agents_over_mlx_lm"] = median(best_peer_ratios(rows, "agents", "append", [MLX_LM]))
        c["agents_over_best_peer"] = median(best_peer_ratios(rows, "agents", "append", peers))
    restarts = d.get("restart") or []
    pairs = [(e["resumed"][OURS]["ttft_s"], e["cold"]["ttft_s"]) for e in restarts
             if OURS in e.get("resumed", {}) and e.get("cold") and e["resumed"][OURS]["ttft_s"] and e["cold"]["ttft_s"]]
    c["restart_over_cold"] = median([a / b for a, b in pairs])
    c["restart_ttft_s"] = median([a for a, _ in pairs])
    c["cold_ttft_s"] = median([b for _, b in pairs])
    for srv in d["servers"]:
        tag = "ours" if srv == OURS else srv
        for label, phases, kinds in (("append", ("warm", "agents"), ("append",)), ("regenerate", ("warm",), ("regenerate",)),
                                     ("edit", ("warm",), ("edit",)), ("shared", ("warm", "shared", "agents"), ("first",)),
                                     ("restart", ("restart",), ("restart",)),
                                     ("restart_shared", ("restart",), ("first",))):
            ok, n = reuse_share(rows, srv, phases, kinds)
            c[f"reuse_{label}_{tag}"] = f"{ok}/{n}"
            if srv == OURS:
                c[f"reuse_{label}_ok"] = ok == n and n > 0
    stats = d.get("stats") or []
    c["ram_budget_held"] = bool(stats) and all(
        s["ram_bytes"] is not None and s["ram_bytes"] <= s["ram_budget_bytes"]
        and (s["ram_peak_bytes"] or 0) <= s["ram_budget_bytes"] and not s["over_budget_steps"] for s in stats)
    c["ram_peak_bytes"] = max((s["ram_peak_bytes"] or 0 for s in stats), default=None)
    c["ram_budget_bytes"] = max((s["ram_budget_bytes"] or 0 for s in stats), default=None)
    c["pool_used_bytes_max"] = max((s["pool_used_bytes"] or 0 for s in stats), default=None)
    return c


def _worst(values: Sequence, high_is_bad: bool = True):
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return max(vals) if high_is_bad else min(vals)


def checks(out: dict) -> dict:
    """Every check: per geometry (prefixed) and the worst over the served geometries (unprefixed)."""
    c: dict = {"parts_failed": len(out.get("failed") or [])}
    per = {g: geometry_checks(d) for g, d in out.get("geometries", {}).items()}
    for g, gc in per.items():
        for k, v in gc.items():
            if not isinstance(v, list):
                c[f"{g}.{k}"] = v
    ratio_keys = ("append_over_best_peer", "regenerate_over_best_peer", "edit_over_best_peer",
                  "shared_over_best_peer", "agents_over_mlx_lm", "restart_over_cold")
    for k in ratio_keys:
        c[k] = _worst([gc.get(k) for gc in per.values()])
    for k in ("reuse_append_ok", "reuse_regenerate_ok", "reuse_edit_ok", "reuse_shared_ok", "reuse_restart_ok",
              "reuse_restart_shared_ok", "ram_budget_held"):
        c[k] = bool(per) and all(gc.get(k) for gc in per.values())
    c["errors"] = sum(gc["errors"] for gc in per.values())
    sizes = out.get("sizes") or {}
    for row in sizes.get("rows", []):
        m = row["model"]
        for k in ("snapshot_bytes", "block_bytes", "snapshot_over_block", "snapshot_over_kv_4096", "snapshot_over_kv_32768"):
            c[f"{m}.{k}"] = row[k]
    for m, t in (sizes.get("store") or {}).items():
        snap, kv = t["with_snapshot"], t["kv_only"]
        if "error" in snap:
            c[f"{m}.snapshot_store"] = snap["error"][:200]
            continue
        c[f"{m}.save_s"], c[f"{m}.load_s"] = snap["save_s"], snap["load_s"]
        c[f"{m}.save_s_kv_only"], c[f"{m}.load_s_kv_only"] = kv.get("save_s"), kv.get("load_s")
        c[f"{m}.written_bytes"], c[f"{m}.restored_whole"] = snap["written_bytes"], snap["restored_whole"]
    c["snapshot_store_ok"] = bool(sizes.get("store")) and all(
        "error" not in t["with_snapshot"] and t["with_snapshot"]["restored_whole"] for t in sizes["store"].values())
    return c


def _mb(v) -> str:
    return "-" if v is None else f"{v / 1e6:.1f}"


def readme(ctx, out: dict, c: dict) -> str:
    verdicts = ctx.results.evaluate()
    doc = ctx.results.doc
    parts = []
    for g, d in out.get("geometries", {}).items():
        servers = d["servers"]
        head = "| turn | " + " | ".join(f"{s} TTFT s (median)" for s in servers) + " | " + \
               " | ".join(f"{s} reuse ok" for s in servers) + " |"
        lines = [head, "|" + "---|" * (1 + 2 * len(servers))]
        for phase, kind in (("warm", "first"), ("warm", "append"), ("warm", "regenerate"), ("warm", "edit"),
                            ("shared", "first"), ("agents", "first"), ("agents", "append"), ("restart", "restart"),
                            ("restart-cold", "cold")):
            rs = [r for r in d["rows"] if r["phase"] == phase and r["kind"] == kind]
            if not rs:
                continue
            t = [fmt(median([r["ttft_s"] for r in rs if r["server"] == s and r["ttft_s"]])) for s in servers]
            ok = []
            for s in servers:
                mine = [r for r in rs if r["server"] == s and r["reuse_ok"] is not None]
                ok.append(f"{sum(bool(r['reuse_ok']) for r in mine)}/{len(mine)}" if mine else "-")
            lines.append(f"| {phase} {kind} | " + " | ".join(t) + " | " + " | ".join(ok) + " |")
        skipped = "; ".join(f"{k}: {v}" for k, v in d.get("skipped", {}).items()) or "none"
        p = lambda k: fmt(c.get(f"{g}.{k}"))  # noqa: E731
        parts.append(f"""### {g} ({', '.join(f'{n} {k}' for k, n in d['layer_counts'].items())}; system prompt {d['system_tokens']} tokens)

Peers not run: {skipped}.

{chr(10).join(lines)}

Ours ÷ best peer (median of interleaved pairs): append {p('append_over_best_peer')}, regenerate
{p('regenerate_over_best_peer')}, edit {p('edit_over_best_peer')}, new agent on the shared prompt
{p('shared_over_best_peer')}; 12 agents (rounds ≥ 2) ÷ `mlx_lm.server` {p('agents_over_mlx_lm')}; restart resumed ÷
cold {p('restart_over_cold')} ({p('restart_ttft_s')} s against {p('cold_ttft_s')} s). Ours' RAM peak
{_mb(c.get(f'{g}.ram_peak_bytes'))} MB of a {_mb(c.get(f'{g}.ram_budget_bytes'))} MB budget, pool used at most
{_mb(c.get(f'{g}.pool_used_bytes_max'))} MB.
""")
    size_lines = ["| model | layers (recurrent + attention) | one snapshot MB | KV per 256-token block MB | snapshot ÷ block | ÷ KV of 4K | ÷ KV of 32K | save / restore s (snapshot + 1 block) | same, KV block only |",
                  "|---|---|---|---|---|---|---|---|---|"]
    sizes = out.get("sizes") or {}
    for row in sizes.get("rows", []):
        m = row["model"]
        t = (sizes.get("store") or {}).get(m, {})
        snap, kv = t.get("with_snapshot", {}), t.get("kv_only", {})
        st = snap.get("error", "")[:120] if "error" in snap else f"{fmt(snap.get('save_s'))} / {fmt(snap.get('load_s'))}"
        size_lines.append(f"| {m} | {row['layers']} ({row['recurrent_layers']} + {row['attention_layers']}) | "
                          f"{_mb(row['snapshot_bytes'])} | {_mb(row['block_bytes'])} | {fmt(row['snapshot_over_block'])} | "
                          f"{fmt(row['snapshot_over_kv_4096'])} | {fmt(row['snapshot_over_kv_32768'])} | {st} | "
                          f"{fmt(kv.get('save_s'))} / {fmt(kv.get('load_s'))} |")
    failed = "\n".join(f"- {f['part']}: `{f['error'].strip().splitlines()[-1][:300]}`" for f in out.get("failed", [])) or "none"
    return f"""# EXP-018: hybrid models, reuse on every turn type, against the peers

`make exp-018` (`harness run experiments/exp_018_hybrid.toml --quick`); see `harness/trials/hybrid/trial.py`.
This file is written by the run. Latest run: `{doc['run_id']}` ({doc['created_at'][:19]} UTC), results
`{doc['run_id']}.json`. Random float32 weights at real geometries, SmolLM2's tokenizer (`harness/trials/hybrid/model.py`);
every server loads the same directory; client-side TTFT, servers taking turns step by step.

{chr(10).join(parts)}
### Snapshot sizes at big real geometries (from configs, no weights) and their cost through the block store

{chr(10).join(size_lines)}

Parts that failed: {failed}

{verdict_table(verdicts)}
"""
