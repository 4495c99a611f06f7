"""Our side traced: each call of the engine's functions in ``TRACED`` a span on its thread, and one
turn's spans placed before or after its last token."""

from __future__ import annotations

import threading
import time
from collections import defaultdict

from harness.trials.serving.append_profile.report import ms

# (module path, attribute, label): the engine's functions whose calls are traced as spans
TRACED = [
    ("semantic.cache.convert", "reconstruct", "reconstruct (pooled blocks -> KVCache)"),
    ("semantic.cache.convert", "extract", "extract (KVCache -> pooled blocks)"),
    ("semantic.cachefile", "prepare_save", "prepare_save (worker thread)"),
    ("semantic.cache.reuse", "choose_start", "choose_start (prefix lookup)"),
    ("semantic.runner.steploop.StepLoop", "_prefill", "prefill chunks (forward + per-chunk eval)"),
    ("semantic.runner.steploop.StepLoop", "_decode", "decode step (queue forward)"),
    ("semantic.runner.steploop.StepLoop", "_read_decoded", "decode read (wait for forward)"),
    ("semantic.runner.steploop.StepLoop", "_join", "join batch (merge caches)"),
    ("semantic.runner.executor.BatchExecutor", "_record", "record token + on_token"),
    ("semantic.sched.scheduler.ConcurrentScheduler", "_admit", "scheduler admit"),
    ("semantic.sched.scheduler.ConcurrentScheduler", "_finish", "scheduler finish (save prep, residency)"),
    ("semantic.sched.scheduler.ConcurrentScheduler", "_hold_budget", "scheduler RAM budget check"),
    ("mlx.core", "clear_cache", "mx.clear_cache"),
]


class Tracer:
    """Spans (label, thread, t0, t1) of the traced functions' calls, and stamps of one turn's events."""

    def __init__(self):
        self.spans: list[tuple[str, int, float, float]] = []
        self._undo = []

    def install(self) -> None:
        import importlib

        for where, attr, label in TRACED:
            parts = where.split(".")
            try:
                owner = importlib.import_module(where)
            except ModuleNotFoundError:
                owner = getattr(importlib.import_module(".".join(parts[:-1])), parts[-1])
            self._wrap(owner, attr, label)

    def _wrap(self, owner, attr: str, label: str) -> None:
        orig = getattr(owner, attr)
        spans = self.spans

        def traced(*a, **k):
            t0 = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                spans.append((label, threading.get_ident(), t0, time.perf_counter()))

        setattr(owner, attr, traced)
        self._undo.append((owner, attr, orig))

    def uninstall(self) -> None:
        for owner, attr, orig in reversed(self._undo):
            setattr(owner, attr, orig)
        self._undo.clear()


def account(stamps: dict, spans: list, c, caller: int) -> dict:
    """One traced turn: its stamps from submit, and each label's ms before and after its last token."""
    t0 = stamps["submit"]
    last = stamps["last_token"]
    before, after = defaultdict(float), defaultdict(float)
    for label, thread, a, b in spans:
        if a < t0 or thread == caller:
            continue
        if b <= last:
            before[label] += b - a
        else:
            after[label] += b - max(a, last)
            before[label] += max(0.0, last - a)
    return {
        "cached_tokens": c.cached_tokens, "prompt_tokens": c.history_tokens, "generated": len(c.token_ids),
        "admitted_ms": ms(stamps["admitted"] - t0), "ttft_ms": ms(stamps["first_token"] - t0),
        "last_token_ms": ms(last - t0), "tokens_final_ms": ms(stamps["tokens_final"] - t0) if "tokens_final" in stamps else None,
        "completion_ms": ms(stamps["completion"] - t0),
        "before_last_token": {k: ms(v) for k, v in before.items()},
        "after_last_token": {k: ms(v) for k, v in after.items()},
    }
