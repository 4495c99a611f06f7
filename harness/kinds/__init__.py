"""Trial implementations, one module per experiment kind.

A kind declares its parameters (checked by ``harness.config``), the plots it
can draw, and a ``run(ctx)`` function that measures and records into
``ctx.results``. ``KINDS`` maps each kind's name to its declaration
(``harness.kinds.base``). ``persistence_speed`` is no kind of its own: it is
the save and load timing of ``persistence_roundtrip``; nor is
``reconstruction_report``: the summaries of ``reconstruction``'s cells. What
kinds share is outside this folder: ``harness.engines``, ``harness.prompts``,
``harness.synthetic``, ``harness.baseline``, and the child processes in
``harness.children``.
"""

from __future__ import annotations

from harness.kinds.base import KINDS, Kind, Param, register

# Importing a kind module registers it.
from harness.kinds import (  # noqa: E402,F401
    block_store,
    hybrid_reuse,
    cache_injection,
    chaos,
    claude_code,
    claude_code_models,
    multi_model,
    multiturn,
    per_sequence_extraction,
    persistence_roundtrip,
    reconstruction,
    responses_chain,
    serving,
    shared_tier,
    speculation,
    steploop,
    stress,
    throughput,
    toolloop,
)

__all__ = ["KINDS", "Kind", "Param", "register"]
