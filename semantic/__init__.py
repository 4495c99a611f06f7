"""Persistent block-pool KV-cache engine for mlx-lm agents.

The public names load lazily (PEP 562), so ``import semantic.blas`` and
``semantic.blas.enable()`` can run before anything imports MLX: the BLAS that
MLX calls is fixed when ``mlx.core`` is first imported (see ``semantic.blas``).
``SEMANTIC_BLAS=auto`` in the environment opts in without a call.
"""

from __future__ import annotations

import importlib

from semantic import blas as _blas

_blas.enable_from_env()

_EXPORTS = {
    "semantic.cache.blocks": ("AgentBlocks", "KVBlock"),
    "semantic.runner.executor": ("BatchExecutor",),
    "semantic.errors": (
        "AgentBusyError",
        "CacheCorruptError",
        "CacheError",
        "CacheMismatchError",
        "CacheSaveError",
        "CacheShapeError",
        "ContextLengthError",
        "InvalidAgentIdError",
        "InvalidRequestError",
        "PoolExhaustedError",
        "QueueFullError",
        "SchedulerClosedError",
        "UnknownSequenceError",
        "TurnTooLargeError",
        "UnsupportedCacheError",
    ),
    "semantic.cache.pool": ("BlockPool", "PoolStats"),
    "semantic.request": ("Completion", "Request", "encode", "render_chat", "validate_agent_id"),
    "semantic.sched.planner": ("SchedulerStats",),
    "semantic.sched.scheduler": ("ConcurrentScheduler", "TurnResult"),
    "semantic.cache.spec": ("LayerSpec", "ModelCacheSpec"),
    "semantic.store": ("AgentCacheStore", "StoreStats"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        try:  # a submodule: semantic.compat, semantic.cachefile, ...
            return importlib.import_module(f"semantic.{name}")
        except ModuleNotFoundError:
            raise AttributeError(f"module 'semantic' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
