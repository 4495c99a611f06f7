"""Which model answered what, counted from a logging proxy's rows (``Exchange.row()`` plus a ``session``).

A client that sends its own model names (Claude Code with no model variables: ``claude-opus-5-5`` for its
turns, ``claude-haiku-5-5`` for a Haiku agent) reaches a several-model server through its aliases. The
proxy records the name sent and the reply's ``model`` (the id it resolved to); these functions count
both, the refusals, the cache reads per served model, and any request that reached another model than
the aliases say it should (the rule is written here again, independently of the server's registry)::

    sent "claude-haiku-5-5" ──alias "claude-*haiku*"──► small      (12 literal characters: the most specific)
    sent "claude-opus-5-5"  ──alias "claude-*"────────► main
"""

from __future__ import annotations

from collections import Counter
from fnmatch import fnmatchcase

WILDCARDS = "*?["


def literal_chars(pattern: str) -> int:
    """How specific a glob is: its characters that are not wildcards (``claude-*haiku*``: 11)."""
    return sum(c not in WILDCARDS for c in pattern)


def expected_model(name: str | None, ids: list[str], aliases: dict[str, str]) -> str | None:
    """The id ``name`` should reach: a model's own id, else an exact alias, else the matching glob with the
    most literal characters (the first declared among equals); None: no model (a request without one
    goes to the first id) or no match."""
    if name is None:
        return ids[0] if ids else None
    if name in ids:
        return name
    exact = {p: t for p, t in aliases.items() if not any(c in p for c in WILDCARDS)}
    if name in exact:
        return exact[name]
    globs = [(p, t) for p, t in aliases.items() if p not in exact and fnmatchcase(name, p)]
    if not globs:
        return None
    return max(globs, key=lambda pt: literal_chars(pt[0]))[1]  # max keeps the first of equals: declaration order


def kind_of(row: dict) -> str:
    """``turn``: a request that offers tools (an agent loop's step); ``helper``: one without (a title,
    a summary, a check Claude Code asks on the side)."""
    return "turn" if row.get("tools") else "helper"


def _cached_ratio_min(rows: list[dict]) -> float | None:
    """The smallest cached ÷ prompt over each session's requests after its first (None: none, or no usage)."""
    ratios, seen = [], set()
    for r in rows:
        if r.get("session") not in seen:
            seen.add(r.get("session"))
            continue
        if (r.get("status") or 0) >= 400:
            continue
        if not r.get("prompt_tokens") or r.get("cached_tokens") is None:
            return None
        ratios.append(r["cached_tokens"] / r["prompt_tokens"])
    return round(min(ratios), 4) if ratios else None


def count_by_model(rows: list[dict], ids: list[str], aliases: dict[str, str]) -> dict:
    """Requests by the name sent and by the model that answered, refusals, cache reads per model.

    Args:
        rows: the proxy's rows in order, each with ``model`` (sent), ``served_model`` (the reply's),
            ``status``, ``tools``, ``prompt_tokens``, ``cached_tokens`` and the ``session`` it belongs to.
        ids: the served model ids, the default first; aliases: ``{pattern: id}`` as the server was given.

    Returns:
        ``sent`` / ``served``: requests per name sent and per id that answered; ``routes``: per
        ``"sent -> served"``; ``refused``: status >= 400 (``refused_by_sent`` per name sent);
        ``misrouted``: accepted requests whose answering id is not the one the aliases name (with the
        rows' indexes in ``misrouted_rows``); ``per_model[id]``: its requests, turns and helpers, the
        sessions it answered, prompt and cached tokens, requests that read a cache, and the smallest
        cached ÷ prompt after each session's first request.
    """
    accepted = [r for r in rows if (r.get("status") or 0) < 400 and r.get("status") is not None]
    refused = [r for r in rows if r not in accepted]
    wrong = [r for r in accepted if r.get("served_model") != expected_model(r.get("model"), ids, aliases)]
    out = {"requests": len(rows), "sent": dict(Counter(r.get("model") for r in rows)),
           "served": dict(Counter(r.get("served_model") for r in accepted)),
           "routes": dict(Counter(f"{r.get('model')} -> {r.get('served_model')}" for r in accepted)),
           "refused": len(refused), "refused_by_sent": dict(Counter(r.get("model") for r in refused)),
           "misrouted": len(wrong), "misrouted_rows": [r.get("index") for r in wrong], "per_model": {}}
    for mid in ids:
        mine = [r for r in accepted if r.get("served_model") == mid]
        out["per_model"][mid] = {
            "requests": len(mine), "turns": sum(kind_of(r) == "turn" for r in mine),
            "helpers": sum(kind_of(r) == "helper" for r in mine),
            "sessions": dict(Counter(r.get("session") for r in mine)),
            "prompt_tokens": sum(r.get("prompt_tokens") or 0 for r in mine),
            "cached_tokens": sum(r.get("cached_tokens") or 0 for r in mine),
            "requests_with_cache_reads": sum((r.get("cached_tokens") or 0) > 0 for r in mine),
            "cached_ratio_min_after_first": _cached_ratio_min(mine)}
    return out
