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
  its reply but the reply's last token (never fed), or a block of it holds other
  tokens than the history has at its positions (a reused block from a diverged
  or foreign history);
- leaks: another agent's canary inside the agent's cache, in RAM or in its manifest (its cache file in
  the single-file layout);
- hit rate: history tokens served from caches, after each agent's first turn.

With ``ram_budget`` > 0 the scheduler holds its resident caches to that
share of the working set (``working_set_bytes``: every agent's cache at the
length the workload takes it to), evicting saved caches least recently used
first; it samples resident bytes after every step of its worker, and the run
checks the largest sample against the budget. A turn whose cache the budget
already evicted is checked on disk (its manifest's token ids and canaries) instead.

A sample of ``parity_samples`` turns that reused a cache is re-run as a
fresh prefill in an engine of its own: the same greedy tokens and logprobs
within ``tolerance``. The sample is chosen after the run, from submission
indices alone (half on edited turns, the rest spread over the run): the order
in which turns finish depends on thread timing and on how mlx-lm batches
(0.30.4 admits new prompts only once the whole batch has finished), so a
sample chosen as turns finish could come up short.
"""

from __future__ import annotations

import concurrent.futures as cf
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from harness import plots, storefiles
from harness.executors import logprob_diff, make_executor as fresh_executor, open_scheduler
from harness.trials.base import TrialKind, Param, register
from semantic import ModelCacheSpec, Request, cachefile, store as store_mod
from semantic.decode.promptlookup import SpecConfig
from semantic.store.blocklayout import PREFIX

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


def cache_bytes(spec: ModelCacheSpec, tokens: int) -> int:
    """KV bytes of one cache of ``tokens`` tokens (sliding layers hold their window only)."""
    return int(sum(l.token_bytes() * l.tokens_held(tokens) for l in spec.layers))


def working_set_bytes(p: dict, spec: ModelCacheSpec) -> int:
    """Every agent's cache at the length the workload takes it to: the system prefix and canary,
    plus its share of the turns at their mean length, at most ``max_context`` (plus one turn)."""
    per_turn = sum(p["question_tokens"]) / 2 + sum(p["answer_tokens"]) / 2
    grown = p["system_tokens"] + CANARY_LEN + p["requests"] / p["agents"] * per_turn
    return p["agents"] * cache_bytes(spec, int(min(grown, p["max_context"] + per_turn)))


@dataclass(slots=True)
class _Workload:
    """The drawn workload and what the run observed, turn by turn."""

    p: dict
    rng: np.random.Generator
    vocab: int
    system: list[int]
    canaries: dict[str, tuple[int, ...]]
    history: dict[str, list[int] | None]   # None: the agent's next turn is its first
    turns: dict[str, int]
    counts: dict[str, int] = field(default_factory=lambda: {k: 0 for k in COUNTS})
    errors: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    eligible: list[tuple] = field(default_factory=list)  # (index, agent, history, result, edited): parity candidates
    cache_dir: Path | None = None

    @classmethod
    def draw(cls, p: dict, vocab: int) -> "_Workload":
        rng = np.random.default_rng(p["seed"])
        agents = [f"agent-{i:02d}" for i in range(p["agents"])]
        w = cls(p, rng, vocab, [], {a: _canary(i, vocab) for i, a in enumerate(agents)},
                {a: None for a in agents}, {a: 0 for a in agents})
        w.system = w.ids(p["system_tokens"])
        for c in w.canaries.values():
            assert not _contains(tuple(w.system), c) and sum(_contains(c2, c) for c2 in w.canaries.values()) == 1
        return w

    def ids(self, n: int) -> list[int]:
        # token ids, not text: every id is drawn from the vocabulary, so lengths are exact
        return [int(t) for t in self.rng.integers(3, self.vocab - 1, n)]

    def next_turn(self, a: str, sched) -> tuple[list[int], int, bool]:
        """The agent's next history (maybe edited, trimmed, after an eviction), its reply length, edited."""
        p, h, edited = self.p, self.history[a], False
        if h is None:
            h = self.system + list(self.canaries[a])
        elif self.rng.random() < p["edit_prob"] and len(h) > len(self.system) + CANARY_LEN + 2:
            cut = int(self.rng.integers(len(self.system) + CANARY_LEN, len(h)))
            h = h[:cut] + [(h[cut] + 1) % (self.vocab - 4) + 3]  # an earlier message changed; the rest removed
            self.counts["edits"] += 1
            edited = True
        if len(h) > p["max_context"]:  # the client drops the oldest exchange, as chat apps do
            keep = len(self.system) + CANARY_LEN
            h = h[:keep] + h[keep + (len(h) - p["max_context"]) + p["max_context"] // 4:]
        if self.turns[a] and self.rng.random() < p["evict_prob"]:
            ok = sched.evict(a)  # refused while its newest cache is not yet on disk
            self.counts["evictions" if ok else "evict_refused"] += 1
        h = h + self.ids(_draw(self.rng, p["question_tokens"]))
        return h, _draw(self.rng, p["answer_tokens"]), edited

    def finished(self, a: str, h: list[int], index: int, edited: bool, fut: cf.Future, sched) -> None:
        """Check one finished turn: error, stale reuse, leaked canary; keep it as a parity candidate."""
        try:
            r = fut.result()
        except Exception as exc:  # counted, reported, and the run goes on
            self.counts["errors"] += 1
            self.errors.append(f"{a} turn {self.turns[a]}: {type(exc).__name__}: {exc}"[:300])
            return
        full = (*h, *r.token_ids)
        kept = full[:-1] if r.token_ids else full  # the reply's last token is never fed
        if self.turns[a]:
            self.counts["cached_tokens"] += r.cached_tokens
            self.counts["history_tokens"] += r.history_tokens
        self.turns[a] += 1
        self.history[a] = list(full)
        self.latencies.append(r.latency_s * 1e3)
        self.ttfts.append(r.ttft_s * 1e3)
        cache = sched.resident_cache(a)
        held = cache.token_ids if cache is not None else self._file_tokens(a)
        if not r.cache_saved or held is None:
            self.counts["errors"] += 1
            self.errors.append(f"{a}: cache not kept: {r.cache_error}")
            return
        if cache is None:  # the RAM budget evicted it, which it does only once it is on disk
            self.counts["checked_in_file"] += 1
            stale = held != kept
        else:
            stale = held != kept or any(b.token_ids != kept[b.start:b.end] for b in cache.unique_blocks())
        self.counts["stale"] += stale
        self.counts["leaks"] += any(_contains(held, c) for o, c in self.canaries.items() if o != a)
        if r.cached_tokens or self.p["parity_every_turn"]:  # a turn that reused nothing was a fresh prefill already
            # int32: every eligible history is kept until the run ends (1000 turns of up to max_context)
            self.eligible.append((index, a, np.asarray(h, np.int32), r, edited))


    def _file_tokens(self, a: str) -> tuple[int, ...] | None:
        """The token ids of the agent's cache on disk (its manifest; a cache file in the single-file layout),
        None without one."""
        m = storefiles.read_manifest(self.cache_dir / store_mod.manifest_name(a))
        if m is not None:
            return m.token_ids
        try:
            return tuple(cachefile.read_header(self.cache_dir / store_mod.file_name(a)).token_ids)
        except FileNotFoundError:
            return None


COUNTS = ("errors", "stale", "leaks", "edits", "evictions", "evict_refused", "parity_checked",
          "parity_edited", "parity_failed", "cached_tokens", "history_tokens", "checked_in_file")


def _drive(w: _Workload, sched, progress) -> int:
    """Submit turns in random agent order, up to ``concurrency`` in flight, until all are answered."""
    p, agents = w.p, list(w.history)
    outstanding: dict[cf.Future, tuple[str, list[int], int, bool]] = {}
    submitted = done = 0
    while done < p["requests"]:
        idle = [a for a in agents if a not in {v[0] for v in outstanding.values()}]
        while len(outstanding) < p["concurrency"] and submitted < p["requests"] and idle:
            a = idle.pop(int(w.rng.integers(len(idle))))
            h, max_tokens, edited = w.next_turn(a, sched)
            outstanding[sched.submit(Request(a, h, max_tokens), timeout=None)] = (a, h, submitted, edited)
            submitted += 1
        finished, _ = cf.wait(list(outstanding), return_when=cf.FIRST_COMPLETED)
        for fut in finished:
            a, h, index, edited = outstanding.pop(fut)
            done += 1
            progress.update(1)
            w.finished(a, h, index, edited, fut, sched)
    return done


def run(ctx) -> None:
    p, loaded = ctx.params, ctx.loaded
    w = _Workload.draw(p, min(loaded.tokenizer.vocab_size, 30_000))
    ctx.progress.total = p["requests"]
    cache_dir = w.cache_dir = Path(tempfile.mkdtemp(prefix="exp008-"))
    working_set = working_set_bytes(p, ModelCacheSpec.from_model(loaded.model))
    budget = int(p["ram_budget"] * working_set) if p["ram_budget"] else None
    sched = open_scheduler(loaded, cache_dir, p["pool_blocks"], max_batch=p["concurrency"],
                           block_tokens=p["block_tokens"], ram_budget_bytes=budget,
                           speculation=SpecConfig(position_cost=p["spec_position_cost"]) if p["speculation"] else None)
    t_start = time.perf_counter()
    try:
        done = _drive(w, sched, ctx.progress)
        wall_s = time.perf_counter() - t_start
        sched.flush()
        w.counts["leaks"] += _file_leaks(cache_dir, w.canaries)
        stats, store_stats = sched.stats(), sched.store.stats()
        spec_steps, drafted, accepted = sched.executor.speculation
    finally:
        sched.close()
        shutil.rmtree(cache_dir, ignore_errors=True)
    # after the run, on this thread alone: the checks neither slow the run nor depend on its timing
    parity, max_diff = _parity_checks(loaded, w)
    _record(ctx, w, parity, max_diff, done, wall_s, stats, store_stats)
    _record_budget(ctx, stats, budget, working_set)
    ctx.results.output("speculation", {"on": p["speculation"], "steps": spec_steps, "drafted": drafted,
                                       "accepted": accepted})
    ctx.results.check("spec_accepted", accepted)


def _record_budget(ctx, stats, budget: int | None, working_set: int) -> None:
    """Resident bytes against the RAM budget (the scheduler samples them after every step)."""
    res = ctx.results
    within = budget is None or (stats.resident_peak_bytes <= budget and stats.over_budget_steps == 0)
    res.output("ram", {
        "budget_bytes": budget, "working_set_bytes": working_set, "budget_share": ctx.params["ram_budget"],
        "max_resident_bytes": stats.resident_peak_bytes, "steps_sampled": stats.steps,
        "budget_evictions": stats.budget_evictions, "budget_waits": stats.budget_waits,
        "budget_wait_s": stats.budget_wait_s, "over_budget_steps": stats.over_budget_steps,
        "over_budget_reason": stats.over_budget_reason,
    })
    res.check("max_resident_bytes", stats.resident_peak_bytes)
    res.check("ram_budget_bytes", budget if budget is not None else 0)
    res.check("resident_within_budget", within)
    res.check("budget_evictions", stats.budget_evictions)
    res.check("ram_budget_binds", budget is None or stats.budget_evictions > 0)  # true when no budget is set


def _parity_checks(loaded, w: _Workload) -> tuple[list[dict], float]:
    fresh = fresh_executor(loaded, w.p["pool_blocks"])
    parity, max_diff = [], 0.0
    n = len(w.eligible) if w.p["parity_every_turn"] else w.p["parity_samples"]
    for index, a, h, r, edited in _choose_parity(w.eligible, n):
        ok, diff = _parity(fresh, h.tolist(), r, w.p["tolerance"])
        w.counts["parity_checked"] += 1
        w.counts["parity_edited"] += edited
        w.counts["parity_failed"] += not ok
        max_diff = max(max_diff, diff)
        parity.append({"agent": a, "edited": edited, "history_tokens": len(h), "cached_tokens": r.cached_tokens,
                       "reuse": r.reuse, "match": ok, "max_abs_logprob_diff": diff})
    return parity, max_diff


def _record(ctx, w: _Workload, parity, max_diff, done, wall_s, stats, store_stats) -> None:
    res, counts = ctx.results, w.counts
    res.output("counts", counts)
    res.output("errors", w.errors[:50])
    res.output("parity", parity)
    res.output("scheduler", {f: getattr(stats, f) for f in stats.__slots__})
    res.output("store", {f: getattr(store_stats, f) for f in store_stats.__slots__})
    res.metric("latency_ms", w.latencies, "ms", description="submit to finished, per request (queueing included)")
    res.metric("ttft_ms", w.ttfts, "ms", description="submit to first token, per request (queueing included)")
    hit = counts["cached_tokens"] / counts["history_tokens"] if counts["history_tokens"] else 0.0
    for key in ("errors", "stale", "leaks", "edits", "evictions", "parity_checked", "parity_failed"):
        res.check(key, counts[key])
    res.check("requests", done)
    res.check("all_requests_answered", done == w.p["requests"] and counts["errors"] == 0)
    res.check("token_hit_rate", hit)
    res.check("disk_reloads", store_stats.disk_hits)
    res.check("max_abs_logprob_diff", max_diff)
    res.check("requests_per_s", done / wall_s)
    if "latency_cdf" in ctx.config.plots:
        ctx.plots.append(plots.cdf_plot({"latency": w.latencies, "time to first token": w.ttfts},
                                        ctx.plot_path("latency-cdf"), "ms (queueing included)",
                                        f"EXP-008 {ctx.model_name}: {done} requests, {len(w.history)} agents"))


def _choose_parity(eligible: list[tuple], n: int) -> list[tuple]:
    """``n`` of the eligible turns (fewer only if fewer are eligible), by submission index alone.

    Half on edited turns (where a stale reuse would show), spread over them;
    the rest spread evenly over the run among the turns not yet chosen, so a
    short group is topped up from the other. Positions ``(k + 1/2) * len / m``
    are distinct whenever ``len >= m``: the count never depends on the schedule.
    """
    def spread(turns, m):
        m = min(m, len(turns))
        return [turns[int((k + 0.5) * len(turns) / m)] for k in range(m)]

    turns = sorted(eligible, key=lambda t: t[0])
    chosen = spread([t for t in turns if t[4]], n // 2)
    picked = {t[0] for t in chosen}
    chosen += spread([t for t in turns if t[0] not in picked], n - len(chosen))
    return sorted(chosen, key=lambda t: t[0])


def _parity(executor, h: list[int], r, tol: float) -> tuple[bool, float]:
    """The turn again as a fresh prefill in an engine of its own."""
    uid = executor.submit(Request("parity", h, len(r.token_ids)), share=False)
    ref = {c.uid: c for c in executor.step()}[uid]
    if ref.blocks is not None:
        ref.blocks.release()
    diff = logprob_diff(ref.logprobs, r.logprobs)
    return list(r.token_ids) == ref.token_ids and diff <= tol, diff


def _file_leaks(cache_dir: Path, canaries: dict) -> int:
    """Manifests (cache files, in the single-file layout) whose token ids hold another agent's canary, or
    that name the wrong agent; a manifest that does not parse counts too. A prefix entry (``~prefix/``:
    a window's earlier prefix, keyed by content) belongs to no agent: it leaks when it holds two canaries."""
    owned = [(path, storefiles.read_manifest(path), store_mod.manifest_name) for path in storefiles.manifests(cache_dir)]
    owned += [(path, cachefile.read_header(path), store_mod.file_name) for path in storefiles.single_files(cache_dir)]
    leaks = 0
    for path, doc, name_of in owned:
        if doc is None:
            leaks += 1
            continue
        own = doc.agent_id
        leaks += path.name != name_of(own)
        if own.startswith(PREFIX):  # a prefix kept apart (a sliding window's), no agent's: one history at most
            leaks += sum(_contains(tuple(doc.token_ids), c) for c in canaries.values()) > 1
            continue
        leaks += any(_contains(tuple(doc.token_ids), c) for a, c in canaries.items() if a != own)
    return leaks


def _validate(p: dict) -> None:
    if p["max_context"] <= p["system_tokens"] + CANARY_LEN + p["question_tokens"][1] + p["answer_tokens"][1]:
        raise ValueError("max_context must leave room for a turn after the system prefix")


KIND = register(TrialKind(
    name="stress",
    run=run,
    params={
        "requests": Param(int, 1000, "turns in all", min=1),
        "agents": Param(int, 16, "agents the turns are spread over, in random order", min=2),
        "concurrency": Param(int, 8, "turns in flight at once (also the batch size)", min=1),
        "system_tokens": Param(int, 64, "a prefix every agent's history starts with"),
        "question_tokens": Param(list, [4, 48], "new tokens per turn, [low, high]", pair=True, min=1),
        "answer_tokens": Param(list, [1, 8], "generated tokens per turn, [low, high]", pair=True, min=1),
        "edit_prob": Param(float, 0.05, "chance a turn edits the conversation first", min=0, max=1),
        "evict_prob": Param(float, 0.05, "chance an agent is evicted to disk before its turn", min=0, max=1),
        "max_context": Param(int, 1024, "history length at which the oldest exchange is dropped"),
        "parity_samples": Param(int, 20, "turns re-run as a fresh prefill and compared"),
        "parity_every_turn": Param(bool, False, "re-run every turn instead (a cold one too), not a sample"),
        "speculation": Param(bool, False, "greedy turns draft tokens from their context (semantic.decode.promptlookup); the "
                                          "fresh prefill that checks them never does"),
        "spec_position_cost": Param(float, 0.15, "what one more drafted position costs a step (0: every match is "
                                                 "drafted in full, so short runs exercise speculation)"),
        "tolerance": Param(float, 1e-4, "largest logprob difference a parity check allows"),
        "pool_blocks": Param(int, 1024, "blocks in the pool"),
        "block_tokens": Param(int, 256, "tokens per block (small blocks exercise more sharing and cutting)"),
        "seed": Param(int, 0, "random seed of the workload"),
        "ram_budget": Param(float, 0.0, "RAM budget for resident caches, as a share of the working set "
                            "(every agent's cache at the length the workload takes it to); 0: none", min=0, max=1),
    },
    plots=frozenset({"latency_cdf"}),
    needs_model=True,
    validate=_validate,
    trial_code=(_Workload, _drive, _choose_parity, _parity, _file_leaks, _contains, working_set_bytes,
                _record_budget),
))
