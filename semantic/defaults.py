"""Every knob's default, in one place: the executor, the scheduler, the server's flags and the harness read these.

A floor below the one a caller reaches takes its values as given (no
defaults of its own), so a default never differs between floors.
"""

from __future__ import annotations

MAX_TOKENS = 256         # tokens a turn may generate when its caller names no budget
MAX_BATCH = 8            # sequences decoded together in one step
MAX_QUEUED = 64          # turns that may wait for admission before a submit is refused
BLOCK_TOKENS = 256       # tokens per pooled KV block (the unit of sharing, saving and eviction)
POOL_MB = 1024           # a fixed KV block pool for the harness's own executors (the server sizes its
                         # pool from the machine: semantic.sizing)
RAM_SHARE = 0.75         # of the pool, the server's default budget for caches resident between turns:
                         # the rest holds turns in flight and reusable prefixes, so the budget binds
DISK_MB = 8192           # the harness's cache files (the server's: semantic.sizing)


def spec_position_cost() -> float:
    """What one more drafted position adds to a decode step, relative to it (``semantic.decode.promptlookup``).

    A 2-core CPU computes each position (SmolLM2 f32: 4 positions 1.5x, 8
    positions 2.5x a 1-token step); a GPU's step is bound by reading the
    weights, so a few more positions cost little.
    """
    import mlx.core as mx

    return 0.05 if mx.default_device() == mx.gpu else 0.15


def prefill_chunk() -> int:
    """Prompt tokens per step: a chunk costs about one or two decode steps of a small model.

    On a CPU a forward pass over 64 tokens costs about two decode steps of
    SmolLM2 (EXP-010 measures the trade-off); a GPU runs 512 in about that.
    """
    import mlx.core as mx

    return 512 if mx.default_device() == mx.gpu else 64
