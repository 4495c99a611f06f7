"""Persistent block-pool KV-cache engine for mlx-lm agents."""

from semantic.blocks import AgentBlocks, KVBlock
from semantic.engine import BlockPoolBatchEngine, Completion
from semantic.errors import (
    AgentBusyError,
    CacheError,
    CacheMismatchError,
    CacheShapeError,
    InvalidRequestError,
    PoolExhaustedError,
    UnknownSequenceError,
    UnsupportedCacheError,
)
from semantic.pool import BlockPool, PoolStats
from semantic.spec import LayerSpec, ModelCacheSpec

__all__ = [
    "AgentBlocks",
    "AgentBusyError",
    "BlockPool",
    "BlockPoolBatchEngine",
    "Completion",
    "CacheError",
    "CacheMismatchError",
    "CacheShapeError",
    "InvalidRequestError",
    "KVBlock",
    "LayerSpec",
    "ModelCacheSpec",
    "PoolExhaustedError",
    "PoolStats",
    "UnknownSequenceError",
    "UnsupportedCacheError",
]
