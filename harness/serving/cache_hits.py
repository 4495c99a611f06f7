"""What a server's cache did for one request, read where that server reports it."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from harness.serving.processes import Running
from harness.serving.targets import ServerTarget


def usage_cached_tokens(usage: Any) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` from a dict or an SDK object; None when absent."""
    if usage is None:
        return None
    if hasattr(usage, "model_dump"):
        usage = usage.model_dump()
    details = usage.get("prompt_tokens_details") if isinstance(usage, Mapping) else None
    value = details.get("cached_tokens") if isinstance(details, Mapping) else None
    return None if value is None else int(value)


def sum_key(tree: Any, key: str) -> int:
    """The sum of every numeric ``key`` anywhere in a JSON tree."""
    if isinstance(tree, Mapping):
        return sum((int(v) if k == key and isinstance(v, (int, float)) else sum_key(v, key))
                   for k, v in tree.items())
    if isinstance(tree, list):
        return sum(sum_key(v, key) for v in tree)
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
        return sum_key(after_stats, target.stats_key) - sum_key(before_stats, target.stats_key)
    return None


_VLLM_FETCH = re.compile(r"\[cache_fetch\] request=\S+ (HIT|MISS) prompt_tokens=(\d+)(?: cached=(\d+))?")


def vllm_mlx_log_usage(log_text: str) -> list[tuple[int, int]]:
    """Per request, in order, the prompt and cached tokens vllm-mlx's scheduler logged (``[cache_fetch]``):
    its Anthropic usage reports ``input_tokens: 0`` and no cache field."""
    return [(int(m[2]), int(m[3] or 0)) for m in _VLLM_FETCH.finditer(log_text)]
