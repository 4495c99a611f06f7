"""What a server's cache did for one request, read where that server reports it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from harness.servers.processes import Running
from harness.servers.targets import ServerTarget


def usage_cached_tokens(usage: Any) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` from a dict or an SDK object; None when absent."""
    if usage is None:
        return None
    if hasattr(usage, "model_dump"):
        usage = usage.model_dump()
    details = usage.get("prompt_tokens_details") if isinstance(usage, Mapping) else None
    value = details.get("cached_tokens") if isinstance(details, Mapping) else None
    return None if value is None else int(value)


def _sum_key(tree: Any, key: str) -> int:
    """The sum of every numeric ``key`` anywhere in a JSON tree."""
    if isinstance(tree, Mapping):
        return sum((int(v) if k == key and isinstance(v, (int, float)) else _sum_key(v, key))
                   for k, v in tree.items())
    if isinstance(tree, list):
        return sum(_sum_key(v, key) for v in tree)
    return 0


def cached_tokens(running: Running | ServerTarget, response_usage: Any = None,
                  before_stats: Mapping | None = None, after_stats: Mapping | None = None) -> int | None:
    """Prompt tokens one request took from the server's cache, as that server reports it.

    Args:
        running: the server (or its target).
        response_usage: the response's ``usage`` (dict or SDK object), for ``cached_from="usage"``.
        before_stats, after_stats: :meth:`Running.stats` just before and after the
            request, for ``cached_from="stats_endpoint"`` (one request at a time).

    Returns:
        The count, or None where the server does not say.
    """
    target = running.target if isinstance(running, Running) else running
    if target.cached_from == "usage":
        return usage_cached_tokens(response_usage)
    if target.cached_from == "stats_endpoint":
        if before_stats is None or after_stats is None:
            return None
        return _sum_key(after_stats, target.stats_key) - _sum_key(before_stats, target.stats_key)
    return None
