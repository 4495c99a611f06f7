"""Where one append turn's time goes in our engine, in this process: the same turn the trace makes
(``append_tokens`` new tokens over ``cached_tokens`` an agent's own cache holds), on ``BatchExecutor``.

Per rep, the turn's spans, each ended in ``mx.eval`` by the engine itself::

    admit      reuse.choose_start + reconstruct the own cache from pooled blocks
    prefill    the first step: the new tokens' forward pass (up to 256 of them one pass with its head on
               the last row, ``runner.lastrow``; more, a cache-only pass and the last token alone), the
               blocks the window passed pooled (``convert.keep_passed``), the first token
    keep       of which the pooling
    finish     the finished cache extracted into the pool (``convert.extract``), after the first token

beside the floor, just before the turn on the same rebuilt cache: the same forward passes with no
engine around them (``mlx_lm.server`` computes a cache-only pass and the last token alone).
"""

from __future__ import annotations

import time
from statistics import median

import mlx.core as mx


def profile_append(model_dir, cached_tokens: int, append_tokens: int, reps: int) -> dict:
    from mlx_lm import load

    from harness.prompts import text_of_tokens
    from semantic import BatchExecutor, BlockPool, ModelCacheSpec, Request
    from semantic.cache import convert
    from semantic.runner import lastrow

    model, tok = load(str(model_dir))
    spec = ModelCacheSpec.from_model(model)
    pool = BlockPool(spec, capacity_bytes=1 << 30)  # allocated as blocks are made: room, never a recycle
    executor = BatchExecutor(model, tok, pool, spec, stop_tokens=[])
    need = cached_tokens + append_tokens * (reps + 1)
    corpus = tok.encode(text_of_tokens(tok, need + 64))
    assert len(corpus) >= need - 8, (len(corpus), need)
    spans: dict[str, list[float]] = {k: [] for k in ("admit", "prefill", "keep", "finish", "forward")}
    timed = {"keep": convert.keep_passed, "finish": convert.extract}
    clock = {"keep": 0.0, "finish": 0.0}

    def wrap(name):
        def call(*a, **k):
            t = time.perf_counter()
            try:
                return timed[name](*a, **k)
            finally:
                clock[name] += time.perf_counter() - t
        return call

    def floor(own, chunk) -> float:
        cache = convert.reconstruct(own)
        t = time.perf_counter()
        if chunk.shape[1] <= lastrow.ONE_PASS_TOKENS:  # the passes the step loop makes for this chunk
            mx.eval(lastrow.last_logits(model, chunk, cache))
        else:
            model(chunk[:, :-1], cache=cache)
            mx.eval([c.state for c in cache])
            mx.eval(model(chunk[:, -1:], cache=cache)[:, -1, :])
        return time.perf_counter() - t

    uid = executor.submit(Request("agent", corpus[:cached_tokens], 1))
    own = {c.uid: c for c in executor.step()}[uid].blocks
    at = cached_tokens
    try:
        convert.keep_passed, convert.extract = wrap("keep"), wrap("finish")
        for rep in range(reps + 1):  # the first rep warms up
            new = corpus[at : at + append_tokens]
            at += append_tokens
            forward = floor(own, mx.array([new]))  # the same turn's compute, just before it
            ids = list(own.token_ids) + new
            clock.update(keep=0.0, finish=0.0)
            first: list[float] = []
            t0 = time.perf_counter()
            uid = executor.submit(Request("agent", ids, 2, on_token=lambda *_: first.append(time.perf_counter())), own)
            t1 = time.perf_counter()
            while not first:
                executor.step_once()
            t2 = first[0]
            done = {c.uid: c for c in executor.step()}[uid]
            assert done.cached_tokens == len(own.token_ids), (done.cached_tokens, len(own.token_ids))
            own.release()
            own = done.blocks
            if rep:
                for k, v in (("admit", t1 - t0), ("prefill", t2 - t1), ("keep", clock["keep"]),
                             ("finish", clock["finish"]), ("forward", forward)):
                    spans[k].append(v)
    finally:
        convert.keep_passed, convert.extract = timed["keep"], timed["finish"]
    n = len(own.token_ids)
    own.release()
    return {"cached_tokens": n - append_tokens - 2, "append_tokens": append_tokens, "reps": reps,
            **{f"{k}_s": median(v) for k, v in spans.items()}, "samples": spans}
