"""EXP-008: a stress run. Many requests from many agents through one scheduler, checked turn by turn.

``requests`` turns from ``agents`` agents, in random order, with up to
``concurrency`` in flight: random question and reply lengths, some
conversations edited (cut at a random earlier point and changed), some agents
evicted to disk first (the next turn reloads their file). Every agent's
history starts with the shared system prefix and then a canary (a token
sequence of its own).

Checked on every turn:

- errors: a request that raised;
- stale reuses: the agent's new cache does not hold exactly its history plus
  its reply, or a block of it holds other tokens than the history has at its
  positions (a reused block from a diverged or foreign history);
- leaks: another agent's canary inside the agent's cache, in RAM or in its file;
- hit rate: history tokens served from caches, after each agent's first turn.

A sample of ``parity_samples`` turns is re-run as a fresh prefill in an
engine of its own: the same greedy tokens and logprobs within ``tolerance``.
"""

from __future__ import annotations

import concurrent.futures as cf
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from harness import plots
from harness.kinds.base import Kind, Param, register
from harness.kinds.agents import open_scheduler
from harness.kinds.common import make_engine as fresh_engine
from semantic import persistence, store as store_mod
from semantic.reuse import common_prefix

CANARY_LEN = 4


def _canary(agent: int, vocab: int) -> tuple[int, ...]:
    """A token sequence unique to each agent (and absent from the system prefix)."""
    rng = np.random.default_rng(10_000 + agent)
    return tuple(int(t) for t in rng.integers(3, vocab - 1, CANARY_LEN))


def _contains(seq: tuple[int, ...], sub: tuple[int, ...]) -> bool:
    n = len(sub)
    return any(seq[i:i + n] == sub for i in range(len(seq) - n + 1))


def _draw(rng, lo_hi) -> int:
    return int(rng.integers(lo_hi[0], lo_hi[1] + 1))


def run(ctx) -> None:
    p, loaded, res = ctx.params, ctx.loaded, ctx.results
    rng = np.random.default_rng(p["seed"])
    vocab = min(loaded.tokenizer.vocab_size, 30_000)
    # token ids, not text: every id is drawn from the vocabulary, so lengths are exact
    draw_ids = lambda n: [int(t) for t in rng.integers(3, vocab - 1, n)]  # noqa: E731
    system = draw_ids(p["system_tokens"])
    agents = [f"agent-{i:02d}" for i in range(p["agents"])]
    canaries = {a: _canary(i, vocab) for i, a in enumerate(agents)}
    for a, c in canaries.items():
        assert not _contains(tuple(system), c) and sum(_contains(c2, c) for c2 in canaries.values()) == 1
    history = {a: None for a in agents}     # None: the agent's next turn is its first
    turns = {a: 0 for a in agents}
    counts = {k: 0 for k in ("errors", "stale", "leaks", "edits", "evictions", "evict_refused", "parity_checked",
                             "parity_edited", "parity_failed", "cached_tokens", "history_tokens")}
    error_messages, latencies, ttfts, parity = [], [], [], []
    parity_every = max(1, p["requests"] // max(1, p["parity_samples"] - p["parity_samples"] // 2))
    fresh = fresh_engine(loaded, p["pool_blocks"])
    max_diff = 0.0
    ctx.progress.total = p["requests"]
    cache_dir = Path(tempfile.mkdtemp(prefix="exp008-"))
    sched = open_scheduler(loaded, cache_dir, p["pool_blocks"], max_batch=p["concurrency"],
                           block_tokens=p["block_tokens"])
    t_start = time.perf_counter()
    try:
        outstanding: dict[cf.Future, tuple[str, list[int], int, bool]] = {}
        submitted = done = next_parity = 0
        while done < p["requests"]:
            idle = [a for a in agents if a not in {v[0] for v in outstanding.values()}]
            while len(outstanding) < p["concurrency"] and submitted < p["requests"] and idle:
                a = idle.pop(int(rng.integers(len(idle))))
                h, edited = history[a], False
                if h is None:
                    h = system + list(canaries[a])
                elif rng.random() < p["edit_prob"] and len(h) > len(system) + CANARY_LEN + 2:
                    cut = int(rng.integers(len(system) + CANARY_LEN, len(h)))
                    h = h[:cut] + [(h[cut] + 1) % (vocab - 4) + 3]  # an earlier message changed; the rest removed
                    counts["edits"] += 1
                    edited = True
                if len(h) > p["max_context"]:  # the client drops the oldest exchange, as chat apps do
                    keep = len(system) + CANARY_LEN
                    h = h[:keep] + h[keep + (len(h) - p["max_context"]) + p["max_context"] // 4:]
                if turns[a] and rng.random() < p["evict_prob"]:
                    ok = sched.evict(a)  # refused while its newest cache is not yet on disk
                    counts["evictions" if ok else "evict_refused"] += 1
                h = h + draw_ids(_draw(rng, p["question_tokens"]))
                max_tokens = _draw(rng, p["answer_tokens"])
                fut = sched.submit(a, h, max_tokens, timeout=None)
                outstanding[fut] = (a, h, submitted, edited)
                submitted += 1
            finished, _ = cf.wait(list(outstanding), return_when=cf.FIRST_COMPLETED)
            for fut in finished:
                a, h, index, edited = outstanding.pop(fut)
                done += 1
                ctx.progress.update(1)
                try:
                    r = fut.result()
                except Exception as exc:  # counted, reported, and the run goes on
                    counts["errors"] += 1
                    error_messages.append(f"{a} turn {turns[a]}: {type(exc).__name__}: {exc}"[:300])
                    continue
                full = tuple(h) + r.token_ids
                if turns[a]:
                    counts["cached_tokens"] += r.cached_tokens
                    counts["history_tokens"] += r.history_tokens
                turns[a] += 1
                history[a] = list(full)
                latencies.append(r.latency_s * 1e3)
                ttfts.append(r.ttft_s * 1e3)
                cache = sched.resident_cache(a)
                if not r.cache_saved or cache is None:
                    counts["errors"] += 1
                    error_messages.append(f"{a}: cache not kept: {r.cache_error}")
                    continue
                stale = cache.token_ids != full or any(
                    b.token_ids != full[b.start:b.end] for b in cache.unique_blocks())
                counts["stale"] += stale
                counts["leaks"] += any(_contains(cache.token_ids, c) for o, c in canaries.items() if o != a)
                # half the budget on edited turns (where staleness would show), half spread over the run
                edit_slot = edited and counts["parity_edited"] < p["parity_samples"] // 2
                even_slot = index >= next_parity and counts["parity_checked"] - counts["parity_edited"] < (
                    p["parity_samples"] - p["parity_samples"] // 2)
                if r.cached_tokens and (edit_slot or even_slot):
                    if even_slot and not edit_slot:
                        next_parity = index + parity_every
                    counts["parity_edited"] += edit_slot
                    ok, diff = _parity(fresh, h, r, p["tolerance"])
                    counts["parity_checked"] += 1
                    counts["parity_failed"] += not ok
                    max_diff = max(max_diff, diff)
                    parity.append({"agent": a, "edited": edited, "history_tokens": len(h), "cached_tokens": r.cached_tokens,
                                   "reuse": r.reuse, "match": ok, "max_abs_logprob_diff": diff})
        wall_s = time.perf_counter() - t_start
        sched.flush()
        counts["leaks"] += _file_leaks(cache_dir, canaries)
        stats, store_stats = sched.stats(), sched.store.stats()
    finally:
        sched.close()
        shutil.rmtree(cache_dir, ignore_errors=True)

    res.output("counts", counts)
    res.output("errors", error_messages[:50])
    res.output("parity", parity)
    res.output("scheduler", {f: getattr(stats, f) for f in stats.__slots__})
    res.output("store", {f: getattr(store_stats, f) for f in store_stats.__slots__})
    res.metric("latency_ms", latencies, "ms", description="submit to finished, per request (queueing included)")
    res.metric("ttft_ms", ttfts, "ms", description="submit to first token, per request (queueing included)")
    hit = counts["cached_tokens"] / counts["history_tokens"] if counts["history_tokens"] else 0.0
    for key in ("errors", "stale", "leaks", "edits", "evictions", "parity_checked", "parity_failed"):
        res.check(key, counts[key])
    res.check("requests", done)
    res.check("all_requests_answered", done == p["requests"] and counts["errors"] == 0)
    res.check("token_hit_rate", hit)
    res.check("disk_reloads", store_stats.disk_hits)
    res.check("max_abs_logprob_diff", max_diff)
    res.check("requests_per_s", done / wall_s)
    if "latency_cdf" in ctx.config.plots:
        ctx.plots.append(plots.cdf_plot({"latency": latencies, "time to first token": ttfts},
                                        ctx.plot_path("latency-cdf"), "ms (queueing included)",
                                        f"EXP-008 {ctx.model_name}: {done} requests, {len(agents)} agents"))


def _parity(engine, h: list[int], r, tol: float) -> tuple[bool, float]:
    """The turn again as a fresh prefill in an engine of its own."""
    uid = engine.submit("parity", h, max_tokens=len(r.token_ids))
    ref = {c.uid: c for c in engine.step()}[uid]
    if ref.blocks is not None:
        ref.blocks.release()
    n = min(len(ref.logprobs), len(r.logprobs))
    diff = float(np.max(np.abs(np.array(ref.logprobs[:n]) - np.array(r.logprobs[:n])))) if n else 0.0
    return list(r.token_ids) == ref.token_ids and diff <= tol, diff


def _file_leaks(cache_dir: Path, canaries: dict) -> int:
    """Cache files whose token ids hold another agent's canary (or that name the wrong agent)."""
    leaks = 0
    for path in cache_dir.glob(f"*{persistence.SUFFIX}"):
        info = persistence.read_header(path)
        own = info.agent_id
        leaks += path.name != store_mod.file_name(own)
        leaks += any(_contains(tuple(info.token_ids), c) for a, c in canaries.items() if a != own)
    return leaks


def _validate(p: dict) -> None:
    for key in ("question_tokens", "answer_tokens"):
        v = p[key]
        if not (isinstance(v, list) and len(v) == 2 and all(isinstance(x, int) for x in v) and 1 <= v[0] <= v[1]):
            raise ValueError(f"{key} must be [low, high] with 1 <= low <= high")
    if p["requests"] < 1 or p["agents"] < 2 or p["concurrency"] < 1:
        raise ValueError("needs requests >= 1, agents >= 2, concurrency >= 1")
    if not (0 <= p["edit_prob"] <= 1 and 0 <= p["evict_prob"] <= 1):
        raise ValueError("edit_prob and evict_prob are probabilities")
    if p["max_context"] <= p["system_tokens"] + CANARY_LEN + p["question_tokens"][1] + p["answer_tokens"][1]:
        raise ValueError("max_context must leave room for a turn after the system prefix")


KIND = register(Kind(
    name="stress",
    run=run,
    params={
        "requests": Param(int, 1000, "turns in all"),
        "agents": Param(int, 16, "agents the turns are spread over, in random order"),
        "concurrency": Param(int, 8, "turns in flight at once (also the batch size)"),
        "system_tokens": Param(int, 64, "a prefix every agent's history starts with"),
        "question_tokens": Param(list, [4, 48], "new tokens per turn, [low, high]"),
        "answer_tokens": Param(list, [1, 8], "generated tokens per turn, [low, high]"),
        "edit_prob": Param(float, 0.05, "chance a turn edits the conversation first"),
        "evict_prob": Param(float, 0.05, "chance an agent is evicted to disk before its turn"),
        "max_context": Param(int, 1024, "history length at which the oldest exchange is dropped"),
        "parity_samples": Param(int, 20, "turns re-run as a fresh prefill and compared"),
        "tolerance": Param(float, 1e-4, "largest logprob difference a parity check allows"),
        "pool_blocks": Param(int, 1024, "blocks in the pool"),
        "block_tokens": Param(int, 256, "tokens per block (small blocks exercise more sharing and cutting)"),
        "seed": Param(int, 0, "random seed of the workload"),
    },
    plots=frozenset({"latency_cdf"}),
    needs_model=True,
    validate=_validate,
    trial_code=(_parity, _file_leaks, _contains),
))
