"""Continuous batching with pooled caches in and out.

Every sequence runs through one :class:`~semantic.runner.steploop.StepLoop`: each
step decodes one token for every generating sequence in one forward pass
(``KVCache``, ``RotatingKVCache`` and ``QuantizedKVCache`` layers alike; the
quantized ones through ``batchquant``), then prefills one chunk: the
largest one when nothing decodes, else ``prefill_chunk`` tokens or what
holds ``itl_target_s`` (``semantic.runner.stepbudget``). A long prompt therefore
delays the others by one chunk per step, never by its whole prefill. On sliding-window models
the blocks each chunk's window passed are pooled after it (:meth:`BatchExecutor._keep`); on
models with layers that resume only from snapshots, chunks also end where those are kept
(:meth:`BatchExecutor._checkpoint`).

A :class:`~semantic.request.Request` carries the agent's whole history and
everything else the executor reads: it decodes greedily unless its sampling
says otherwise (greedy rows share one argmax), its ``on_token`` sees every
token as it is read and may end it there (a stop string), and
:meth:`BatchExecutor.cancel` ends one from outside. A sequence ended
early keeps the cache of exactly the tokens it computed. A finished
sequence's Completion comes one step after its last token, once that token is
fed and the cache extracted; ``on_ended`` hears of the turn sooner, as soon as
that last token is read (a Completion without blocks), so a caller can answer
its client without waiting for the cache.

:meth:`BatchExecutor.submit` starts a request from the longest prefix
its agent's previous cache or the pool covers (``reuse``), so only the rest
is prefilled. Each agent has at most one request in flight; a second submit
raises :class:`AgentBusyError` (queueing belongs to ``scheduler``).

Threads: the executor itself is driven by one thread. Its pool may be shared
(with an ``AgentCacheStore``); every pool use here, and every release of the
AgentBlocks it returns, holds ``lock``.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import mlx.core as mx
from semantic.runner import batchprobe
from semantic import compat, cpuattention, defaults, kinds
from semantic.modelconfig import ModelConfig
from semantic.cache.blocks import AgentBlocks
from semantic.cache.manager import CacheManager, Loan, turn_room
from semantic.runner.stepbudget import StepBudget
from semantic.decode.constraint import Constraint
from semantic.errors import (
    AgentBusyError,
    PoolExhaustedError,
    CacheError,
    InvalidRequestError,
    UnknownSequenceError,
)
from semantic.decode.promptlookup import SpecConfig
from semantic.cache.pool import BlockPool
from semantic.request import Completion, Request
from semantic.cache.spec import ModelCacheSpec
from semantic.runner.steploop import StepLoop

log = logging.getLogger(__name__)



@dataclass(slots=True)
class _InFlight:
    """A request the executor is running: what it started from and what it generated so far."""

    uid: int
    request: Request
    cached: int                          # history tokens a cache covered
    reuse: str
    admitted_at: float
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    first_token_at: float = 0.0
    finish_reason: str | None = None     # set with the last token; the Completion follows when the cache is complete
    kept: list = field(default_factory=list)  # AgentBlocks of earlier snapshots its finished cache carries
    loan: Loan = field(default_factory=Loan)  # the pool's buffers its caches came from (lending.Loan)


class BatchExecutor:
    """Runs agents' requests in one continuous batch and stores their caches in ``pool``."""

    def __init__(
        self,
        model,
        tokenizer,
        pool: BlockPool,
        spec: ModelCacheSpec,
        *,
        max_batch: int = defaults.MAX_BATCH,
        prefill_chunk: int | None = None,
        itl_target_s: float | None = None,
        stop_tokens: Sequence[int] | None = None,
        lock=None,
        speculation: SpecConfig | None = None,
        on_ended: Callable[[Completion], None] | None = None,
        probe_memo: Path | None = None,
    ):
        spec.require_same(pool.spec, "the pool")
        quant = next((l for l in spec.layers if l.kv_bits), None)
        probe = ModelCacheSpec.from_model(
            model, kv_bits=quant.kv_bits if quant else None, kv_group_size=quant.kv_group_size if quant else 64
        )
        spec.require_same(probe, "the spec")
        cpuattention.install()  # MLX's attention unless on the CPU in float32, where its softmax is the slow part
        self.model, self.tokenizer, self.pool, self.spec = model, tokenizer, pool, spec
        self.lock = lock if lock is not None else threading.RLock()
        self.cache_manager = CacheManager(pool, spec, self.lock)  # every pool and cache-object move goes through it
        # sliding layers lose the window of a prefix once prefill moves past it: see _keep
        self._positions = self.cache_manager.positions
        self.takes_snapshots = self._positions.required  # some layers resume only from a snapshot
        self._snapshot_groups = self.cache_manager.snapshot_groups
        # a window of a block or more keeps only its history's end in an agent's file: the system prompt's
        # cache is saved on its own (``Scheduler._keep_prefix``)
        self.keeps_prefixes = self._positions.windows
        self.wants_boundaries = self.takes_snapshots or self.keeps_prefixes  # requests should bring their boundaries
        used = sorted({kinds.of(l) for l in spec.layers}, key=lambda k: k.name)
        if any(not k.batches for k in used):  # mlx-lm has no batched form of these caches
            self.batch_off = f"{' and '.join(k.name for k in used if not k.batches)} layers have no batch form"
        else:
            self.batch_off = batchprobe.remembered(model, spec, probe_memo) if max_batch > 1 else None
        if self.batch_off is not None:
            log.info("one sequence at a time: %s", self.batch_off)
            max_batch = 1
        # a batch's rows in their own buffers (no merge copies) where the model's code takes them
        self.rows_off = self._why_rows_merge(model, spec, used, probe_memo)
        if self.rows_off is not None:
            log.info("batches merge their rows: %s", self.rows_off)
        self.speculation_off = self._why_no_speculation(model, spec, used, probe_memo, speculation is not None)
        if speculation is not None and self.speculation_off is not None:
            log.info("speculation is off: %s", self.speculation_off)
            speculation = None
        self.vocab_size = vocab_size(model)
        self.stop_tokens = frozenset(int(t) for t in (tokenizer.eos_token_ids if stop_tokens is None else stop_tokens))
        budget = StepBudget(defaults.prefill_chunk(), itl_target_s=itl_target_s, fixed=prefill_chunk)
        self._loop = StepLoop(model, stop_tokens=self.stop_tokens, max_batch=max_batch, prefill_chunk=budget,
                              speculation=speculation, single=self.batch_off is not None,
                              rows=self.rows_off is None)
        self._uids = itertools.count()
        self._seqs: dict[int, _InFlight] = {}
        self._by_agent: dict[str, int] = {}  # agent id -> its uid in flight
        self._finished: weakref.WeakValueDictionary[int, AgentBlocks] = weakref.WeakValueDictionary()
        self.on_ended = on_ended

    def _why_rows_merge(self, model, spec, used, probe_memo) -> str | None:
        """Why the batch's global-attention rows merge into one tensor rather than stay each in its own
        buffers (``kinds.rows``), or None."""
        if self.batch_off is not None:
            return f"one sequence at a time: {self.batch_off}"
        if not any(kinds.of(layer).keeps_rows(layer) for layer in spec.layers):
            return "no layer keeps its rows apart"
        return batchprobe.remembered(model, spec, probe_memo, batchprobe.rows_problem)

    def _why_no_speculation(self, model, spec, used, probe_memo, asked: bool) -> str | None:
        """Why greedy turns of this model cannot draft, or None: every kind of layer takes rejected drafts
        back (rewind.py) or is put back and replayed (replay.py), in a batch, by code that honours the
        recurrent rows' lengths (probed only when ``asked``: a model is not run for a setting that is off)."""
        stuck = [k.no_speculation or f"{k.name} layers can neither rewind nor replay" for k in used
                 if k.no_speculation or not (k.rewinds or k.replays)]
        if stuck:
            return "; ".join(stuck)
        if self.batch_off is not None:  # drafts are taken back out of batch caches only
            return f"one sequence at a time: {self.batch_off}"
        if asked and any(k.replays for k in used):
            return batchprobe.remembered(model, spec, probe_memo, batchprobe.replay_problem)
        return None

    # ------------------------------------------------------------ requests

    def submit(self, request: Request, own: AgentBlocks | None = None, *, share: bool = True) -> int:
        """Start ``request`` and return its uid.

        It starts from the longest prefix of its history that ``own`` (the
        agent's previous cache, which may have diverged: an edited
        conversation) or, with ``share``, any pooled block covers (another
        agent's shared system prompt, an earlier branch), as
        ``CacheManager.start`` decides; the rest is prefilled. ``own`` is
        only read; the caller keeps its reference. ``share=False`` with no
        ``own`` is a fresh prefill. Nothing changes in the executor when this raises.

        Raises:
            AgentBusyError: the agent has a request in flight here.
            InvalidRequestError: an id outside the model's vocabulary, the
                one fact a request cannot check itself.
            CacheMismatchError: ``own`` is of another model or spec.
            InvalidRequestError: also a grammar llguidance cannot use with this tokenizer.
        """
        if not isinstance(request, Request):
            raise TypeError(f"submit takes a semantic.Request, got {type(request).__name__}")
        if request.agent_id in self._by_agent:
            raise AgentBusyError(f"agent {request.agent_id!r} already has request {self._by_agent[request.agent_id]} in flight")
        if max(request.ids) >= self.vocab_size:
            bad = [t for t in request.ids if t >= self.vocab_size][:5]
            raise InvalidRequestError(f"token ids outside the vocabulary [0, {self.vocab_size}): {bad}")
        if own is not None:
            if not isinstance(own, AgentBlocks):
                raise InvalidRequestError(f"own must be AgentBlocks, got {type(own).__name__}")
            self.spec.require_same(own.spec, "this cache")
        constraint = Constraint(request.grammar, self.tokenizer, self.vocab_size) if request.grammar else None
        admitted = time.perf_counter()
        ids = request.ids
        start = self.cache_manager.start(ids, own, request.salt_root, share)
        fed = start.cached
        seq = _InFlight(next(self._uids), request, start.cached, start.source, admitted)
        carried = self._positions.carried(fed, len(ids), request.boundaries)
        caches = None
        if start.cached:
            try:
                caches = self.cache_manager.rebuild(start.blocks, upto=start.cached, room=turn_room(len(ids) - start.cached),
                                                    loan=seq.loan)
                self._carry(seq, ids, [p for p in carried if p <= fed])
            finally:
                if start.owned:
                    # the rebuilt caches hold the arrays; the pool references can go at once
                    start.blocks.release()
        snapshot_at = [p - fed for p in self._positions.taken(fed, len(ids), request.boundaries)]
        self._loop.add(
            seq.uid, request, fed, caches if caches is not None else self.cache_manager.fresh(turn_room(len(ids))),
            snapshot_at=snapshot_at,
            on_snapshot=lambda uid, live, n: self._checkpoint(live, ids[: fed + n], request.salt_root,
                                                          seq if fed + n in carried else None),
            on_chunk=(lambda uid, live, a, b: self._keep(live, ids, fed, a, b, request.salt_root))
            if self._positions.windows else None,
            constraint=constraint,
        )
        self._seqs[seq.uid] = seq
        self._by_agent[request.agent_id] = seq.uid
        return seq.uid

    def _carry(self, seq: _InFlight, ids: Sequence[int], at: Sequence[int]) -> None:
        """Hold the pooled snapshots of ``ids`` at positions ``at`` (where this turn resumed, its boundaries
        before that: the agent's own, or any agent's) for ``seq``'s finished cache to carry
        (``SnapshotPositions.carried``)."""
        kept = self.cache_manager.carry(ids, at, seq.request.salt_root)
        if kept is not None:
            seq.kept.append(kept)

    def _keep(self, caches: list, ids: Sequence[int], fed: int, start: int, end: int, salt_root: int | None) -> None:
        """Pool what a sliding window held at each block boundary a prefill chunk (prompt tokens
        ``[start, end)``, counted from ``fed``) reached.

        A sliding layer keeps only its window, so a finished cache no longer
        holds the window that ended at an earlier boundary, and no other
        agent could start from that prefix (a shared system prompt). Right after a chunk,
        the cache still holds the ``window - 1`` positions before it as well, so every
        window inside the chunk is there; its blocks are copied once, and the prefill
        keeps the chunks a global-attention model uses::

            prefill    [0 ........................................ 900)   one chunk
            keep       the windows at 256, 512, 768 (window 512): blocks [0, 256) ... [512, 768)
                       and the global layers' blocks up to 768, as stopping there would have

        The blocks are released at once: they stay hittable in the pool's free queue until it
        recycles them. A full pool skips them.
        """
        ends = self._positions.passed(fed, len(ids), fed + start, fed + end)
        if not ends:
            return
        try:
            self.cache_manager.keep_passed(caches, ids[: fed + end], ends, salt_root)
        except PoolExhaustedError:
            log.debug("pool full: the blocks before %d tokens are not kept", fed + end)

    def _checkpoint(self, caches: list, ids: list[int], salt_root: int | None, keep: _InFlight | None = None) -> None:
        """Pool the whole cache of a prompt cut where a snapshot is kept (``ids`` ends there: ``snapshots``).

        The blocks are released at once: they stay hittable in the pool's
        free queue until it recycles them; with ``keep``, that sequence holds them
        until its finished cache takes their snapshots (``_finish``). A full pool
        skips the checkpoint.
        """
        try:
            blocks = self.cache_manager.extract(caches, ids, salt_root)
            if keep is not None and self.takes_snapshots:
                keep.kept.append(blocks)
            else:
                blocks.release()
        except PoolExhaustedError:
            log.debug("pool full: no checkpoint at %d tokens", len(ids))

    # ------------------------------------------------------------ driving

    def cached_tokens(self, uid: int) -> int:
        """How many tokens of in-flight sequence ``uid``'s history came from a cache."""
        seq = self._seqs.get(uid)
        if seq is None:
            raise UnknownSequenceError(f"no sequence {uid} in flight")
        return seq.cached

    @property
    def speculation(self) -> tuple[int, int, int]:
        """Speculative decode steps, tokens drafted, and drafted tokens accepted, since this executor started."""
        loop = self._loop
        return loop.spec_steps, loop.drafted, loop.accepted

    @property
    def replays(self) -> tuple[int, int]:
        """Replay passes that put recurrent rows back after a refused draft, and the tokens they fed again."""
        return self._loop.replays, self._loop.replayed

    @property
    def speculating(self) -> bool:
        """Whether greedy sequences may draft (on, and nothing in ``speculation_off``)."""
        return self._loop.speculation is not None

    @property
    def prefill_chunk(self) -> int:
        """Prompt tokens a step feeds while nothing decodes: what a lone turn's prefill steps by."""
        return self._loop.budget.tokens(False)

    @property
    def in_flight(self) -> int:
        return len(self._seqs)

    def step(self) -> Iterator[Completion]:
        """Run until no request is in flight, yielding each as it finishes."""
        while self._seqs:
            yield from self.step_once()

    def step_once(self) -> list[Completion]:
        """One step of the loop: a token for every generating request, one
        prefill chunk for the waiting ones; return those that finished."""
        events = self._loop.step()
        now = time.perf_counter()  # the tokens were read: materialized
        cut: set[int] = set()  # a stop string ended these: a speculative step's later tokens are not theirs
        finished = []
        for e in events:
            if e.uid in cut:
                continue
            seq = self._seqs[e.uid]
            seq.first_token_at = seq.first_token_at or now
            seq.finish_reason = e.finish_reason
            if self._record(seq, e.token, e.logprobs) and e.finish_reason is None:
                seq.finish_reason = "stop"  # a stop string: ends after this token, like a stop token
                cut.add(e.uid)
            if seq.finish_reason is not None:
                finished.append(seq)
        if self.on_ended is not None:
            for seq in finished:
                self._announce(seq, now)
        # the last token is never fed: the cache ends before it, where a template that renders the
        # history without a stop token resumes too
        closed = self._loop.finish([(seq.uid, len(seq.generated)) for seq in finished])
        return [self._finish(self._seqs[c.uid], self._seqs[c.uid].finish_reason, c.caches, c.held) for c in closed]

    def _announce(self, seq: _InFlight, now: float) -> None:
        """Tell ``on_ended`` that ``seq``'s tokens are final: a Completion without blocks, before its cache is."""
        c = self._completion(seq, seq.finish_reason, None, None, now)
        try:
            self.on_ended(c)
        except Exception:  # the caller's bug: the turn's Completion still follows
            log.exception("on_ended of agent %r raised", seq.request.agent_id)

    def _record(self, seq: _InFlight, token: int, logprobs: mx.array) -> bool:
        """Keep one generated token; True when its callback ends the sequence here."""
        seq.generated.append(token)
        logprob = logprobs[token].item()
        seq.logprobs.append(logprob)
        on_token = seq.request.on_token
        if on_token is None:
            return False
        try:
            return bool(on_token(token, logprob, logprobs))
        except Exception:  # one caller's bug must not fail the whole batch: end its sequence only
            log.exception("on_token of agent %r raised; ending its sequence", seq.request.agent_id)
            return True

    def cancel(self, uid: int) -> Completion | None:
        """End sequence ``uid`` now (its client went away); None if it is not in flight.

        The Completion's ``finish_reason`` is "cancelled" and its blocks hold
        the cache of exactly the tokens computed so far, or are None when it
        had not produced a token yet (a cache mid-prefill is not kept).
        """
        seq = self._seqs.get(uid)
        return None if seq is None else self._end_early(seq, "cancelled")

    def _end_early(self, seq: _InFlight, reason: str) -> Completion:
        """Take a sequence out of its lane before it finished on its own."""
        # only past prefill is there an exact cache of its tokens (None before)
        held = self._loop.held(seq.uid)
        return self._finish(seq, reason, self._loop.remove(seq.uid), held)

    def _finish(self, seq: _InFlight, reason: str, caches: list | None, held: int | None = None) -> Completion:
        del self._seqs[seq.uid]
        self._by_agent.pop(seq.request.agent_id, None)
        blocks, error = None, None
        try:
            if caches is None:
                raise CacheError("ended before its first token: no exact cache to keep")
            earlier = [b for kept in seq.kept for g in self._snapshot_groups for b in kept.groups[g]]
            blocks = self.cache_manager.extract(caches, self._held(seq, caches, held), seq.request.salt_root, earlier,
                                                loan=seq.loan)
            self._finished[seq.uid] = blocks
        except CacheError as exc:
            error = f"{type(exc).__name__}: {exc}"
        finally:
            self.cache_manager.give_back(seq.loan)
            for kept in seq.kept:
                kept.release()
        return self._completion(seq, reason, blocks, error, time.perf_counter())

    def _completion(self, seq: _InFlight, reason: str, blocks: AgentBlocks | None, error: str | None,
                    finished_at: float) -> Completion:
        return Completion(
            request=seq.request, uid=seq.uid, token_ids=list(seq.generated), logprobs=list(seq.logprobs),
            finish_reason=reason, cached_tokens=seq.cached, reuse=seq.reuse, blocks=blocks, cache_error=error,
            admitted_at=seq.admitted_at, first_token_at=seq.first_token_at, finished_at=finished_at,
            decode=self.tokenizer.decode,
        )

    @staticmethod
    def _held(seq: _InFlight, caches: list, held: int | None = None) -> list[int]:
        """The tokens ``caches`` hold: the history and every generated token but the newest, unless it was fed
        too (``held``: how many, when the loop said; else a positional layer's offset, else all of them)."""
        n = compat.cache_offset(caches) if held is None else held
        tokens = [*seq.request.ids, *seq.generated]
        return tokens if n is None else tokens[:n]

    # ------------------------------------------------------------ caches

    def pooled(self, ids: Sequence[int], salt_root: int | None = None) -> AgentBlocks | None:
        """The cache of ``ids`` made of pooled blocks alone (new references the caller owns), or None when
        the pool lacks one of them or cannot take back the cached ones."""
        return self.cache_manager.pooled(ids, salt_root)

    def reconstruct_cache(self, blocks: AgentBlocks, materialize: bool = True, upto: int | None = None,
                          room: int = 0) -> list:
        """Real mlx-lm cache objects, one per layer, for ``blocks`` (its first ``upto`` tokens), with ``room``
        spare slots where a layer's kind takes them."""
        return self.cache_manager.rebuild(blocks, materialize=materialize, upto=upto, room=room)

    def extract_cache(self, uid: int) -> AgentBlocks:
        """The cache of a sequence as AgentBlocks.

        In flight: a new AgentBlocks for the tokens processed so far (the
        caller owns it). Finished: the Completion's blocks, while they live.
        """
        seq = self._seqs.get(uid)
        if seq is None:
            blocks = self._finished.get(uid)
            if blocks is None or blocks.released:
                raise UnknownSequenceError(f"no sequence {uid} in flight or finished with live blocks")
            return blocks
        caches = self._loop.caches(uid)
        return self.cache_manager.extract(caches, self._held(seq, caches, self._loop.held(uid)), seq.request.salt_root)


def vocab_size(model) -> int:
    """The model's vocabulary size: its config's (a multimodal wrapper's text config's), else the
    width of its logits for one token."""
    return ModelConfig.of_model(model).vocab or int(model(mx.array([[0]])).shape[-1])
