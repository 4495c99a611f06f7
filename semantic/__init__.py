"""Persistent block-pool KV-cache engine for mlx-lm agents."""

from semantic.blocks import AgentBlocks, KVBlock
from semantic.engine import BlockPoolBatchEngine, Completion
from semantic.errors import (
    AgentBusyError,
    CacheCorruptError,
    CacheError,
    CacheMismatchError,
    CacheShapeError,
    InvalidAgentIdError,
    InvalidRequestError,
    PoolExhaustedError,
    QueueFullError,
    SchedulerClosedError,
    UnknownSequenceError,
    UnsupportedCacheError,
)
from semantic.pool import BlockPool, PoolStats
from semantic.scheduler import ConcurrentScheduler, SchedulerStats, TurnResult, render_chat
from semantic.spec import LayerSpec, ModelCacheSpec
from semantic.store import AgentCacheStore, StoreStats

__all__ = [
    "AgentBlocks",
    "AgentBusyError",
    "AgentCacheStore",
    "BlockPool",
    "BlockPoolBatchEngine",
    "Completion",
    "CacheCorruptError",
    "CacheError",
    "CacheMismatchError",
    "CacheShapeError",
    "ConcurrentScheduler",
    "InvalidAgentIdError",
    "InvalidRequestError",
    "KVBlock",
    "LayerSpec",
    "ModelCacheSpec",
    "PoolExhaustedError",
    "PoolStats",
    "QueueFullError",
    "SchedulerClosedError",
    "SchedulerStats",
    "StoreStats",
    "TurnResult",
    "UnknownSequenceError",
    "UnsupportedCacheError",
    "render_chat",
]
