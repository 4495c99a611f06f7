"""Every error the engine raises on purpose, under one base class."""

from __future__ import annotations


class CacheError(Exception):
    """Base class: catch this to handle any engine or cache-file failure."""


class PoolExhaustedError(CacheError):
    """The block pool has fewer free blocks than an allocation needs."""


class CacheMismatchError(CacheError):
    """A cache belongs to another model or cache spec than the one in use."""


class CacheShapeError(CacheMismatchError):
    """A block's arrays do not have the shape or dtype the spec requires."""


class UnsupportedCacheError(CacheError, TypeError):
    """A layer cache type the engine cannot extract or rebuild."""


class AgentBusyError(CacheError):
    """The agent already has a request in flight."""


class InvalidRequestError(CacheError, ValueError):
    """A request the engine refuses before touching any state."""


class UnknownSequenceError(CacheError, KeyError):
    """No sequence with this uid is in flight or recently finished."""


class CacheCorruptError(CacheError):
    """A cache file is damaged, truncated, edited, or in an unknown format.

    ``path`` names the file and ``reason`` says what is wrong with it; the
    file is never half-loaded.
    """

    def __init__(self, path, reason: str):
        self.path = str(path)
        self.reason = reason
        super().__init__(f"{self.path}: {reason}")

    def __reduce__(self):
        return type(self), (self.path, self.reason)


class CacheFormatError(CacheError):
    """A cache written by a newer build of semantic, in a format this build does not read (it is left
    alone: run the newer build, or give this one another cache directory)."""


class InvalidAgentIdError(InvalidRequestError):
    """An agent id the cache store cannot accept (not a usable string)."""


class QueueFullError(CacheError):
    """The scheduler's queue is at its bound; retry later or wait with a timeout."""


class SchedulerClosedError(CacheError):
    """The scheduler was closed; it takes no more requests."""


class ContextLengthError(InvalidRequestError):
    """A prompt plus its token budget exceeds the model's context (or the pool)."""


class TurnTooLargeError(PoolExhaustedError, ContextLengthError):
    """A turn needs more of the pool than it has, even empty: no wait can fit it (its numbers say why)."""


class CacheSaveError(CacheError):
    """A cache file could not be written; the cache stays in RAM and the agent's next turn saves again.

    ``kind`` names the cause: "disk_full" (no room, or less than the
    reserve left), "read_only", "missing" (the directory is gone) or "io".
    ``skipped``: the store did not try, because it is backing off after an
    earlier failure of that kind.
    """

    def __init__(self, kind: str, message: str, *, skipped: bool = False):
        self.kind, self.skipped = kind, skipped
        super().__init__(message)
