"""The engine part: in this process, our ``Service`` against mlx-lm's ``generate_step`` on the same
tokens, A B / B A; our timed turns traced span by span, then the hidden costs timed apart."""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path

from harness.trials.serving.append_profile.micro import micro
from harness.trials.serving.append_profile.reference import prefilled, reference
from harness.trials.serving.append_profile.report import progress
from harness.trials.serving.append_profile.tracing import Tracer, account
from harness.trials.serving.append_profile.turns import conversation, tokens_of


def engine_part(model_dir: Path, trials: int, cached: int, new: int, max_tokens: int) -> dict:
    """A warm turn caches the prefix on both sides; then each trial's append on ours (traced) and on
    mlx-lm's, in alternating order; then the micro-benchmarks."""
    service = _open(model_dir)
    model, tok = service.scheduler.executor.model, service.tokenizer
    rows, ref_rows = [], []
    msgs, tool = conversation(tok, cached, new, 0)
    first = tokens_of(tok, msgs)
    warm = turn(service, "warm-0", first, max_tokens)  # compiles, and leaves the prefix's blocks in the pool
    prefix = list(first) + list(warm.token_ids)
    ref_cache = prefilled(model, prefix)
    for trial in range(trials):
        _, tool = conversation(tok, cached, new, trial)
        appended = prefix + tok.encode("\n" + tool, add_special_tokens=False)
        for side in (("ours", "mlx-lm") if trial % 2 == 0 else ("mlx-lm", "ours")):
            if side == "ours":
                rows.append(_traced(service, f"append-{trial}", first, appended, max_tokens))
            else:
                ref_rows.append(reference(model, service.eos, ref_cache, appended[len(prefix):], max_tokens))
            progress(f"trial {trial + 1}/{trials} {side}: {(rows if side == 'ours' else ref_rows)[-1]['ttft_ms']} ms TTFT")
    hidden = micro(model, tok, prefix, appended, msgs, tool, service.scheduler.executor.prefill_chunk)
    service.close()
    return {"ours": rows, "mlx_lm": ref_rows, "micro": hidden, "cached_tokens": len(prefix),
            "new_tokens": len(appended) - len(prefix), "prefill_chunk": service.scheduler.executor.prefill_chunk}


def _open(model_dir: Path):
    """The service the server runs, with its default budgets, its cache in a fresh folder."""
    from semantic import defaults
    from semantic.service import Service

    tmp = Path(tempfile.mkdtemp(prefix="append-profile-"))
    pool = defaults.POOL_MB << 20
    return Service.open(str(model_dir), cache_dir=str(tmp / "agents"), pool_bytes=pool,
                        disk_budget_bytes=defaults.DISK_MB << 20, ram_budget_bytes=int(pool * defaults.RAM_SHARE))


def _traced(service, agent: str, first: list[int], appended: list[int], max_tokens: int) -> dict:
    """A fresh agent's untimed first turn (its tail over the pooled prefix), then its append traced."""
    turn(service, agent, first, max_tokens)
    stamps: dict = {}
    tracer = Tracer()
    tracer.install()
    try:
        c = turn(service, agent, appended, max_tokens, stamps)
    finally:
        tracer.uninstall()
    return account(stamps, list(tracer.spans), c, threading.get_ident())


def turn(service, agent: str, ids, budget: int, stamps: dict | None = None):
    """One turn through the service; with ``stamps``, when each of its events happened."""
    from semantic.service import TurnRequest

    def on_token(token, logprob, row):
        if stamps is not None:
            stamps.setdefault("first_token", time.perf_counter())
            stamps["last_token"] = time.perf_counter()
        return False

    def on_admit(n):
        if stamps is not None:
            stamps["admitted"] = time.perf_counter()

    prepared = service.prepare(TurnRequest(prompt=list(ids), max_tokens=budget, agent=agent), on_token=on_token, on_admit=on_admit)
    t0 = time.perf_counter()
    future = service.submit(prepared.request)
    tokens = getattr(future, "tokens", None)
    if stamps is not None:
        stamps["submit"] = t0
        if tokens is not None:
            tokens.add_done_callback(lambda _: stamps.__setitem__("tokens_final", time.perf_counter()))
        future.add_done_callback(lambda _: stamps.__setitem__("completion", time.perf_counter()))
    c = future.result()
    service.scheduler.flush()  # the save is written before the next sample
    return c
