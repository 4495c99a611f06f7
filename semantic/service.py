"""The service: one model, its cache store and its scheduler behind the one object a server calls.

The HTTP layer (``semantic.serve``) imports this module and nothing else of
the engine::

    Service.open(model, budgets) ─► Service
        prepare(TurnRequest) ─► PreparedTurn (the Request: tokenized once, fitted, checked)
        submit(request) ─► TurnFuture[Completion] (.tokens: sooner)   cancel(future)
        wait_saved(agent_id)   save_outcome(completion) ─► "saved" | "pending" | "failed"
        stats() ─► ServiceStats                    agents(tenant) ─► [AgentInfo]      close()

Which cache a request uses: a named agent keeps its own cache, on disk and
across restarts, under an id namespaced by its tenant; with no name, the
request is an anonymous agent whose cache is never saved, and it starts from
whatever whole-block prefix its tenant's requests left in the pool
(automatic prefix caching). A tenant and a ``cache_salt`` salt the block
hashes, so no tenant can hit another's blocks.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from semantic import compat, defaults, errors, sizing
from semantic.chat import roles, toolformat
from semantic.decode import constraint
from semantic.cache import room
from semantic.cache.blockclaim import salt_root_of
from semantic.chat.boundaries import message_boundaries
from semantic.chat.maxtokens import fit_max_tokens
from semantic.runner.executor import vocab_size
from semantic.modelconfig import ModelConfig
from semantic.errors import CacheError, ContextLengthError, InvalidRequestError, SchedulerClosedError
from semantic.store.fingerprint import weights_fingerprint
from semantic.decode.promptlookup import SpecConfig
from semantic.sched.planner import SchedulerStats
from semantic.cache.pool import BlockPool, PoolStats
from semantic.decode.constraint import Grammar
from semantic.chat.echo import EchoBook, Reply, Said
from semantic.request import Completion, OnToken, Request, encode, render_text
from semantic.decode.sampling import GREEDY, SamplingParams
from semantic.store.diskhealth import KINDS as SAVE_FAILURES
from semantic.sched.saves import FAILED, PENDING, SAVED
from semantic.sched.scheduler import ConcurrentScheduler, TurnFuture
from semantic.cache.spec import ModelCacheSpec
from semantic.store import AgentCacheStore, StoreStats
from semantic.chat.toolformat import ToolCall, ToolReading, Tools, read_calls

log = logging.getLogger(__name__)

# the HTTP layer's one door into the package: what it names, it imports from here
__all__ = [
    "ANON", "AgentInfo", "CacheError", "Completion", "ContextLengthError", "FAILED", "GREEDY", "InvalidRequestError",
    "PENDING", "PreparedTurn", "Request", "SAVED", "SAVE_FAILURES", "SamplingParams", "SchedulerClosedError",
    "Service", "ServiceStats", "ToolCall", "ToolReading", "Tools", "TurnRequest", "errors", "fit_max_tokens",
    "read_calls",
]

ANON = "~anon/"          # anonymous agents' ids: never saved, never listed
MB = 1 << 20


def model_fingerprint(path: Path) -> str:
    """The weights' fingerprint (:mod:`semantic.store.fingerprint`) plus the model's config."""
    h = hashlib.sha256(weights_fingerprint(path).encode())
    config = path / "config.json"
    if config.exists():
        h.update(b"config\0" + config.read_bytes())
    return h.hexdigest()[:24]


@dataclass(frozen=True, slots=True)
class TurnRequest:
    """What a client asks of one turn, in no API's terms: built once where it enters (an HTTP route, a
    library caller), checked here, and prepared by :meth:`Service.prepare` into the executor's Request.

    Exactly one of ``messages`` (chat: ``{"role", "content"}`` dicts, rendered with the model's chat
    template) and ``prompt`` (text, or token ids) is set. ``max_tokens`` None: the server's default,
    fitted to the context; with ``until_context``, all the context leaves (the Responses API's meaning).
    ``agent``: a named agent, whose cache is kept and saved (None: anonymous). ``tenant`` and
    ``cache_salt`` salt its block keys. ``tools``: what the model may call, and how; ``response_schema``:
    the reply must be one JSON value matching it.
    """

    max_tokens: int | None = None
    messages: list[dict] | None = None
    prompt: str | list[int] | None = None
    sampling: SamplingParams = GREEDY
    tenant: str = ""
    agent: str | None = None
    cache_salt: str | None = None
    tools: Tools | None = None
    response_schema: dict | None = None
    until_context: bool = False

    def __post_init__(self):
        if (self.messages is None) == (self.prompt is None):
            raise InvalidRequestError("give exactly one of messages and prompt")
        if self.agent is not None and (not isinstance(self.agent, str) or not self.agent):
            raise InvalidRequestError("the agent id (prompt_cache_key, user, X-Agent-Id, metadata.user_id) must be "
                                      "a non-empty string")


@dataclass(frozen=True, slots=True)
class PreparedTurn:
    """A turn ready to submit: the executor's Request, how its reply is read when tools are offered, and the
    template's text of its prompt (for the next turn's echo; None for a prompt that was not chat)."""

    request: Request
    tools: ToolReading | None = None
    prompt_text: str | None = None


@dataclass(frozen=True, slots=True)
class AgentInfo:
    """A named agent the store or the RAM tier holds."""

    agent_id: str                 # tenant-namespaced
    cached_tokens: int
    last_used: float | None       # unix seconds (None: unknown)
    resident: bool                # in RAM now (else only on disk)


@dataclass(frozen=True, slots=True)
class ServiceStats:
    """The scheduler's counters, what the store and the pool hold now, and their budgets."""

    scheduler: SchedulerStats
    store: StoreStats
    pool: PoolStats
    block_tokens: int
    pool_capacity_bytes: int
    disk_budget_bytes: int
    cache_dir: str
    echo_spliced: int = 0    # prompts whose echoed reply was the generated ids (``semantic.chat.echo``)
    echo_rendered: int = 0   # prompts of known agents rendered instead: the echo did not match
    spec_steps: int = 0      # decode steps that verified drafts (``semantic.decode.promptlookup``) ...
    spec_drafted: int = 0    # ... the tokens drafted in them ...
    spec_accepted: int = 0   # ... and those the model agreed with: each saved one decode step
    spec_replays: int = 0    # passes that fed recurrent rows their accepted tokens again (``semantic.decode.replay``)
    remote: dict | None = None  # the shared tier's counters (``RemoteTier.stats``), when there is one
    spec_off: str | None = None  # why speculation cannot run on this model (executor.speculation_off), None: it can
    batch_off: str | None = None  # why this model decodes one sequence at a time, None: it batches
    rows_off: str | None = None   # why its batches merge their rows into one tensor (a copy), None: kept apart
    cache_kinds: tuple[str, ...] = ()  # the model's layer kinds (global, sliding, recurrent)
    in_place: dict | None = None  # which layer groups turns run in the pool's buffers (``CacheManager.in_place``)


class Service:
    """A model served with a persistent KV cache per agent (see the module doc).

    Args:
        model, tokenizer: loaded with ``mlx_lm.load``.
        store: the agents' cache files over the executor's block pool.
        max_context: the most prompt + completion tokens (default and
            ceiling: the model's own).
        max_batch, max_queued, prefill_chunk, itl_target_s, ram_budget_bytes: the scheduler's
            (``ConcurrentScheduler``).
        tool_parser: the model's tool-call format (an ``mlx_lm.tool_parsers``
            module, or "generic"); None: what mlx-lm sniffed from its template.
        echo_history: a named agent's echoed reply is its generated ids
            (``semantic.chat.echo``); False: always the template's rendering.
        strict_max_tokens: a ``max_tokens`` the context cannot hold after the
            prompt is refused (ContextLengthError) rather than cut to fit.
        speculation: prompt-lookup drafts for greedy turns (``semantic.decode.promptlookup``); None: off.
    """

    def __init__(self, model, tokenizer, store: AgentCacheStore, *, max_batch: int = defaults.MAX_BATCH,
                 max_queued: int = defaults.MAX_QUEUED, max_context: int | None = None,
                 ram_budget_bytes: int | None = None, prefill_chunk: int | None = None,
                 itl_target_s: float | None = None,
                 tool_parser: str | None = None, echo_history: bool = True, strict_max_tokens: bool = False,
                 speculation: SpecConfig | None = None):
        self.tokenizer, self.store = tokenizer, store
        self.scheduler = ConcurrentScheduler(model, tokenizer, store, max_batch=max_batch, max_queued=max_queued,
                                             ram_budget_bytes=ram_budget_bytes, prefill_chunk=prefill_chunk,
                                             itl_target_s=itl_target_s,
                                             speculation=speculation)
        self.eos = frozenset(int(t) for t in tokenizer.eos_token_ids)
        self.tool_format = toolformat.sniff(tokenizer, tool_parser)
        self.echo = EchoBook(limit=4096 if echo_history else 0)
        self.strict_max_tokens = strict_max_tokens
        # whether system turns render where they stand, or must move (``semantic.chat.roles``): asked once
        self.free_system = roles.renders_mid_system(lambda msgs: render_text(tokenizer, msgs))
        self._end_texts = [t for t in (tokenizer.decode([e]) for e in sorted(self.eos)) if t]
        self.vocab_size = vocab_size(model)
        native = ModelConfig.of_model(model).context
        self.context_length = int(min(max_context or native, native))
        self.pool_tokens = room.longest_cache(store.spec, store.capacity, store.block_tokens)  # what admission promises
        self.model_path: Path | None = None  # set by open()
        self.weights_bytes = 0  # the model's parameters, set by open()
        self.budgets: sizing.Budgets | None = None  # what open() derived from the machine, when it did
        self._lock = threading.Lock()
        self._seen: dict[str, tuple[int, float | None]] = {}  # agent id -> (cached tokens, last used)

    @classmethod
    def open(cls, model: str, *, cache_dir: str | None = None, pool_bytes: int | None = None,
             disk_budget_bytes: int | None = None, block_tokens: int = defaults.BLOCK_TOKENS, remote: str | None = None,
             remote_budget_bytes: int = 0, cache_layout: str = "blocks", cache_root: str | None = None,
             kv_bits: int | None = None, tokenizer=None, share: sizing.Share = sizing.Share(),
             **scheduling) -> "Service":
        """Load ``model`` (a directory or hub id, whatever ``mlx_lm.load`` takes) and open its cache store.

        Caches live under ``cache_dir``, by default
        ``~/.cache/semantic-kv/agents/<model fingerprint>``, so another
        model's files never mix with this one's. ``remote``: a Redis URL whose
        tier other servers of this model share (agents resume on any of them), holding at most
        ``remote_budget_bytes`` of this model's caches (0: Redis's own ``maxmemory`` only). ``scheduling``: the
        constructor's keywords (``ram_budget_bytes`` and the rest). ``cache_layout``: the store's
        (``AgentCacheStore``'s ``layout``). ``cache_root``: caches under ``cache_root/<fingerprint>`` (a
        server of several models keeps each one's apart). ``kv_bits``: quantized KV caches (global layers).
        ``tokenizer``: the one an earlier ``open`` of the same model made (only the weights are read).
        ``pool_bytes`` or ``disk_budget_bytes`` None: sized from the machine and the model
        (``semantic.sizing``, this model's ``share`` of the memory), and then a RAM budget too when
        ``scheduling`` names none; :attr:`budgets` says what was derived.
        """
        from mlx.utils import tree_flatten

        path = compat.model_path(model)
        # quantized caches are another model's as far as files go: their own directory and Redis keys
        fingerprint = model_fingerprint(path) + (f"-kv{kv_bits}" if kv_bits else "")
        kept_tokenizer = tokenizer is not None
        machine = sizing.Machine.read()  # before the load: its weights and tokenizer are counted below
        loaded, tokenizer = compat.load(path, tokenizer)
        spec = ModelCacheSpec.from_model(loaded, kv_bits=kv_bits)
        weights = sum(v.nbytes for _, v in tree_flatten(loaded.parameters()))
        root = Path(cache_root).expanduser() if cache_root else Path.home() / ".cache" / "semantic-kv" / "agents"
        where = Path(cache_dir).expanduser() if cache_dir else root / fingerprint
        budgets = None
        if pool_bytes is None or disk_budget_bytes is None:
            # a tokenizer kept from an earlier load is resident already, and counted by the fleet
            budgets = sizing.derive(spec, ModelConfig.of_model(loaded), weights=weights, machine=machine,
                                    disk_free_bytes=sizing.disk_free(where), context=scheduling.get("max_context"),
                                    block_tokens=block_tokens, share=share,
                                    chunk=scheduling.get("prefill_chunk") or defaults.prefill_chunk(),
                                    tokenizer=0 if kept_tokenizer else sizing.tokenizer_bytes(path))
            log.info("%s", budgets.describe())
            if pool_bytes is None:
                pool_bytes = budgets.pool
                if scheduling.get("ram_budget_bytes") is None:
                    scheduling["ram_budget_bytes"] = budgets.ram
            if disk_budget_bytes is None:
                disk_budget_bytes = budgets.disk
        pool = BlockPool(spec, block_tokens=block_tokens, capacity_bytes=max(pool_bytes, 1))
        if pool.total_blocks < 4 or room.longest_cache(spec, pool.capacity, block_tokens) < block_tokens:
            raise ValueError(f"a pool of {pool_bytes / MB:.0f} MiB holds {pool.total_blocks} blocks of "
                             f"{pool.block_bytes / MB:.1f} MiB, not one cache of a block: raise it")
        tier = None
        if remote is not None:  # caches shared with other servers of the same model (``semantic.store.remote``)
            from semantic.store.remote import RemoteTier

            tier = RemoteTier(remote, fingerprint, budget_bytes=remote_budget_bytes)
        store = AgentCacheStore(where, spec, fingerprint, disk_budget_bytes, pool=pool, remote=tier, layout=cache_layout)
        if store.quarantined or store.foreign:
            log.warning("cache dir %s: %d files quarantined, %d of another model left alone",
                        where, len(store.quarantined), len(store.foreign))
        service = cls(loaded, tokenizer, store, **scheduling)
        log.info("loaded %s: a %.0f MiB pool holds one cache of %d tokens; caches in %s",
                 path, pool.capacity / MB, service.pool_tokens, where)
        service.model_path = path
        service.weights_bytes = weights
        service.budgets = budgets
        return service

    # ------------------------------------------------------------ turns

    def prepare(self, turn: TurnRequest, *, on_token: OnToken | None = None, on_admit=None) -> PreparedTurn:
        """The turn's :class:`Request`: tokenized once (``messages`` through the chat template, or
        ``prompt`` text or ids), its max_tokens fitted (:func:`fit_max_tokens`), its cache placed;
        and how its reply is read when ``tools`` are offered (``semantic.chat.toolformat``).
        ``on_token`` and ``on_admit`` go into the Request as they are.

        ``response_schema`` holds the reply to one JSON value matching it (a
        grammar, as ``tools`` may). A named agent whose messages echo the
        reply this server generated for it gets that reply's own token ids
        (``semantic.chat.echo``). Blocking (the tokenizer and the chat template):
        call it off an event loop.

        Raises:
            InvalidRequestError: the prompt, the messages or a field is unusable
                (ContextLengthError: it does not fit the context or the pool).
        """
        tools, messages = turn.tools, turn.messages
        reading = toolformat.reading(tools, self.tool_format, self.tokenizer) if tools is not None else None
        grammar = reading.grammar if reading is not None else None
        if turn.response_schema is not None:
            if reading is not None and reading.reads_calls:
                raise InvalidRequestError("response_format with tools the model may call is not supported: "
                                          "set tool_choice to none, or drop response_format")
            grammar = Grammar.json_schema(turn.response_schema, "response_format")
        if grammar is not None:
            constraint.check(grammar, self.tokenizer, self.vocab_size)
        if turn.agent is not None:
            agent_id, persist = self.agent_id(turn.tenant, turn.agent), True
        else:
            agent_id, persist = ANON + uuid.uuid4().hex, False
        text, marks = None, ()
        if messages is not None:
            ids, text = self._render(agent_id if persist else None, messages, tools)
            if self.scheduler.executor.wants_boundaries:  # resumes only where it stopped, or keeps prefixes apart
                marks = message_boundaries(ids, messages, text, lambda m: self._template(m, tools, False),
                                           self._tokens)
        else:
            ids = encode(self.tokenizer, turn.prompt)
        max_tokens = fit_max_tokens(len(ids), turn.max_tokens, context_length=self.context_length,
                                   pool_tokens=self.pool_tokens, strict=self.strict_max_tokens,
                                   default=None if turn.until_context else defaults.MAX_TOKENS)
        salt = f"{turn.tenant}\0{turn.cache_salt}" if turn.tenant or turn.cache_salt else None
        request = Request(agent_id, ids, max_tokens, sampling=turn.sampling, persist=persist, salt_root=salt_root_of(salt),
                          grammar=grammar, on_token=on_token, on_admit=on_admit, boundaries=marks)
        return PreparedTurn(request, reading, text)

    def _render(self, agent_id: str | None, messages: list[dict], tools: Tools | None) -> tuple[Sequence[int], str]:
        """The conversation's token ids and template text; the agent's own reply as generated when echoed."""
        def render(msgs, generation_prompt: bool) -> str:
            return self._template(msgs, tools, generation_prompt)

        tokens = self._tokens
        if agent_id is not None and self.echo.limit:
            if self.echo.said(agent_id) is None:  # a restart, or a book that forgot it: the note on disk
                self._recall(agent_id)
            spliced = self.echo.splice(agent_id, messages, render, tokens, self._end_texts)
            if spliced is not None:
                return spliced
        text = render(messages, True)
        return tokens(text), text

    def _template(self, msgs: list[dict], tools: Tools | None, generation_prompt: bool) -> str:
        # a native tool format's template gets the tools and the calls as they are; another, the generic form
        uses_tools = tools is not None or any(m.get("tool_calls") or m["role"] == "tool" for m in msgs)
        if uses_tools and not self.tool_format.native:
            return render_text(self.tokenizer, roles.fit(toolformat.generic_messages(msgs, tools), self.free_system),
                               generation_prompt=generation_prompt)
        return render_text(self.tokenizer, roles.fit(msgs, self.free_system),
                           tools.listed() if tools is not None else None, generation_prompt=generation_prompt)

    def _tokens(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def remember(self, turn: PreparedTurn, completion: Completion, text: str, calls: Sequence[ToolCall],
                 stop_sequence: str | None = None) -> None:
        """What the client was told of a named agent's turn, so that its echo next turn is the generated ids.

        Only a whole reply the client can send back as it is: not a cancelled
        one, nor one a stop string cut (the generated tokens run past it).
        """
        request = completion.request
        if (not request.persist or turn.prompt_text is None or completion.finish_reason == "cancelled"
                or stop_sequence is not None):
            return
        generated = tuple(completion.token_ids)
        reply = Reply(text, tuple((c.name, json.dumps(c.arguments, sort_keys=True)) for c in calls))
        closed = bool(generated) and generated[-1] in self.eos
        said = Said(turn.prompt_text, request.ids + generated, reply, closed)
        self.echo.remember(request.agent_id, said)
        if self.echo.limit:  # beside its cache file, so a restart's first turn splices as the next one would
            self.store.save_extra(request.agent_id, {"echo": said.to_json()})

    def _recall(self, agent_id: str) -> None:
        doc = self.store.load_extra(agent_id)
        if doc is None or not isinstance(doc.get("echo"), dict):
            return
        try:
            self.echo.remember(agent_id, Said.from_json(doc["echo"]))
        except (KeyError, TypeError, ValueError):  # written by another build: render as usual
            pass

    def agent_id(self, tenant: str, agent: str) -> str:
        """A named agent's id: namespaced by its tenant, as :meth:`prepare` makes it."""
        return f"{tenant or 'public'}/{agent}"

    def knows_agent(self, tenant: str, agent: str) -> bool:
        """Whether the agent's cache is still here: resident, or in its file (a resident cache not yet saved
        is never evicted, so the two cover every cache the disk budget has not evicted), or about to be
        (a turn answered whose cache is still being kept)."""
        agent_id = self.agent_id(tenant, agent)
        return (agent_id in set(self.scheduler.resident_agents()) or self.scheduler.holds(agent_id)
                or self.store.has(agent_id))

    def echo_state(self, tenant: str, agent: str) -> dict | None:
        """The agent's last turn as generated (``semantic.chat.echo``), as JSON, for a record kept across restarts."""
        said = self.echo.said(self.agent_id(tenant, agent))
        return said.to_json() if said is not None else None

    def restore_echo(self, tenant: str, agent: str, state: dict) -> None:
        """Put back a turn :meth:`echo_state` gave (after a restart) unless the book knows the agent already.

        Raises:
            InvalidRequestError: ``state`` is not what :meth:`echo_state` writes.
        """
        agent_id = self.agent_id(tenant, agent)
        if self.echo.limit and self.echo.said(agent_id) is None:
            try:
                self.echo.remember(agent_id, Said.from_json(state))
            except (KeyError, TypeError, ValueError) as exc:
                raise InvalidRequestError(f"a stored turn of agent {agent!r} is unreadable: {exc}") from None

    def submit(self, request: Request) -> TurnFuture:
        """Queue the turn (QueueFullError at once when the queue is full); the future gives its Completion
        once its cache is kept, and its ``tokens`` future as soon as its last token is read."""
        future = self.scheduler.submit(request, timeout=0.0)
        if request.persist:
            future.add_done_callback(self._note)
        return future

    def cancel(self, future: Future) -> bool:
        return self.scheduler.cancel(future)

    def wait_saved(self, agent_id: str, timeout: float | None = None) -> bool:
        """Wait until no save of the agent is pending or being written (False: timed out)."""
        return self.scheduler.wait_saved(agent_id, timeout)

    def save_outcome(self, c: Completion) -> str:
        """"saved", "pending" or "failed": what became of the save of turn ``c``'s cache (a named agent's)."""
        return self.scheduler.save_outcome(c)

    def close(self, timeout: float | None = None) -> None:
        """Finish what is queued and in flight, write pending saves (and publish them), stop the threads."""
        self.scheduler.close(timeout)
        if self.store.remote is not None:
            self.store.remote.close(timeout or 10.0)

    def _note(self, future: Future) -> None:
        if future.cancelled() or future.exception() is not None:
            return
        c: Completion = future.result()
        if c.cache_saved:
            with self._lock:
                # the cache holds the history and every generated token but the last, never fed
                self._seen[c.agent_id] = (c.history_tokens + len(c.token_ids) - 1, time.time())

    # ------------------------------------------------------------ state

    def stats(self) -> ServiceStats:
        with self.store.pool_lock:
            pool = self.store.pool.stats()
        steps, drafted, accepted = self.scheduler.executor.speculation
        return ServiceStats(
            scheduler=self.scheduler.stats(), store=self.store.stats(), pool=pool, block_tokens=self.store.block_tokens,
            pool_capacity_bytes=pool.capacity_bytes, disk_budget_bytes=self.store.disk_budget,
            cache_dir=str(self.store.dir), echo_spliced=self.echo.spliced, echo_rendered=self.echo.rendered,
            spec_steps=steps, spec_drafted=drafted, spec_accepted=accepted,
            spec_replays=self.scheduler.executor.replays[0],
            remote=self.store.remote.stats() if self.store.remote is not None else None,
            spec_off=self.scheduler.executor.speculation_off, batch_off=self.scheduler.executor.batch_off,
            rows_off=getattr(self.scheduler.executor, "rows_off", None),
            cache_kinds=tuple(sorted({l.kind for l in self.store.spec.layers})),
            in_place=self.scheduler.executor.cache_manager.in_place(),
        )

    @property
    def speculating(self) -> bool:
        """Whether greedy turns may draft tokens (on, and the model can take rejected drafts back)."""
        return self.scheduler.executor.speculating

    def agents(self, tenant: str | None = None, limit: int = 200) -> list[AgentInfo]:
        """Named agents on disk or in RAM (of ``tenant`` only, when given), most recently used first."""
        prefix = f"{tenant or 'public'}/" if tenant is not None else None
        resident = set(self.scheduler.resident_agents())
        out = []
        for agent_id in self.store.agents():
            if agent_id.startswith("~") or (prefix is not None and not agent_id.startswith(prefix)):  # ours, not a client's
                continue
            with self._lock:
                seen = self._seen.get(agent_id)
            tokens, used = seen or self._from_disk(agent_id)
            out.append(AgentInfo(agent_id, tokens, used, agent_id in resident))
            if len(out) >= limit:
                break
        return sorted(out, key=lambda a: -(a.last_used or 0.0))

    def _from_disk(self, agent_id: str) -> tuple[int, float | None]:
        """Cached tokens and mtime of an agent known only from its file (a restart)."""
        value = self.store.on_disk(agent_id) or (0, None)  # None: being replaced or quarantined right now
        with self._lock:
            self._seen[agent_id] = value
        return value
