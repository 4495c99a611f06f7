"""EXP-017's checks from the phases' rows (pure): per layout, and the candidate layout (the first) over the
baseline (the second). Check names carry the layout names: ``write_amp_blocks_max``, ``restart_blocks_over_file``."""

from __future__ import annotations

from collections import defaultdict

from harness.trials.block_store.measure import median_ratio, paired_ratio, summary


def write_amp_checks(out: dict, layouts: list[str]) -> dict:
    rows = [r for r in out["rows"] if r["measured"]]
    c: dict = {"write_turns_cached": all(r["cached_tokens"] >= r["prev_prompt_tokens"] for r in rows) and bool(rows)}
    for lay in layouts:
        mine = [r for r in rows if r["layout"] == lay]
        s = summary([r["amplification"] for r in mine])
        c[f"write_amp_{lay}_max"], c[f"write_amp_{lay}_mean"] = s["max"], s["mean"]
        added = sum(r["added_bytes"] for r in mine)
        c[f"write_amp_{lay}_total"] = sum(r["written_bytes"] for r in mine) / added if added else None
        c[f"write_mb_per_turn_{lay}"] = (sum(r["written_bytes"] for r in mine) / len(mine) / 1e6) if mine else None
    return c


def shared_prompt_checks(out: dict, layouts: list[str]) -> dict:
    c = {"shared_tokens": out["shared_tokens"], "shared_full_block_tokens": out.get("shared_full_block_tokens")}
    for lay in layouts:
        d = out["disk"][lay]
        c[f"disk_over_ideal_{lay}"] = d["over_ideal"]
        c[f"disk_over_full_block_ideal_{lay}"] = d.get("over_full_block_ideal")
        c[f"disk_mb_{lay}"] = d["bytes"] / 1e6
        c[f"disk_quarantine_bytes_{lay}"] = d["quarantine_bytes"]
    c["disk_ideal_mb"] = out["disk"][layouts[0]]["ideal_bytes"] / 1e6
    return c


def restart_checks(out: dict, layouts: list[str]) -> dict:
    cand, base = layouts
    rows = out["rows"]
    c: dict = {"restart_resumes_from_disk": all(r["cached_tokens"] >= r["prev_prompt_tokens"] for r in rows)
               and bool(rows)}
    ratios = []
    for size in out["sizes"]:
        # each layout's turns in rep order: rep i of one layout beside rep i of the other
        ttft = {lay: [r["ttft_s"] for r in sorted(rows, key=lambda r: r["rep"]) if r["layout"] == lay
                      and r["size"] == size] for lay in layouts}
        for lay in layouts:
            c[f"restart_ttft_{lay}_{size}_s"] = summary(ttft[lay])["median"]
        ratio = paired_ratio(ttft[cand], ttft[base])
        c[f"restart_{cand}_over_{base}_{size}"] = ratio
        c[f"restart_{cand}_over_{base}_{size}_of_medians"] = median_ratio(ttft[cand], ttft[base])
        ratios.append(ratio)
        c[f"restart_{size}_tokens"] = max(r["prompt_tokens"] for r in rows if r["size"] == size)
    c[f"restart_{cand}_over_{base}"] = max(ratios)
    return c


def beside_checks(out: dict, layouts: list[str]) -> dict:
    rows = out["rows"]
    a_turns = [r[k] for r in rows for k in ("quiet", "beside")]
    c: dict = {"foreground_cached_share": min(t["cached_tokens"] / t["prompt_tokens"] for t in a_turns),
               "foreground_tokens": max(t["prompt_tokens"] for t in a_turns)}
    for lay in layouts:
        mine = [r for r in rows if r["layout"] == lay]
        for what, key in (("total_s", ""), ("ttft_s", "_ttft")):   # each rep's beside turn over its quiet twin
            c[f"beside_over_quiet_{lay}{key}"] = paired_ratio([r["beside"][what] for r in mine],
                                                               [r["quiet"][what] for r in mine])
        c[f"beside_overlapped_{lay}"] = sum(r["written_during_beside"] > 0 for r in mine) / len(mine)
        c[f"quiet_turn_{lay}_s"] = summary([r["quiet"]["total_s"] for r in mine])["median"]
    return c


def replies_differing(out: dict, layouts: list[str]) -> tuple[int, list[dict]]:
    """Turns whose reply differs between the layouts: the same prompts, greedy, so the same text."""
    keyed = {
        "write_amp": lambda r: (r["turn"],),
        "shared_prompt": lambda r: (r["agent"],),
        "restart": lambda r: (r["size"], r["rep"]),
    }
    groups: dict = defaultdict(dict)
    for phase, key in keyed.items():
        for r in (out.get(phase) or {}).get("rows", []):
            groups[(phase, *key(r))][r["layout"]] = r["text"]
    for r in (out.get("beside_save") or {}).get("rows", []):
        for k in ("quiet", "saver", "beside"):
            groups[("beside_save", k, r["rep"])][r["layout"]] = r[k]["text"]
    diff = [{"turn": list(k), "texts": v} for k, v in groups.items() if len(set(v.values())) > 1]
    return len(diff), diff


PHASE_CHECKS = {"write_amp": write_amp_checks, "shared_prompt": shared_prompt_checks,
                "restart": restart_checks, "beside_save": beside_checks}


def all_checks(out: dict, layouts: list[str]) -> dict:
    """Every check of the phases that ran, and the replies that differ between layouts."""
    c: dict = {}
    for phase, fn in PHASE_CHECKS.items():
        if out.get(phase):
            c.update(fn(out[phase], layouts))
    c["replies_differing"], _ = replies_differing(out, layouts)
    c["phases_failed"] = len(out.get("failed", []))
    return c
