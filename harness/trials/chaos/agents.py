"""Agents talking to the server through the official SDKs, and what each request's outcome was.

Each of ``agents`` slots runs on its own thread: a session of a few turns under one agent id
(header ``X-Agent-Id``), then a new id, so histories stay short. A session speaks one API
(the ``openai`` SDK's chat completions or the ``anthropic`` SDK's messages), each turn streamed
or not (an OpenAI stream asks for usage in its last chunk on most turns, and always on an agent's
first turn in a new server life, whose cached tokens are the durability check). Some sessions offer
a function tool on every turn; when the reply calls it, the next turn sends the tool's result back.

Every turn is greedy (temperature 0). A sampled turn is sent once more, the exact request without
the agent id and under a fresh ``X-Cache-Salt``, so that nothing cached can be reused: its text and
tool calls must be the same.

A request the server could not answer because the injector brought it down is retried once the
server is up again; a 429 is retried after a short pause.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from dataclasses import dataclass, field

import anthropic
import httpx
import numpy as np
import openai

from harness.servers.ours import OurServer
from harness.trials.chaos.ledger import Ledger, Reply

try:  # the anthropic SDK's own fork of httpx: its transport errors escape a stream's iteration unwrapped
    import httpx2
    TIMEOUTS: tuple = (httpx.TimeoutException, httpx2.TimeoutException)
    TRANSPORT: tuple = (httpx.TransportError, httpx2.TransportError)
except ImportError:
    TIMEOUTS, TRANSPORT = (httpx.TimeoutException,), (httpx.TransportError,)

TOOL_NAME = "read_file"
OPENAI_TOOL = {"type": "function", "function": {
    "name": TOOL_NAME, "description": "Read a file of the repository and return its text.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string", "description": "the file's path"}},
                   "required": ["path"]}}}
ANTHROPIC_TOOL = {"name": TOOL_NAME, "description": OPENAI_TOOL["function"]["description"],
                  "input_schema": OPENAI_TOOL["function"]["parameters"]}
QUESTIONS = ("What does the scheduler do when the queue is full?", "Which file holds the block pool?",
             "Summarize the last answer in one line.", "Is the save durable after a crash?",
             "Name one test to run first.", "What should we log on a failed save?",
             "How many agents can share the system prompt?", "Read setup.cfg and tell me the version.",
             "Why is the cache kept per agent?", "What happens on a full disk?",
             "Which flag sets the RAM budget?", "Give one risk of this change.")
FILES = ("README.md", "setup.cfg", "semantic/store.py", "tests/test_pool.py", "Makefile")


@dataclass(slots=True)
class AgentParams:
    max_tokens: int = 12
    tool_max_tokens: int = 40          # a call in JSON needs more room than a short answer
    turns_per_session: tuple[int, int] = (3, 5)
    tools_prob: float = 0.3
    stream_prob: float = 0.5
    usage_prob: float = 0.7            # an OpenAI stream that asks for usage (include_usage)
    check_prob: float = 0.05           # a turn re-sent anonymously under a fresh salt and compared
    timeout_s: float = 120.0           # the client's bound: no answer within it is a hang
    down_wait_s: float = 600.0         # how long a request waits for the server to come back


class Failed(Exception):
    """A request that did not answer: ``outcome`` is one of the ledger's outcomes."""

    def __init__(self, outcome: str, status: int | None, detail: str):
        super().__init__(f"{outcome} {status}: {detail}")
        self.outcome, self.status, self.detail = outcome, status, detail


def _canon(args) -> str:
    """Tool arguments as canonical JSON (a string that is no JSON stays as it is)."""
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return args
    return json.dumps(args, sort_keys=True)


# ------------------------------------------------------------------ one request through each SDK


def openai_turn(client: openai.OpenAI, body: dict, headers: dict, stream: bool, usage: bool,
                hang_up_after: int | None = None) -> tuple[Reply, list[dict]]:
    """One chat completion; returns the reply and its raw tool calls (id, name, arguments)."""
    t0 = time.perf_counter()
    if not stream:
        raw = client.chat.completions.with_raw_response.create(**body, extra_headers=headers)
        r = raw.parse()
        msg, u = r.choices[0].message, r.usage
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in msg.tool_calls or []]
        return Reply(msg.content or "", [(c["name"], _canon(c["arguments"])) for c in calls],
                     u.prompt_tokens if u else None,
                     u.prompt_tokens_details.cached_tokens if u and u.prompt_tokens_details else None,
                     (u.model_extra or {}).get("cache_save") if u else None,
                     raw.headers.get("x-semantic-cache-save"), time.perf_counter() - t0,
                     r.choices[0].finish_reason), calls
    extra = {"stream_options": {"include_usage": True}} if usage else {}
    s = client.chat.completions.create(**body, stream=True, extra_headers=headers, **extra)
    text, calls, u, ttft, finish, n = "", {}, None, None, None, 0
    try:
        for chunk in s:
            n += 1
            if chunk.usage is not None:
                u = chunk.usage
            for ch in chunk.choices:
                d = ch.delta
                if d.content or d.tool_calls:
                    ttft = ttft or time.perf_counter() - t0
                text += d.content or ""
                for tc in d.tool_calls or []:
                    c = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                    c["id"] = tc.id or c["id"]
                    if tc.function:
                        c["name"] += tc.function.name or ""
                        c["arguments"] += tc.function.arguments or ""
                finish = ch.finish_reason or finish
            if hang_up_after is not None and n >= hang_up_after:
                break
    finally:
        s.close()
    calls = [calls[i] for i in sorted(calls)]
    return Reply(text, [(c["name"], _canon(c["arguments"])) for c in calls],
                 u.prompt_tokens if u else None,
                 u.prompt_tokens_details.cached_tokens if u and u.prompt_tokens_details else None,
                 (u.model_extra or {}).get("cache_save") if u else None, None,
                 ttft if ttft is not None else time.perf_counter() - t0, finish), calls


def anthropic_turn(client: anthropic.Anthropic, body: dict, headers: dict, stream: bool,
                   hang_up_after: int | None = None) -> tuple[Reply, list[dict]]:
    """One message; returns the reply and its raw tool calls (id, name, input)."""
    t0 = time.perf_counter()
    body = dict(body)
    if "temperature" in body:  # this SDK's create() takes no temperature: sent as it would be, in the body
        body["extra_body"] = {"temperature": body.pop("temperature")}
    if not stream:
        raw = client.messages.with_raw_response.create(**body, extra_headers=headers)
        m = raw.parse()
        u = m.usage
        calls = [{"id": b.id, "name": b.name, "input": b.input} for b in m.content if b.type == "tool_use"]
        return Reply("".join(b.text for b in m.content if b.type == "text"),
                     [(c["name"], _canon(c["input"])) for c in calls],
                     u.input_tokens + (u.cache_read_input_tokens or 0), u.cache_read_input_tokens,
                     (u.model_extra or {}).get("cache_save"), raw.headers.get("x-semantic-cache-save"),
                     time.perf_counter() - t0, m.stop_reason), calls
    s = client.messages.create(**body, stream=True, extra_headers=headers)
    text, blocks, prompt, cached, save, ttft, finish, n = "", {}, None, None, None, None, None, 0
    try:
        for ev in s:
            n += 1
            if ev.type == "message_start":
                u = ev.message.usage
                cached = u.cache_read_input_tokens
                prompt = u.input_tokens + (cached or 0)
            elif ev.type == "content_block_start":
                b = ev.content_block
                blocks[ev.index] = {"id": b.id, "name": b.name, "json": ""} if b.type == "tool_use" else None
            elif ev.type == "content_block_delta":
                ttft = ttft or time.perf_counter() - t0
                if ev.delta.type == "text_delta":
                    text += ev.delta.text
                elif ev.delta.type == "input_json_delta" and blocks.get(ev.index):
                    blocks[ev.index]["json"] += ev.delta.partial_json
            elif ev.type == "message_delta":
                save = (ev.usage.model_extra or {}).get("cache_save")
                finish = ev.delta.stop_reason
            if hang_up_after is not None and n >= hang_up_after:
                break
    finally:
        s.close()
    calls = [{"id": b["id"], "name": b["name"], "input": json.loads(b["json"] or "{}")}
             for _, b in sorted(blocks.items()) if b]
    return Reply(text, [(c["name"], _canon(c["input"])) for c in calls], prompt, cached, save, None,
                 ttft if ttft is not None else time.perf_counter() - t0, finish), calls


def classify(exc: BaseException, server: OurServer, life: int, was_up: bool) -> Failed:
    """The outcome of a request that raised, given the server's life when it was sent."""
    interrupted = server.life != life or not server.up.is_set() or server.stopping is not None
    if isinstance(exc, (openai.APITimeoutError, anthropic.APITimeoutError, *TIMEOUTS)):
        return Failed("interrupted" if interrupted else "hang", None, repr(exc)[:300])
    if isinstance(exc, (openai.APIStatusError, anthropic.APIStatusError)):
        code = exc.status_code
        if code < 300:  # an error event inside a stream that had begun (Anthropic's SDK keeps its 200)
            return Failed("refused_shutting_down" if interrupted else "stream_error", code, str(exc)[:300])
        if code == 429:
            return Failed("refused_429", code, str(exc)[:300])
        if code == 503 and interrupted:
            return Failed("refused_shutting_down", code, str(exc)[:300])
        return Failed("http_5xx" if code >= 500 else "http_4xx", code, str(exc)[:300])
    if isinstance(exc, (openai.APIConnectionError, anthropic.APIConnectionError, *TRANSPORT)):
        if not was_up:
            return Failed("server_down", None, repr(exc)[:300])
        return Failed("interrupted" if interrupted else "disconnect", None, repr(exc)[:300])
    if isinstance(exc, (openai.APIError, anthropic.APIError)):  # an error event inside a stream
        return Failed("interrupted" if interrupted else "stream_error", None, str(exc)[:300])
    raise exc


# ------------------------------------------------------------------ an agent slot


@dataclass
class Session:
    """One agent id's conversation, in its API's own message format."""

    agent: str
    api: str                       # "openai" | "anthropic"
    turns_left: int
    messages: list[dict] = field(default_factory=list)
    pending_calls: list[dict] = field(default_factory=list)   # the last reply's tool calls, answered next turn
    tools: bool = False            # offered on every turn or none: tools change the prompt's system block, so
                                   # toggling them per turn would make each prompt diverge early from the last
    turn: int = 0


class Fleet:
    """``n`` agent slots on threads, until :meth:`stop`."""

    def __init__(self, server: OurServer, ledger: Ledger, system: str, n: int, p: AgentParams, seed: int):
        self.server, self.ledger, self.system, self.n, self.p, self.seed = server, ledger, system, n, p, seed
        self.stop_event = threading.Event()
        self.threads: list[threading.Thread] = []
        self.turns_by_life: dict[int, int] = {}
        self.agent_ids: set[str] = set()
        self._lock = threading.Lock()
        self.live: dict[int, str] = {}    # slot -> its current agent id

    def start(self) -> None:
        for i in range(self.n):
            t = threading.Thread(target=self._slot, args=(i,), name=f"agent-{i:02d}", daemon=True)
            t.start()
            self.threads.append(t)

    def stop(self, timeout_s: float) -> int:
        """Stop the slots after their current request; returns how many did not stop in time."""
        self.stop_event.set()
        deadline = time.monotonic() + timeout_s
        for t in self.threads:
            t.join(max(0.1, deadline - time.monotonic()))
        return sum(t.is_alive() for t in self.threads)

    def turns_in(self, life: int) -> int:
        with self._lock:
            return self.turns_by_life.get(life, 0)

    def _clients(self):
        kw = dict(max_retries=0, timeout=self.p.timeout_s)   # anthropic's SDK takes no httpx.Timeout (httpx2)
        return (openai.OpenAI(base_url=self.server.url + "/v1", api_key="none", **kw),
                anthropic.Anthropic(base_url=self.server.url, api_key="none", **kw))

    def _slot(self, slot: int) -> None:
        rng = np.random.default_rng([self.seed, slot])
        oa, an = self._clients()
        session_no = 0
        while not self.stop_event.is_set():
            session_no += 1
            agent = f"chaos-{slot:02d}-{session_no:03d}"
            api = "openai" if (slot + session_no) % 2 else "anthropic"
            s = Session(agent, api, int(rng.integers(self.p.turns_per_session[0], self.p.turns_per_session[1] + 1)),
                        tools=bool(rng.random() < self.p.tools_prob))
            with self._lock:
                self.agent_ids.add(agent)
                self.live[slot] = agent
            while s.turns_left > 0 and not self.stop_event.is_set():
                try:
                    if not self._turn(s, slot, rng, oa, an):
                        break    # a failure: the session ends, a new agent id starts
                except Exception as exc:  # noqa: BLE001 - a bug of ours, recorded; the slot goes on
                    import traceback
                    self.ledger.event("harness_error", agent=s.agent, error=traceback.format_exc()[-1500:])
                    break

    def _turn(self, s: Session, slot: int, rng, oa, an) -> bool:
        p = self.p
        if s.pending_calls:
            self._add_tool_results(s)
        else:
            q = f"{QUESTIONS[int(rng.integers(len(QUESTIONS)))]} (ticket {int(rng.integers(1000, 9999))})"
            s.messages.append({"role": "user", "content": q})
        tools = s.tools
        stream = bool(rng.random() < p.stream_prob)
        usage = bool(rng.random() < p.usage_prob)
        check = bool(rng.random() < p.check_prob)
        body = self._body(s, tools)
        while not self.stop_event.is_set():
            # an agent's first turn in a new life carries the durability check: it must report usage
            first_in_life = self.ledger.last_life(s.agent) not in (None, self.server.life)
            row, reply, calls = self._send(s.api, body, {"X-Agent-Id": s.agent}, stream, usage or first_in_life,
                                           oa, an, agent=s.agent, slot=slot, tools=tools, kind="turn")
            if reply is not None:
                break
            if row["outcome"] in ("server_down", "interrupted", "refused_shutting_down"):
                self.server.up.wait(p.down_wait_s)
                continue
            if row["outcome"] == "refused_429":
                time.sleep(float(rng.uniform(0.2, 1.0)))
                continue
            return False
        else:
            return False
        s.turn += 1
        s.turns_left -= 1
        self._append_reply(s, reply, calls)
        if check:
            self._check(s, body, stream, usage, reply, oa, an, slot)
        return True

    def _body(self, s: Session, tools: bool) -> dict:
        max_tokens = self.p.tool_max_tokens if tools else self.p.max_tokens
        if s.api == "openai":
            body = {"model": self.server.model_id, "messages": [{"role": "system", "content": self.system}, *s.messages],
                    "max_tokens": max_tokens, "temperature": 0}
            if tools:
                body["tools"] = [OPENAI_TOOL]
        else:
            body = {"model": self.server.model_id, "system": self.system, "messages": list(s.messages),
                    "max_tokens": max_tokens, "temperature": 0}
            if tools:
                body["tools"] = [ANTHROPIC_TOOL]
        return json.loads(json.dumps(body))  # a snapshot: later turns append to the session's lists

    def _send(self, api: str, body: dict, headers: dict, stream: bool, usage: bool, oa, an, **row) -> tuple:
        """One request, recorded in the ledger; returns (row, reply or None, raw calls)."""
        life, was_up = self.server.life, self.server.up.is_set()
        t0 = self.ledger.now()
        row.update({"t0": round(t0, 3), "api": api, "stream": stream, "usage_asked": usage if api == "openai" else True,
                    "life": life})
        try:
            if api == "openai":
                reply, calls = openai_turn(oa, body, headers, stream, usage)
            else:
                reply, calls = anthropic_turn(an, body, headers, stream)
        except Exception as exc:  # noqa: BLE001 - classify() re-raises what is no request failure
            f = classify(exc, self.server, life, was_up)
            row.update({"t1": round(self.ledger.now(), 3), "outcome": f.outcome, "status": f.status,
                        "detail": f.detail})
            self.ledger.request(row)
            return row, None, []
        t1 = self.ledger.now()
        row.update({"t1": round(t1, 3), "outcome": "ok", "status": 200, "ttft_s": round(reply.ttft_s, 4),
                    "latency_s": round(t1 - t0, 4), "prompt_tokens": reply.prompt_tokens,
                    "cached_tokens": reply.cached_tokens, "cache_save": reply.cache_save,
                    "header_save": reply.header_save, "finish": reply.finish, "tool_calls": len(reply.tool_calls),
                    "text": reply.text[:80]})
        if row.get("kind") == "turn":
            res = self.ledger.answered(row["agent"], life, reply, t1)
            if res is not None:
                row["resumption"] = res["verdict"]
            with self._lock:
                self.turns_by_life[life] = self.turns_by_life.get(life, 0) + 1
        self.ledger.request(row)
        return row, reply, calls

    def _append_reply(self, s: Session, reply: Reply, calls: list[dict]) -> None:
        if s.api == "openai":
            msg = {"role": "assistant", "content": reply.text or None}
            if calls:
                msg["tool_calls"] = [{"id": c["id"], "type": "function",
                                      "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]
            elif not reply.text:
                msg["content"] = ""
            s.messages.append(msg)
        else:
            content = [{"type": "text", "text": reply.text}] if reply.text else []
            content += [{"type": "tool_use", "id": c["id"], "name": c["name"], "input": c["input"]} for c in calls]
            s.messages.append({"role": "assistant", "content": content or [{"type": "text", "text": "(no reply)"}]})
        s.pending_calls = calls

    def _add_tool_results(self, s: Session) -> None:
        results = [(c, f"{FILES[i % len(FILES)]}: 42 lines, version 0.{i + 1}") for i, c in enumerate(s.pending_calls)]
        if s.api == "openai":
            s.messages += [{"role": "tool", "tool_call_id": c["id"], "content": text} for c, text in results]
        else:
            s.messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": c["id"], "content": text}
                                                           for c, text in results]})
        s.pending_calls = []

    def _check(self, s: Session, body: dict, stream: bool, usage: bool, reply: Reply, oa, an, slot: int) -> None:
        """The same request, anonymous, under a fresh salt: the same greedy text and tool calls."""
        salt = uuid.uuid4().hex
        for _ in range(20):
            if self.stop_event.is_set():
                break
            row, fresh, _ = self._send(s.api, body, {"X-Cache-Salt": salt}, stream, usage, oa, an,
                                       agent=None, slot=slot, tools="tools" in body, kind="check", of=s.agent)
            if fresh is not None:
                same = fresh.text == reply.text and fresh.tool_calls == reply.tool_calls
                self.ledger.checks.append({
                    "t": row["t1"], "agent": s.agent, "turn": s.turn, "api": s.api, "stream": stream,
                    "verdict": "same" if same else "different", "cached_tokens": fresh.cached_tokens,
                    "anonymous_cache_save": fresh.save_state,
                    **({} if same else {"text": reply.text, "fresh_text": fresh.text,
                                        "tool_calls": reply.tool_calls, "fresh_tool_calls": fresh.tool_calls})})
                return
            if row["outcome"] in ("server_down", "interrupted", "refused_shutting_down"):
                self.server.up.wait(self.p.down_wait_s)
            elif row["outcome"] == "refused_429":
                time.sleep(0.5)
            else:
                break
        self.ledger.checks.append({"t": self.ledger.now(), "agent": s.agent, "turn": s.turn, "api": s.api,
                                   "stream": stream, "verdict": "unfinished"})
