"""Experiment trials: what each TOML's ``kind`` runs, one module or folder per experiment.

A trial declares its parameters (checked by ``harness.config``), the plots it
can draw, and a ``run(ctx)`` function that measures and records into
``ctx.results``. ``KINDS`` maps each kind's name (the TOML's ``kind``) to its
declaration (``harness.trials.base``). An experiment with more than one piece
is a folder: ``trial.py`` declares the kind, beside it its checks, report,
servers and child processes. What trials share is outside this folder:
``harness.servers`` (servers as processes, their clients and phases),
``harness.common`` (child processes, report tables), ``harness.executors``,
``harness.prompts``, ``harness.synthetic``, ``harness.baseline``.
"""

from __future__ import annotations

from importlib import import_module

from harness.trials.base import KINDS, TrialKind, Param, register

# Importing a trial module registers its kind: a folder's ``trial``, or the module itself.
MODULES = ("block_store.trial", "cache_injection", "chaos.trial", "claude_code.trial", "claude_code.two_models",
           "commit_compare.trial",
           "memory_copies.trial",
           "hybrid.trial", "multi_model.trial", "multiturn.trial", "per_sequence_extraction",
           "persistence_roundtrip.trial", "real_geometry.trial", "reconstruction.trial", "responses_chain",
           "serving.trial", "shared_tier.trial", "speculation", "step_loop", "stress", "throughput.trial", "tool_loop.trial",
           "window_trace.trial")
for _module in MODULES:
    import_module(f"harness.trials.{_module}")

__all__ = ["KINDS", "MODULES", "TrialKind", "Param", "register"]
