"""Continuous batching with pooled caches in and out.

Every sequence runs through one :class:`~semantic.steploop.StepLoop`: each
step decodes one token for every generating sequence in one forward pass
(``KVCache``, ``RotatingKVCache`` and ``QuantizedKVCache`` layers alike; the
quantized ones through ``batchquant``), then prefills one chunk of at most
``prefill_chunk`` prompt tokens. A long prompt therefore delays the others
by one chunk per step, never by its whole prefill. On sliding-window models
every prompt's chunks also end at block boundaries, where the cache is
extracted into the pool (:meth:`BlockPoolBatchEngine._checkpoint`).

Each sequence decodes greedily unless it brings its own sampler and logits
processors (``sampling``); greedy ones share one argmax. An ``on_token``
callback sees every token as it is read, and may end its sequence there (a
stop string); :meth:`BlockPoolBatchEngine.cancel` ends one from outside. A
sequence ended early keeps the cache of exactly the tokens it computed.

A request given a cache prefills only the tokens the cache does not cover.
:meth:`BlockPoolBatchEngine.submit_history` takes an agent's whole history
and starts from the longest prefix its previous cache or the pool covers
(``reuse``). Each agent has at most one request in flight; a second submit
raises :class:`AgentBusyError` (queueing belongs to ``scheduler``).

Threads: the engine itself is driven by one thread. Its pool may be shared
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
from typing import Callable, Iterator, Sequence

import mlx.core as mx
from semantic import compat, convert, reuse
from semantic.blocks import AgentBlocks
from semantic.errors import (
    AgentBusyError,
    PoolExhaustedError,
    CacheError,
    InvalidRequestError,
    UnknownSequenceError,
)
from semantic.pool import BlockPool
from semantic.requests import check_max_tokens, prompt_ids
from semantic.sampling import SamplingParams, processors_for, sampler_for
from semantic.spec import ModelCacheSpec
from semantic.steploop import StepLoop

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Completion:
    """A finished request. ``blocks`` is None only when storing the cache
    failed (``cache_error`` says why); the generated tokens are kept."""

    uid: int
    agent_id: str
    token_ids: list[int]       # generated tokens, the stop token included
    text: str
    finish_reason: str         # "stop", "length", or "cancelled"
    blocks: AgentBlocks | None
    logprobs: list[float]      # natural-log probability of each generated token
    prompt_tokens: int         # tokens prefilled for this request
    cached_tokens: int         # tokens the injected cache already covered
    cache_error: str | None = None
    reuse: str = reuse.NONE    # where the cached tokens came from (see ``reuse``)
    submitted_at: float = 0.0  # time.perf_counter() at submit
    first_token_at: float = 0.0  # ... when the first generated token was read (materialized)
    finished_at: float = 0.0   # ... when the sequence finished, its cache extracted

    @property
    def ttft_s(self) -> float:
        """Seconds from submit to the first generated token."""
        return self.first_token_at - self.submitted_at

    @property
    def decode_tokens_per_s(self) -> float:
        """Generated tokens after the first, per second of decoding (0 for one token)."""
        dt = self.finished_at - self.first_token_at
        return (len(self.token_ids) - 1) / dt if len(self.token_ids) > 1 and dt > 0 else 0.0


@dataclass(slots=True)
class _Seq:
    uid: int
    agent_id: str
    tokens: list[int]          # cached + new prompt tokens
    cached: int
    max_tokens: int
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    reuse: str = reuse.NONE
    submitted_at: float = 0.0
    first_token_at: float = 0.0
    salt_root: int | None = None              # block-hash salt (a tenant's)
    finish_reason: str | None = None     # set with the last token; the Completion follows when the cache is complete
    on_token: Callable | None = None     # (token, logprob, logprobs row) -> True to end here


# on_token(token, logprob, logprobs) -> bool: called on the engine's thread for
# every generated token; logprobs is the row over the vocabulary (an mx.array)
OnToken = Callable[[int, float, mx.array], bool]


class BlockPoolBatchEngine:
    """Runs agents' requests in one continuous batch and stores their caches in ``pool``."""

    def __init__(
        self,
        model,
        tokenizer,
        pool: BlockPool,
        spec: ModelCacheSpec,
        *,
        max_batch: int = 8,
        prefill_chunk: int | None = None,
        stop_tokens: Sequence[int] | None = None,
        lock=None,
    ):
        spec.require_same(pool.spec, "the pool")
        quant = next((l for l in spec.layers if l.kv_bits), None)
        probe = ModelCacheSpec.from_model(
            model, kv_bits=quant.kv_bits if quant else None, kv_group_size=quant.kv_group_size if quant else 64
        )
        spec.require_same(probe, "the spec")
        self.model, self.tokenizer, self.pool, self.spec = model, tokenizer, pool, spec
        self.lock = lock if lock is not None else threading.RLock()
        # sliding layers lose the window of a prefix once prefill moves past it: see _checkpoint
        self._sliding = any(l.windowed for l in spec.layers)
        self.vocab_size = _vocab_size(model)
        self.stop_tokens = frozenset(int(t) for t in (tokenizer.eos_token_ids if stop_tokens is None else stop_tokens))
        self.prefill_chunk = prefill_chunk if prefill_chunk is not None else default_prefill_chunk()
        self._loop = StepLoop(model, stop_tokens=self.stop_tokens, max_batch=max_batch, prefill_chunk=self.prefill_chunk)
        self._uids = itertools.count()
        self._seqs: dict[int, _Seq] = {}
        self._busy: dict[str, int] = {}
        self._finished: weakref.WeakValueDictionary[int, AgentBlocks] = weakref.WeakValueDictionary()

    # ------------------------------------------------------------ requests

    def _check_request(self, agent_id: str, max_tokens: int) -> None:
        if not isinstance(agent_id, str) or not agent_id:
            raise InvalidRequestError(f"agent_id must be a non-empty string, got {agent_id!r}")
        if agent_id in self._busy:
            raise AgentBusyError(f"agent {agent_id!r} already has request {self._busy[agent_id]} in flight")
        check_max_tokens(max_tokens)

    def _check_ids(self, new: list[int]) -> None:
        if not new:
            raise InvalidRequestError("empty prompt: nothing to prefill after the cache")
        bad = [t for t in new if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")

    def submit(
        self,
        agent_id: str,
        prompt,
        cache: AgentBlocks | None = None,
        max_tokens: int = 32,
        *,
        reuse_prefix: bool = False,
    ) -> int:
        """Queue a request and return its uid.

        ``prompt`` is text or token ids. With ``cache``, it is either the
        continuation after ``cache.token_ids`` or the whole sequence starting
        with them; only the tokens after the cache are prefilled. Without
        ``cache`` and with ``reuse_prefix``, the longest whole-block prefix
        of the prompt already in the pool (any agent's: a shared system
        prompt, an earlier turn) is injected instead. Nothing changes in the
        engine when this raises.
        """
        self._check_request(agent_id, max_tokens)
        ids = prompt_ids(self.tokenizer, prompt, continuing=cache is not None)
        if cache is not None:
            if not isinstance(cache, AgentBlocks):
                raise InvalidRequestError(f"cache must be AgentBlocks, got {type(cache).__name__}")
            self.spec.require_same(cache.spec, "this cache")
            cached = list(cache.token_ids)
            if not (len(ids) > len(cached) and ids[: len(cached)] == cached):
                ids = cached + ids
            self._check_ids(ids[len(cached):])
            return self._enqueue(agent_id, ids, reuse.Reuse(reuse.OWN, len(cached), cache) if cached else None, max_tokens)
        self._check_ids(ids)
        return self._enqueue(agent_id, ids, None, max_tokens, plan_reuse=reuse_prefix)

    def submit_history(
        self,
        agent_id: str,
        token_ids: Sequence[int],
        own: AgentBlocks | None = None,
        max_tokens: int = 32,
        *,
        sampling: SamplingParams | None = None,
        on_token: OnToken | None = None,
        salt_root: int | None = None,
    ) -> int:
        """Queue the agent's whole history ``token_ids`` and return the uid.

        The request starts from the longest prefix that ``own`` (the agent's
        previous cache, which may have diverged: an edited conversation) or
        the pool covers, as :func:`reuse.choose_start` decides; the rest is
        prefilled. ``own`` is only read; the caller keeps its reference.
        ``sampling`` (default greedy) is this sequence's own; ``on_token``
        sees each token (see :data:`OnToken`); ``salt_root`` salts the block keys
        of everything this request looks up and stores (a tenant's).
        Nothing changes in the engine when this raises.
        """
        self._check_request(agent_id, max_tokens)
        if isinstance(token_ids, str):
            raise InvalidRequestError("submit_history takes token ids; render text or messages first")
        ids = prompt_ids(self.tokenizer, token_ids)
        self._check_ids(ids)
        if own is not None:
            if not isinstance(own, AgentBlocks):
                raise InvalidRequestError(f"own must be AgentBlocks, got {type(own).__name__}")
            self.spec.require_same(own.spec, "this cache")
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise InvalidRequestError(f"sampling must be SamplingParams, got {type(sampling).__name__}")
        return self._enqueue(
            agent_id, ids, None, max_tokens, plan_reuse=True, own=own, sampling=sampling, on_token=on_token, salt_root=salt_root
        )

    def _enqueue(
        self, agent_id: str, ids: list[int], start: reuse.Reuse | None, max_tokens: int,
        *, plan_reuse: bool = False, own: AgentBlocks | None = None,
        sampling: SamplingParams | None = None, on_token: OnToken | None = None, salt_root: int | None = None,
    ) -> int:
        submitted = time.perf_counter()
        sampler = sampler_for(sampling) if sampling is not None else None
        processors = processors_for(sampling) if sampling is not None else None
        if plan_reuse:
            with self.lock:
                start = reuse.choose_start(self.pool, ids, own, self._release, salt_root)
        cached = start.cached if start is not None else 0   # what caches covered: the accounting
        source = start.source if start is not None else reuse.NONE
        caches = None
        if start is not None and start.cached:
            try:
                caches = self.reconstruct_cache(start.blocks, upto=start.cached)
            finally:
                if start.owned:
                    # the rebuilt caches hold the arrays; the pool references can go at once
                    start.blocks.release()
        fed = start.cached if start is not None else 0
        new = ids[fed:]
        seq = _Seq(
            next(self._uids), agent_id, ids, cached, max_tokens, reuse=source, submitted_at=submitted,
            salt_root=salt_root, on_token=on_token,
        )
        bt = self.pool.block_tokens
        stops = [b - fed for b in range(fed // bt * bt + bt, len(ids), bt)] if self._sliding else []
        self._loop.add(
            seq.uid, new, caches if caches is not None else self.spec.make_cache(), max_tokens,
            sampler=sampler, processors=processors, context=ids[:fed], stops=stops,
            on_stop=lambda uid, live, n, ids=ids, fed=fed, salt_root=salt_root: self._checkpoint(live, ids[: fed + n], salt_root),
        )
        self._seqs[seq.uid] = seq
        self._busy[agent_id] = seq.uid
        return seq.uid

    def _checkpoint(self, caches: list, ids: list[int], salt_root: int | None) -> None:
        """Pool the cache of a prompt cut at a block boundary (``ids`` ends there).

        A sliding layer keeps only its window, so a finished cache no longer
        holds the window that ended at an earlier boundary, and no other
        agent could start from that prefix (a shared system prompt). The step
        loop ends a chunk at each boundary and this extracts there; the
        prefill costs the same, plus one copy of each new block::

            prefill    [0 ...... 256)[256 ..... 512)[512 ..... 768)[768 .. 900)
            extract         ^ at 256        ^ at 512        ^ at 768     (the rest: at the end)
            sliding          [0, 256)       [0, 512)        [256, 768)   window 512, pooled

        The blocks are released at once: they stay hittable in the pool's
        free queue until it recycles them. A full pool skips the checkpoint.
        """
        try:
            with self.lock:
                convert.extract(self.pool, caches, ids, self._release, salt_root).release()
        except PoolExhaustedError:
            log.debug("pool full: no checkpoint at %d tokens", len(ids))

    def _release(self, blocks) -> None:
        with self.lock:
            self.pool.release(blocks)

    # ------------------------------------------------------------ driving

    def cached_tokens(self, uid: int) -> int:
        """How many tokens of in-flight sequence ``uid``'s history came from a cache."""
        seq = self._seqs.get(uid)
        if seq is None:
            raise UnknownSequenceError(f"no sequence {uid} in flight")
        return seq.cached

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
        events, closed = self._loop.step()
        now = time.perf_counter()  # the tokens were read: materialized
        for e in events:
            seq = self._seqs[e.uid]
            seq.first_token_at = seq.first_token_at or now
            seq.finish_reason = e.finish_reason
            if self._record(seq, e.token, e.logprobs) and e.finish_reason is None:
                seq.finish_reason = "stop"  # a stop string: ends after this token, like a stop token
                self._loop.close(seq.uid)
        # a finished sequence's cache is complete one step later, once its last token is fed
        return [self._finish(self._seqs[c.uid], self._seqs[c.uid].finish_reason, c.caches) for c in closed]

    def _record(self, seq: _Seq, token: int, logprobs: mx.array) -> bool:
        """Keep one generated token; True when its callback ends the sequence here."""
        seq.generated.append(token)
        logprob = logprobs[token].item()
        seq.logprobs.append(logprob)
        if seq.on_token is None:
            return False
        try:
            return bool(seq.on_token(token, logprob, logprobs))
        except Exception:  # one caller's bug must not fail the whole batch: end its sequence only
            log.exception("on_token of agent %r raised; ending its sequence", seq.agent_id)
            return True

    def cancel(self, uid: int) -> Completion | None:
        """End sequence ``uid`` now (its client went away); None if it is not in flight.

        The Completion's ``finish_reason`` is "cancelled" and its blocks hold
        the cache of exactly the tokens computed so far, or are None when it
        had not produced a token yet (a cache mid-prefill is not kept).
        """
        seq = self._seqs.get(uid)
        return None if seq is None else self._end_early(seq, "cancelled")

    def _end_early(self, seq: _Seq, reason: str) -> Completion:
        """Take a sequence out of its lane before it finished on its own."""
        # only past prefill is there an exact cache of its tokens (None before)
        return self._finish(seq, reason, self._loop.remove(seq.uid))

    def _finish(self, seq: _Seq, reason: str, caches: list | None) -> Completion:
        del self._seqs[seq.uid]
        self._busy.pop(seq.agent_id, None)
        tokens = seq.tokens + seq.generated
        if caches is not None:
            # every token but the newest was fed: the caches say exactly how many
            tokens = tokens[: compat.read_layer(caches[0]).offset]
        blocks, error = None, None
        try:
            if caches is None:
                raise CacheError("ended before its first token: no exact cache to keep")
            with self.lock:
                blocks = convert.extract(self.pool, caches, tokens, self._release, seq.salt_root)
            self._finished[seq.uid] = blocks
        except CacheError as exc:
            error = f"{type(exc).__name__}: {exc}"
        return Completion(
            uid=seq.uid,
            agent_id=seq.agent_id,
            token_ids=list(seq.generated),
            text=self.tokenizer.decode(seq.generated),
            finish_reason=reason,
            blocks=blocks,
            logprobs=list(seq.logprobs),
            prompt_tokens=len(seq.tokens) - seq.cached,
            cached_tokens=seq.cached,
            cache_error=error,
            reuse=seq.reuse,
            submitted_at=seq.submitted_at,
            first_token_at=seq.first_token_at,
            finished_at=time.perf_counter(),
        )

    # ------------------------------------------------------------ caches

    def reconstruct_cache(self, blocks: AgentBlocks, materialize: bool = True, upto: int | None = None) -> list:
        """Real mlx-lm cache objects, one per layer, for ``blocks`` (its first ``upto`` tokens)."""
        self.spec.require_same(blocks.spec, "these blocks")
        return convert.reconstruct(blocks, materialize=materialize, upto=upto)

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
        held = compat.read_layer(caches[0]).offset
        with self.lock:
            return convert.extract(self.pool, caches, (seq.tokens + seq.generated)[:held], self._release, seq.salt_root)


def _vocab_size(model) -> int:
    args = getattr(model, "args", None)
    if args is not None and getattr(args, "vocab_size", None):
        return int(args.vocab_size)
    return int(model.model.embed_tokens.weight.shape[0])


def default_prefill_chunk() -> int:
    """Prompt tokens per step: a chunk costs about one or two decode steps of a small model.

    On a CPU a forward pass over 64 tokens costs about two decode steps of
    SmolLM2 (EXP-010 measures the trade-off); a GPU runs 512 in about that.
    """
    return 512 if mx.default_device() == mx.gpu else 64
