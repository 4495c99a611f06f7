"""What a soak's record says against each goal: its checks, one function per thing judged.

Each reads the :class:`~harness.trials.chaos.ledger.Ledger` and what the kind gathered at the end of the run
(``out``: the quarantine folder, the last life, the server's final stats, the filesystem phases).
:func:`checks` puts them together in the order the results document has always listed them.
"""

from __future__ import annotations

from harness.trials.chaos.injector import quarantined_count, quarantined_names
from harness.trials.chaos.ledger import Ledger

FAULTS = ("sigkill", "sigterm", "corrupt", "disk_full_start", "read_only_start", "hangup", "flood")


def checks(ledger: Ledger, out: dict, rss_baseline_turns: int) -> tuple[dict, list[str]]:
    """Every check of the run, and the corrupted files that should have been quarantined and were not."""
    events = ledger.events
    starts = [e for e in events if e["kind"] in ("start", "restart")]
    quarantine, not_quarantined = _quarantine(ledger, out)
    return {
        **ledger.summary(),   # outcomes and failures (5xx, hangs, ...), durable turns, re-checked replies
        **_lives(events, starts), **quarantine, **_cache_reports(ledger),
        **rss_checks(ledger.rss, out.get("last_life", -1), rss_baseline_turns, out.get("rss_end_bytes")),
        **_disk_full(ledger, out["phases"], starts), **_run_itself(events, starts, out),
    }, not_quarantined


def answered_turns(requests: list[dict]) -> list[dict]:
    """The agents' turns that were answered (200)."""
    return [r for r in requests if r.get("kind") == "turn" and r["outcome"] == "ok"]


def _lives(events: list[dict], starts: list[dict]) -> dict:
    """The faults dealt, and how the lives began and ended: writers' temporaries left, a clean shutdown."""
    kinds = [e["kind"] for e in events]
    faults = {k: kinds.count(k) for k in FAULTS}
    shutdown = next((e for e in events if e["kind"] == "shutdown"), {})
    temp_left = sum(len(e.get("temp_files") or []) for e in starts) + len(shutdown.get("temp_files") or [])
    return {"crashes": faults["sigkill"] + faults["sigterm"], **{f"faults_{k}": v for k, v in faults.items()},
            "temp_files_left": temp_left, "clean_shutdown": bool(shutdown.get("clean"))}


def _quarantine(ledger: Ledger, out: dict) -> tuple[dict, list[str]]:
    """The damaged files against those set aside, and those the server says it set aside."""
    events = ledger.events
    corrupt = [e for e in events if e["kind"] == "corrupt" and e.get("file")]
    qdir = out.get("quarantine_dir", [])
    came_back = [(r["agent"], r["t"]) for r in ledger.resumptions if r["verdict"] in COME_BACK]
    refused = {f for e in events if e["kind"] in ("sigkill", "sigterm") for f in e.get("refused_files") or []}
    refused |= set(quarantined_names(out.get("final_stats")))
    set_aside = [e for e in corrupt if e["file"] in refused or any(q.startswith(e["file"] + ".") for q in qdir)]
    due = [e for e in corrupt if must_be_found(e, came_back)]
    not_quarantined = [e["file"] for e in due if e not in set_aside]
    reported = sum(e.get("quarantined_this_life") or 0 for e in events if e["kind"] in ("sigkill", "sigterm"))
    kinds = [e.get("kind_of_file", "file") for e in corrupt]
    return {"corrupted_files": len(corrupt), "corrupted_manifests": kinds.count("manifest"),
            "corrupted_block_files": kinds.count("block"),
            "corrupted_shared_block_files": sum(1 for e in corrupt if e.get("kind_of_file") == "block"
                                                and e.get("shared")),
            "quarantined_files": len(qdir), "corruptions_quarantined": len(set_aside),
            "corruptions_not_quarantined": len(not_quarantined),
            "corruptions_unread": sum(1 for e in corrupt if e not in set_aside and e not in due),
            "quarantined_reported": reported + (quarantined_count(out.get("final_stats")) or 0)}, not_quarantined


COME_BACK = ("excused_corrupt", "excused_rebuilt", "corrupt_served")


def must_be_found(e: dict, came_back: list[tuple[str, float]]) -> bool:
    """Whether the server must have set the damaged file of corrupt event ``e`` aside by the end.

    The next start scans every manifest and every block file's header: a damaged manifest, a truncated
    block file, or one whose header was hit is found then. A block file whose tensors alone were hit is
    found when a load reads it: surely when the one agent that uses it came back after the damage
    (``came_back``: (agent, time) of the resumptions a damage excused; nothing else can hold its
    blocks), not when it is shared (a load takes no block the pool holds from disk). A cache file of
    the single-file layout is found when its agent comes back.
    """
    kind = e.get("kind_of_file", "file")
    if kind == "manifest" or kind == "block" and (e.get("mode") == "truncate" or e.get("region") == "header"):
        return True
    if kind == "block" and e.get("shared"):
        return False
    agents = set(e.get("agents") or [e.get("agent")])
    return any(a in agents and t > e["t"] for a, t in came_back)


def _cache_reports(ledger: Ledger) -> dict:
    """What replies said their cache did: a named reply's save state (usage agreeing with the header), and
    an anonymous re-send under a fresh salt neither saving nor finding anything cached."""
    turns = answered_turns(ledger.requests)
    save_states = {}
    for r in turns:
        if r.get("usage_asked") or not r.get("stream"):
            k = r.get("cache_save") or r.get("header_save") or "missing"
            save_states[k] = save_states.get(k, 0) + 1
    header_mismatch = sum(1 for r in turns if r.get("cache_save") and r.get("header_save")
                          and r["cache_save"] != r["header_save"])
    return {"cache_save_states": save_states, "cache_save_missing": save_states.get("missing", 0),
            "cache_save_header_mismatch": header_mismatch,
            "anonymous_with_cache_save": sum(1 for c in ledger.checks if c.get("anonymous_cache_save")),
            "salt_reused_cache": sum(1 for c in ledger.checks if (c.get("cached_tokens") or 0) > 0)}


def rss_checks(rss: list, last_life: int, baseline_turns: int, end_bytes: int | None) -> dict:
    """The last life's RSS once it had answered ``baseline_turns`` turns against its RSS at the end."""
    last = [r for r in rss if r[1] == last_life]
    base = next((r for r in last if r[2] >= baseline_turns), None)
    end = end_bytes or (last[-1][3] if last else None)
    return {"rss_baseline_bytes": base[3] if base else None, "rss_baseline_turns": base[2] if base else None,
            "rss_end_bytes": end, "rss_end_over_baseline": end / base[3] if base and end else None,
            "rss_max_bytes": max((r[3] for r in rss), default=None),
            "rss_max_last_life_bytes": max((r[3] for r in last), default=None)}


def _disk_full(ledger: Ledger, phases: list[dict], starts: list[dict]) -> dict:
    """While the disk was full: every turn answered, resident bytes within the budget; after it, what was
    saved before it still loads."""
    disk_full = [ph for ph in phases if ph["kind"] == "disk_full"]
    # the life each disk-full phase's SIGKILL led to: its resumptions load what was saved before the disk filled
    lives_after = {next((e["life"] for e in starts if e["t"] >= ph["t1"]), None) for ph in disk_full}
    after_full = [r for r in ledger.resumptions if r["life"] in lives_after]
    return {
        "disk_full_phases": len(disk_full),
        "disk_full_all_answered": bool(disk_full) and all(set(ph["outcomes"]) <= {"ok", "refused_429"}
                                                          for ph in disk_full),
        "disk_full_saves_failed": sum(ph["cache_save"].get("failed", 0) for ph in disk_full),
        "disk_full_ram_within_budget": bool(disk_full) and all(ph["ram_within_budget"] for ph in disk_full),
        "disk_full_resumptions_kept": sum(1 for r in after_full if r["verdict"] == "kept"),
        "disk_full_resumptions_lost": sum(1 for r in after_full if r["verdict"] == "lost"),
    }


def _run_itself(events: list[dict], starts: list[dict], out: dict) -> dict:
    """How the run itself went: the harness's own errors, faults it skipped, agents that would not stop,
    the slowest server start."""
    return {"harness_errors": sum(1 for e in events if e["kind"] == "harness_error"),
            "skipped_faults": out["skipped"], "agents_not_stopped": out.get("agents_not_stopped"),
            "server_starts_s_max": max((e.get("start_s") or 0 for e in starts), default=None)}
