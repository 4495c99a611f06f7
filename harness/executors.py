"""Our engine as the kinds drive it: a batch executor or a scheduler over a pool of its own, one
request run to its end, first-token timing, and how two completions' logprobs are compared."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from harness.timing import Samples, time_interleaved
from semantic import AgentBlocks, AgentCacheStore, BlockPool, BatchExecutor, ConcurrentScheduler, ModelCacheSpec, Request


def make_executor(loaded, blocks: int = 256) -> BatchExecutor:
    """A batch executor over a pool of its own (``blocks`` blocks): its requests reuse nothing from any other."""
    spec = ModelCacheSpec.from_model(loaded.model)
    # No stop tokens: runs are exactly max_tokens long, so they compare step for step.
    return BatchExecutor(loaded.model, loaded.tokenizer, BlockPool(spec, blocks), spec, stop_tokens=[])


def open_scheduler(loaded, cache_dir: Path, blocks: int, max_batch: int = 8, write_behind: bool = True,
                   block_tokens: int = 256, ram_budget_bytes: int | None = None, speculation=None):
    """A scheduler over a fresh pool and a store in ``cache_dir`` (files there are found: a restart);
    ``ram_budget_bytes`` bounds its resident caches (None: the pool does); ``speculation`` a SpecConfig."""
    spec = ModelCacheSpec.from_model(loaded.model)
    pool = BlockPool(spec, blocks, block_tokens)
    store = AgentCacheStore(cache_dir, spec, loaded.fingerprint, disk_budget_bytes=1 << 40, pool=pool)
    # no stop tokens: every turn generates exactly max_tokens, so turns compare step for step
    return ConcurrentScheduler(loaded.model, loaded.tokenizer, store, max_batch=max_batch,
                               write_behind=write_behind, stop_tokens=[], ram_budget_bytes=ram_budget_bytes,
                               speculation=speculation)


def run_one(executor: BatchExecutor, agent: str, prompt: list[int], cache: AgentBlocks | None, max_tokens: int):
    """Prefill ``prompt`` after ``cache`` (None: from nothing, no pooled prefix either) and generate."""
    uid = executor.submit(Request(agent, _after(cache, prompt), max_tokens), cache, share=False)
    return {c.uid: c for c in executor.step()}[uid]


def _after(cache: AgentBlocks | None, prompt: list[int]) -> list[int]:
    """The whole history of a prompt that continues ``cache``."""
    return prompt if cache is None else [*cache.token_ids, *prompt]


def logprob_diff(a, b) -> float:
    """The largest absolute difference of two logprob sequences, over the steps both have (0.0 for none)."""
    n = min(len(a), len(b))
    return float(np.max(np.abs(np.array(a[:n]) - np.array(b[:n])))) if n else 0.0


def match_report(a, b) -> dict:
    """Do two completions agree: tokens, and the largest logprob difference."""
    return {"tokens_equal": a.token_ids == b.token_ids, "max_abs_logprob_diff": logprob_diff(a.logprobs, b.logprobs),
            "steps": len(a.token_ids)}


def fresh_first_token(executor: BatchExecutor, ids: list[int]):
    """Prefill ``ids`` from nothing and sample one token; the Completion (its ``ttft_s`` is
    submit to the materialized first token). Its blocks are released at once."""
    uid = executor.submit(Request("fresh", ids, 1), share=False)
    done = {c.uid: c for c in executor.step()}[uid]
    assert done.cached_tokens == 0
    if done.blocks is not None:
        done.blocks.release()
    return done


def time_ttft(executor: BatchExecutor, cached: tuple, fresh: tuple, protocol, progress) -> dict[str, Samples]:
    """Time submit + first step (prefill and first token) for a cached and a fresh request, interleaved.

    ``cached`` is (continuation ids, blocks); ``fresh`` is (full ids,). The
    first step ends by reading the sampled token, so it is materialized. The
    requests are drained, untimed, before the next call.
    """

    def drain():
        for c in executor.step():
            if c.blocks is not None:
                c.blocks.release()

    def first_token(agent, prompt, cache):
        def call():
            executor.submit(Request(agent, _after(cache, prompt), 2), cache, share=False)
            executor.step_once()
        return call

    out = time_interleaved(
        {"cached": first_token("ttft-cached", cached[0], cached[1]), "fresh": first_token("ttft-fresh", fresh[0], None)},
        protocol,
        setup=drain,
        progress=progress,
    )
    drain()
    return out


def record_ttft(ctx, executor: BatchExecutor, cached: tuple, fresh: tuple, cached_what: str, fresh_what: str):
    """Time first tokens with :func:`time_ttft` over the config's protocol and record them as
    ``ttft_injected_ms`` and ``ttft_fresh_ms`` (described by ``cached_what`` and ``fresh_what``), their
    comparison ``ttft`` and the check ``speedup_p50``. Returns the samples."""
    res = ctx.results
    ctx.progress.total = ctx.config.protocol.trials
    samples = time_ttft(executor, cached, fresh, ctx.config.protocol, ctx.progress.update)
    res.timing("ttft_injected_ms", samples["cached"], cached_what)
    res.timing("ttft_fresh_ms", samples["fresh"], fresh_what)
    cmp = res.compare("ttft", "ttft_injected_ms", "ttft_fresh_ms")
    res.check("speedup_p50", 1.0 / cmp["ratio_p50"])
    return samples
