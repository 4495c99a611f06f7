"""EXP-020's checks from the recorded rows, its metrics, and the README a run writes. Pure: rows in, numbers out.

Every ratio is the median over reps of each rep's pair (both sides measured next to each other in one run),
never a ratio of medians of separate sets."""

from __future__ import annotations

from harness.common.report import fmt, median, verdict_table
from harness.trials.real_geometry.models import GEOMETRIES

GOAL_RESTORE_FROM = 32768       # restore goals from this length on
# the cached turn's goal at these lengths: 16K, 32K and 128K (or 128K less a block, where the context is 131072)
GOAL_CACHED_AT = (16384, 32768, 130816, 131072)
# a fully cached turn's goal over one decode step: attention models, and hybrids (``models.GEOMETRIES``'s
# "hybrid"), whose turn resumes from a snapshot a few tokens back and prefills those
CACHED_GOAL = {"attention": 1.5, "hybrid": 2.0}


def cached_goal(geometry: str) -> float:
    return CACHED_GOAL["hybrid" if GEOMETRIES.get(geometry, {}).get("hybrid") else "attention"]


def _ok(t: dict | None) -> bool:
    return bool(t) and t.get("status") == 200


def _pairs(rows, a, b) -> list[float]:
    """a(row) / b(row) for each row where both are numbers (b > 0)."""
    out = []
    for r in rows:
        x, y = a(r), b(r)
        if isinstance(x, (int, float)) and isinstance(y, (int, float)) and y > 0:
            out.append(x / y)
    return out


def _s(t: dict | None):
    return t["s"] if _ok(t) else None


def length_checks(d: dict) -> dict:
    """The numbers of one geometry at one length."""
    c: dict = {"tokens": d["tokens"], "cache_bytes": d["cache_bytes"]}
    if "skipped" in d:
        c["skipped"] = d["skipped"]
        return c
    saves = (d.get("saves") or {}).get("rows", [])
    c["save_s"] = median([r["ours"]["s"] for r in saves])
    c["save_bytes"] = median([r["ours"]["bytes"] for r in saves])
    c["floor_write_s"] = median([r["floor_write"]["s"] for r in saves])
    c["mlx_save_s"] = median([r["mlx_lm"]["s"] for r in saves])
    c["mlx_save_fsync_s"] = median([r["mlx_lm"]["s_fsync"] for r in saves])
    c["save_speed_over_floor"] = median(_pairs(saves, lambda r: r["floor_write"]["s"], lambda r: r["ours"]["s"]))
    c["save_over_mlx_fsync"] = median(_pairs(saves, lambda r: r["ours"]["s"], lambda r: r["mlx_lm"]["s_fsync"]))
    loads = (d.get("loads") or {}).get("rows", [])
    for mode in ("cold", "warm"):
        rows = [r for r in loads if r["mode"] == mode]
        if not rows:
            continue
        c[f"load_{mode}_ours_s"] = median([r["ours"]["s"] for r in rows])
        c[f"load_{mode}_ours_blocks_s"] = median([r["ours"]["load_s"] for r in rows])
        c[f"load_{mode}_mlx_s"] = median([r["mlx_lm"]["s"] for r in rows])
        c[f"load_{mode}_floor_s"] = median([r["floor_read"]["s"] for r in rows])
        c[f"load_{mode}_ours_over_mlx"] = median(_pairs(rows, lambda r: r["ours"]["s"], lambda r: r["mlx_lm"]["s"]))
        c[f"load_{mode}_ours_blocks_over_mlx"] = median(_pairs(rows, lambda r: r["ours"]["load_s"],
                                                               lambda r: r["mlx_lm"]["s"]))
        c[f"load_{mode}_whole"] = all(r["ours"]["whole"] for r in rows)
    dflt = d.get("default")
    if dflt:
        c["default_status"] = dflt.get("status")
        c["default_message"] = (dflt.get("error") or "")[:300] or None
        c["default_cached_tokens"] = dflt.get("cached_tokens")
        c["default_s"] = dflt.get("s")
        c["default_budget_bytes"] = dflt.get("budget_bytes")
        c["default_rss_max_bytes"] = dflt.get("rss_max_bytes")
        if dflt.get("status") == 200 and dflt.get("budget_bytes") and dflt.get("rss_max_bytes"):
            c["default_rss_over_budget"] = dflt["rss_max_bytes"] / dflt["budget_bytes"]
    srv = d.get("server") or {}
    c.update(_server_checks(srv))
    # a restore's peak: the restarted server's RSS during the turn that reads the agent, above its RSS just before
    peaks = [(r["rss"]["peak"] - r["rss"]["before"]) / d["cache_bytes"] for r in srv.get("restore", [])
             if _ok(r["turn"]) and (r.get("rss") or {}).get("peak") and r["rss"].get("before")]
    c["restore_peak_over_cache"] = max(peaks) if peaks else None
    return c


def _server_checks(srv: dict) -> dict:
    c: dict = {}
    cold = [r for r in srv.get("restore", []) if r["cold"]]
    warm = [r for r in srv.get("restore", []) if not r["cold"]]
    c["restore_cold_s"] = median([_s(r["turn"]) for r in cold])
    c["restore_cold_floor_s"] = median([r["floor_read"]["s"] for r in cold])
    c["restore_cold_over_floor"] = median(_pairs(cold, lambda r: r["floor_read"]["s"], lambda r: _s(r["turn"])))
    c["restore_bytes"] = median([r["bytes"] for r in srv.get("restore", [])])
    c["restore_warm_s"] = median([_s(r["turn"]) for r in warm])
    c["restore_warm_memcpy_s"] = median([r["memcpy"]["s"] for r in warm])
    c["restore_warm_read_s"] = median([r["floor_read"]["s"] for r in warm])
    c["restore_warm_over_memcpy"] = median(_pairs(warm, lambda r: r["memcpy"]["s"], lambda r: _s(r["turn"])))
    cached = srv.get("cached", [])
    c["cached_turn_s"] = median([_s(r["one"]) for r in cached])
    c["decode_step_s"] = median([r["decode_step_s"] for r in cached])
    c["cached_over_decode"] = median(_pairs(cached, lambda r: _s(r["one"]), lambda r: r["decode_step_s"]))
    # the restore's own share: the cold turn less the resident cached turn (the same last-token forward)
    if c["restore_cold_s"] is not None and c["cached_turn_s"] is not None and c["restore_cold_floor_s"]:
        c["restore_cold_own_s"] = c["restore_cold_s"] - c["cached_turn_s"]
        c["restore_cold_own_over_floor"] = (c["restore_cold_floor_s"] / c["restore_cold_own_s"]
                                            if c["restore_cold_own_s"] > 0 else None)
        # the most a restore that overlapped its reads with the forward could reach end to end: the turn
        # lasts at least the read and at least the forward (the cached turn), whichever is longer
        c["restore_cold_bound"] = c["restore_cold_floor_s"] / max(c["restore_cold_floor_s"], c["cached_turn_s"])
    beside = srv.get("beside", [])
    c["quiet_turn_s"] = median([_s(r["quiet"]["turn"]) for r in beside])
    c["beside_turn_s"] = median([_s(r["beside"]["turn"]) for r in beside])
    c["beside_over_quiet"] = median(_pairs(beside, lambda r: _s(r["beside"]["turn"]), lambda r: _s(r["quiet"]["turn"])))
    c["beside_saved"] = sum((r["beside"]["other"] or {}).get("cache_save") in ("pending", "saved") for r in beside)
    lives = srv.get("lives", [])
    budgets = [lv.get("budget_bytes") for lv in lives if lv.get("budget_bytes")]
    c["budget_bytes"] = max(budgets) if budgets else None
    rss = (srv.get("rss") or {}).get("max_bytes")
    c["rss_max_bytes"] = rss
    c["rss_over_budget"] = rss / c["budget_bytes"] if rss and c["budget_bytes"] else None
    c["rss_idle_bytes"] = ((srv.get("rss") or {}).get("max_by_phase") or {}).get("start")
    c["start_s"] = median([lv["start_s"] for lv in lives])
    c["pool_mb"] = int(srv["args"][1]) if srv.get("args") else None
    return c


def measured_turns(srv: dict) -> list[tuple[str, dict]]:
    """Every turn of the agent the sized server answered (what a check of cached tokens reads)."""
    out = [("first", srv.get("first")), ("cached-first", srv.get("cached_first"))]
    out += [("restore", r["turn"]) for r in srv.get("restore", [])]
    out += [(k, r[k]) for r in srv.get("cached", []) for k in ("one", "more")]
    out += [(f"{k}-turn", r[k]["turn"]) for r in srv.get("beside", []) for k in ("quiet", "beside")]
    return [(k, t) for k, t in out if t is not None]


def checks(out: dict) -> dict:
    c: dict = {"parts_failed": len(out.get("failed") or []), "lengths_skipped": len(out.get("skipped") or [])}
    per: dict = {}
    missing = errors = run = 0
    for g, geo in (out.get("geometries") or {}).items():
        for lab, d in geo["lengths"].items():
            key = f"{g}@{lab}"
            per[key] = length_checks(d)
            if "skipped" in d:
                continue
            run += 1
            for _kind, t in measured_turns(d.get("server") or {}):
                if not _ok(t):
                    errors += 1
                elif (t.get("cached_tokens") or 0) < d["tokens"]:
                    missing += 1
    c["lengths_run"] = run
    c["measured_turn_errors"] = errors
    c["measured_turns_missing_cache"] = missing
    for key, pc in per.items():
        for k, v in pc.items():
            c[f"{key}.{k}"] = v

    # the restore goals are an attention model's (its cache is its K/V alone); a hybrid's figures are its own:
    # its turn computes a new recurrent state beside the snapshot it resumed from, which the pool keeps
    attention = {g for g in (out.get("geometries") or {}) if not GEOMETRIES.get(g, {}).get("hybrid")}

    def pick(field, pred=lambda n: True, hybrid=None):
        """``field`` of every length that ``pred`` takes (of the hybrids alone, or of the attention models alone)."""
        return [pc[field] for key, pc in per.items() if pc.get(field) is not None and pred(pc["tokens"])
                and (hybrid is None or (key.split("@")[0] not in attention) == hybrid)]

    def lo(xs):
        return min(xs) if xs else None

    def hi(xs):
        return max(xs) if xs else None

    at_goal = lambda n: n >= GOAL_RESTORE_FROM  # noqa: E731
    c["restore_cold_over_floor_min"] = lo(pick("restore_cold_over_floor", at_goal, hybrid=False))
    c["restore_cold_bound_min"] = lo(pick("restore_cold_bound", at_goal, hybrid=False))
    c["restore_peak_over_cache_max"] = hi(pick("restore_peak_over_cache", at_goal, hybrid=False))
    c["hybrid_restore_cold_over_floor_min"] = lo(pick("restore_cold_over_floor", at_goal, hybrid=True))
    c["hybrid_restore_cold_bound_min"] = lo(pick("restore_cold_bound", at_goal, hybrid=True))
    c["hybrid_restore_peak_over_cache_max"] = hi(pick("restore_peak_over_cache", at_goal, hybrid=True))
    c["restore_warm_over_memcpy_min"] = lo(pick("restore_warm_over_memcpy", at_goal))
    c["cached_over_decode_max"] = hi(pick("cached_over_decode", lambda n: n in GOAL_CACHED_AT))
    c["cached_over_goal_max"] = hi([pc["cached_over_decode"] / cached_goal(key.split("@")[0]) for key, pc in per.items()
                                    if pc.get("cached_over_decode") is not None and pc["tokens"] in GOAL_CACHED_AT])
    c["beside_over_quiet_max"] = hi(pick("beside_over_quiet"))
    c["rss_over_budget_max"] = hi(pick("rss_over_budget") + pick("default_rss_over_budget"))
    c["load_cold_ours_over_mlx_max"] = hi(pick("load_cold_ours_over_mlx"))
    c["load_warm_ours_over_mlx_max"] = hi(pick("load_warm_ours_over_mlx"))
    c["save_speed_over_floor_min"] = lo(pick("save_speed_over_floor"))
    c["loads_whole"] = all(pc.get("load_cold_whole", True) for pc in per.values())
    c["default_served"] = sum(pc.get("default_status") == 200 for pc in per.values())
    c["default_refused"] = sum(pc.get("default_status") not in (None, 200) for pc in per.values())
    c.update(fleet_checks(out))
    return c


def fleet_checks(out: dict) -> dict:
    """The no-flag fleets (``serving.fleet``): turns refused or failed, turns that missed the agent's cache,
    and the largest RSS sample over the budget the server logged."""
    c: dict = {"fleets_run": 0, "fleet_turns_bad": 0, "fleet_rss_over_budget_max": None}
    ratios = []
    for g, geo in (out.get("geometries") or {}).items():
        for lab, d in (geo.get("fleets") or {}).items():
            if "skipped" in d:
                continue
            c["fleets_run"] += 1
            bad = [t for t in d.get("turns", []) if not _ok(t) or (t.get("cached_tokens") or 0) < d["tokens"]]
            c["fleet_turns_bad"] += len(bad) + (len(d.get("turns", [])) < 2 * d["agents"])
            c[f"{g}@{lab}.rss_over_budget_max"] = d.get("rss_over_budget_max")
            c[f"{g}@{lab}.longest_cache_tokens"] = d.get("longest_cache_tokens")
            if d.get("rss_over_budget_max") is not None:
                ratios.append(d["rss_over_budget_max"])
    c["fleet_rss_over_budget_max"] = max(ratios) if ratios else None
    return c


def metrics(out: dict) -> dict:
    """name -> (samples, unit, description): every rep's own numbers, per geometry and length."""
    m: dict = {}
    for g, geo in (out.get("geometries") or {}).items():
        for lab, d in geo["lengths"].items():
            srv = d.get("server") or {}
            key = f"{g}_{lab}"
            cold = [r for r in srv.get("restore", []) if r["cold"] and _ok(r["turn"])]
            warm = [r for r in srv.get("restore", []) if not r["cold"] and _ok(r["turn"])]
            rows = {
                f"restore_cold_{key}": ([r["turn"]["s"] for r in cold], "s", "turn after a restart, page cache dropped"),
                f"floor_read_cold_{key}": ([r["floor_read"]["s"] for r in cold], "s", "sequential read, page cache dropped"),
                f"restore_warm_{key}": ([r["turn"]["s"] for r in warm], "s", "turn after a restart, page cache warm"),
                f"memcpy_{key}": ([r["memcpy"]["s"] for r in warm], "s", "memcpy of the agent's bytes"),
                f"cached_turn_{key}": ([r["one"]["s"] for r in srv.get("cached", []) if _ok(r["one"])], "s",
                                       "fully cached turn, max_tokens 1"),
                f"decode_step_{key}": ([r["decode_step_s"] for r in srv.get("cached", []) if r["decode_step_s"]], "s",
                                       "one decode step at this context, from the client"),
                f"save_{key}": ([r["ours"]["s"] for r in (d.get("saves") or {}).get("rows", [])], "s",
                                "our store's save (fsynced)"),
            }
            for name, v in rows.items():
                if v[0]:
                    m[name] = v
    return m


def _gb(v) -> str:
    return "-" if v is None else f"{v / 1e9:.2f}"


def _mb(v) -> str:
    return "-" if v is None else f"{v / 2**20:.0f}"


def _rate(nbytes, s) -> str:
    return "-" if not nbytes or not s else f"{nbytes / s / 1e9:.2f}"


def _table(head: list[str], rows: list[list]) -> str:
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
                      *("| " + " | ".join(fmt(x) if not isinstance(x, str) else x for x in r) + " |" for r in rows)])


def _fleets(out: dict) -> tuple[list[list], str]:
    """The no-flag fleets' table rows (each turn: phase and agent, status, cached tokens, seconds) and their
    servers' budget lines."""
    run = [(g, lab, d) for g, geo in (out.get("geometries") or {}).items()
           for lab, d in (geo.get("fleets") or {}).items() if "skipped" not in d]
    rows = [[g, lab, _gb(d.get("cache_bytes")), " / ".join(
                f"{t['phase'][0]}{t['agent'].split('-')[-1]}: {t.get('status')} {fmt(t.get('cached_tokens'))} {fmt(t.get('s'))} s"
                for t in d.get("turns", [])), fmt(d.get("longest_cache_tokens")), _mb(d.get("budget_bytes")),
             _mb(d.get("rss_max_bytes")), fmt(d.get("rss_over_budget_max")),
             fmt((d.get("in_place") or {}).get("lent_turns")), fmt((d.get("in_place") or {}).get("copied_turns"))]
            for g, lab, d in run]
    lines = "\n".join(f"- {g} {lab}: " + " / ".join(f"`{ln.split(' INFO ')[-1][:220]}`" for ln in d.get("log_lines", []))
                      for g, lab, d in run)
    return rows, lines


def readme(ctx, out: dict, c: dict) -> str:
    verdicts = ctx.results.evaluate()
    doc = ctx.results.doc
    mach = out.get("machine") or {}
    keys = [(g, lab, geo, d) for g, geo in (out.get("geometries") or {}).items() for lab, d in geo["lengths"].items()]

    def k(g, lab, f):
        return c.get(f"{g}@{lab}.{f}")

    geo_rows = [[g, geo["real"], ", ".join(f"{n} {kind}" for kind, n in geo["spec"]["kinds"].items()),
                 f"{geo['kv_bytes_per_token'] / 1024:.0f}", ", ".join(f"{lab}: {_gb(d['cache_bytes'])}"
                                                                  for lab, d in geo["lengths"].items())]
                for g, geo in (out.get("geometries") or {}).items()]
    run = [(g, lab, geo, d) for g, lab, geo, d in keys if "skipped" not in d]
    full = [(g, lab, geo, d) for g, lab, geo, d in run if not d.get("restores_only")]  # every phase ran
    restores_only = "".join(f"; {g} at {label(n)}: its restores alone" for g, n in ctx.params.get("restores") or [])
    dflt = [[g, lab, fmt(k(g, lab, "default_status")), fmt(k(g, lab, "default_cached_tokens")),
             fmt(k(g, lab, "default_s")), _mb(k(g, lab, "default_budget_bytes")), _mb(k(g, lab, "default_rss_max_bytes")),
             (k(g, lab, "default_message") or "").replace("|", "/")[:220]] for g, lab, _, _ in full]
    cold = [[g, lab, _gb(k(g, lab, "restore_bytes")), k(g, lab, "restore_cold_s"), k(g, lab, "restore_cold_floor_s"),
             _rate(k(g, lab, "restore_bytes"), k(g, lab, "restore_cold_s")),
             _rate(k(g, lab, "restore_bytes"), k(g, lab, "restore_cold_floor_s")), k(g, lab, "restore_cold_over_floor"),
             k(g, lab, "restore_cold_own_over_floor"), k(g, lab, "restore_cold_bound"),
             k(g, lab, "restore_peak_over_cache")] for g, lab, _, _ in run]
    warm = [[g, lab, k(g, lab, "restore_warm_s"), k(g, lab, "restore_warm_memcpy_s"), k(g, lab, "restore_warm_read_s"),
             k(g, lab, "restore_warm_over_memcpy")] for g, lab, _, _ in run]
    save = [[g, lab, _gb(k(g, lab, "save_bytes")), k(g, lab, "save_s"), k(g, lab, "floor_write_s"),
             _rate(k(g, lab, "save_bytes"), k(g, lab, "save_s")), _rate(k(g, lab, "save_bytes"), k(g, lab, "floor_write_s")),
             k(g, lab, "save_speed_over_floor"), k(g, lab, "mlx_save_s"), k(g, lab, "mlx_save_fsync_s")]
            for g, lab, _, _ in full]
    cached = [[g, lab, k(g, lab, "cached_turn_s"), k(g, lab, "decode_step_s"), k(g, lab, "cached_over_decode")]
              for g, lab, _, _ in run]
    beside = [[g, lab, k(g, lab, "quiet_turn_s"), k(g, lab, "beside_turn_s"), k(g, lab, "beside_over_quiet"),
               fmt(k(g, lab, "beside_saved"))] for g, lab, _, _ in full]
    rss = [[g, lab, fmt(k(g, lab, "pool_mb")), _mb(k(g, lab, "budget_bytes")), _mb(k(g, lab, "rss_idle_bytes")),
            _mb(k(g, lab, "rss_max_bytes")), k(g, lab, "rss_over_budget")] for g, lab, _, _ in run]
    loads = [[g, lab, k(g, lab, "load_cold_ours_blocks_s"), k(g, lab, "load_cold_ours_s"), k(g, lab, "load_cold_mlx_s"),
              k(g, lab, "load_cold_floor_s"), k(g, lab, "load_cold_ours_over_mlx"), k(g, lab, "load_warm_ours_s"),
              k(g, lab, "load_warm_mlx_s"), k(g, lab, "load_warm_ours_over_mlx")] for g, lab, _, _ in full]
    budget_lines = "\n".join(f"- {g} {lab}: " + " / ".join(f"`{ln.split(' INFO ')[-1][:160]}`" for ln in
                                                          ((d.get("server") or {}).get("lives") or [{}])[0].get("log_lines", []))
                             for g, lab, _, d in run)
    default_lines = "\n".join(f"- {g} {lab}: " + " / ".join(f"`{ln.split(' INFO ')[-1][:160]}`"
                                                            for ln in (d.get("default") or {}).get("log_lines", []))
                              for g, lab, _, d in run if d.get("default"))
    fleets, fleet_lines = _fleets(out)
    skipped = "\n".join(f"- {s['part']}: {s['why']}" for s in out.get("skipped") or []) or "none"
    failed = "\n".join(f"- {f['part']}: `{f['error'].strip().splitlines()[-1][:300]}`" for f in out.get("failed") or []) or "none"
    return f"""# EXP-020: the models and contexts users run, at real geometry and real lengths

`make exp-020` (quick) / `make exp-020-full` (`harness run experiments/exp_020_real_geometry.toml`); see
`harness/trials/real_geometry/trial.py`. This file is written by the run. Latest run: `{doc['run_id']}`
({doc['created_at'][:19]} UTC), results `{doc['run_id']}.json`; wall time {(out.get('wall_s') or 0) / 60:.1f} min
({'quick' if ctx.config.quick else 'full'}: {', '.join(ctx.params['geometries'])} at {', '.join(label(n) for n in ctx.params['lengths'])}{restores_only}).

Tiny-body random bfloat16 models whose caches have the real models' bytes (`harness/trials/real_geometry/models.py`);
each agent's cache written synthetically through our store (random K/V of the real shapes), the server started
on that directory and sent the agent's ids plus {ctx.params['new_tokens']} new ones as a completions prompt. Every
ratio is the median over reps of each rep's pair, both sides measured beside each other in this run; server
turns are timed at the client (`max_tokens` 1, not streamed: the turn's whole time is its time to first token).

Machine: {mach.get('cpu_count')} CPUs, memcpy {fmt(mach.get('memcpy_gb_s'))} GB/s into touched memory,
{fmt(mach.get('memcpy_fresh_gb_s'))} GB/s into fresh memory (page faults), {_gb(mach.get('mem_available_bytes_at_start'))} GB
available at start. The floors below (disk read and write) are measured beside each measurement.

## Geometries

{_table(['geometry', 'stands for', 'layers', 'KV KiB/token (real)', 'agent cache GB per length'], geo_rows)}

## A server with no pool flags (today: a fixed {1024} MB pool)

{_table(['geometry', 'length', 'status', 'cached tokens', 'turn s', 'budget MiB (its log)', 'RSS max MiB', 'message'], dflt)}

Its budget lines:
{default_lines or 'none'}

## Fleets on a server with no pool flags: each agent restored from disk (r), then resumed (a)

Each agent's turn after the server started on their directory, then each one's next turn; each turn: status,
cached tokens, seconds at the client. RSS sampled every 100 ms against the budget the server logged.

{_table(['geometry', 'agents', 'KV GB', 'turns', 'longest cache (server)', 'budget MiB', 'RSS max MiB', 'RSS max / budget', 'lent turns', 'copied turns'], fleets)}

Their budget lines:
{fleet_lines or 'none'}

## Restore from disk (page cache dropped) against a sequential read of the same files

The goals (a restore at 0.8 of the read, its peak at most 1.1x the cache, from 32K on) are an attention
model's. A hybrid's turn also computes a new recurrent state beside the snapshot it resumed from (the pool
keeps that one: where a regenerate of the turn resumes), so its peak holds one state more than its cache.

{_table(['geometry', 'length', 'GB', 'turn s', 'read s', 'restore GB/s', 'read GB/s', 'read s / turn s', 'read s / (turn - cached turn) s', 'read s / max(read, cached turn) s: the most an overlapped restore reaches', 'RSS peak above the server before it / cache bytes (cold or warm, the worst)'], cold)}

## Restore from RAM (page cache warm) against a memcpy of the same bytes

{_table(['geometry', 'length', 'turn s', 'memcpy s', 'read from page cache s', 'memcpy s / turn s'], warm)}

## Save (in process, `AgentCacheStore.save`, fsynced) against an fsync'd sequential write of the same bytes

{_table(['geometry', 'length', 'GB', 'ours s', 'write s', 'ours GB/s', 'write GB/s', 'ours speed / write speed', 'mlx-lm save s', 'mlx-lm save + fsync s'], save)}

## A fully cached turn against one decode step at that context

{_table(['geometry', 'length', 'cached turn s', 'decode step s', 'cached turn / decode step'], cached)}

## A cached turn right after another agent's saved turn against its quiet twin

{_table(['geometry', 'length', 'quiet s', 'beside a save s', 'beside / quiet', 'other turns saved'], beside)}

## The sized server's resident set (every 100 ms) against the budget it logged

{_table(['geometry', 'length', '--pool-mb', 'budget MiB', 'RSS started, idle MiB', 'RSS max MiB', 'RSS max / budget'], rss)}

Its budget lines:
{budget_lines or 'none'}

## Our restore against mlx-lm's `load_prompt_cache` (in process, checksums verified)

{_table(['geometry', 'length', 'ours: blocks loaded s', 'ours: + live caches s', 'mlx-lm s', 'read floor s', 'ours / mlx-lm', 'warm: ours s', 'warm: mlx-lm s', 'warm: ours / mlx-lm'], loads)}

`mlx_lm.server` is not run: it keeps prompt caches in memory only, so it has no restore to compare, and
its prefill of these lengths on this CPU is what the synthetic caches avoid.

Skipped: {skipped}

Failed: {failed}

{verdict_table(verdicts)}
"""


def label(n: int) -> str:
    """A length as the tables write it: 8K, 128K."""
    return f"{round(n / 1024)}K"
