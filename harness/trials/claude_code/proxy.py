"""A logging proxy on 127.0.0.1 between an agent client and one server: every request, as the client saw it.

The client (Claude Code) is pointed at the proxy; the proxy forwards each
request unchanged to the server and relays the answer as it arrives, byte
for byte, while it reads Anthropic's usage, stop reason and first delta out
of the stream. Times are the client's: from the request's arrival at the
proxy to its first content delta (TTFT) and to its last byte::

    claude ──► proxy (this) ──► server
             ◄── relayed as it comes, parsed on the side: one Exchange per request

A server whose usage says nothing of its cache (vllm-mlx) gets its figures
from its own log after the run (``ServerTarget.log_usage``), so the proxy
adds nothing to the path it times but the relay itself.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from dataclasses import asdict, dataclass, field


TEXT_LIMIT = 600  # characters of a request's question and of its reply kept for the transcript
HOP = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "accept-encoding"}


@dataclass
class Exchange:
    """One request through the proxy and what came back."""

    index: int
    path: str
    started_s: float                   # since the proxy started
    model: str | None = None           # the name the client sent
    served_model: str | None = None    # the reply's ``model``: the id the server resolved that name to
    stream: bool = False
    max_tokens: int | None = None
    messages: int = 0
    tools: int = 0
    status: int | None = None
    ttft_s: float | None = None        # to the first content delta (stream) or the whole answer (not streamed)
    wall_s: float | None = None
    input_tokens: int | None = None    # Anthropic's meaning: prompt tokens not read from a cache
    cache_read_input_tokens: int | None = None
    output_tokens: int | None = None
    stop_reason: str | None = None
    clamped_max_tokens: int | None = None
    error: str | None = None
    tool_uses: list[str] = field(default_factory=list)
    asked: str | None = None           # the last user message's text, cut to TEXT_LIMIT (what was asked)
    reply: str = ""                    # the reply's text, cut to TEXT_LIMIT (what answered it)

    @property
    def prompt_tokens(self) -> int | None:
        if self.input_tokens is None:
            return None
        return self.input_tokens + (self.cache_read_input_tokens or 0)

    @property
    def cached_tokens(self) -> int | None:
        return self.cache_read_input_tokens

    def row(self) -> dict:
        out = asdict(self)
        out["prompt_tokens"], out["cached_tokens"] = self.prompt_tokens, self.cached_tokens
        return out


class _Reader:
    """Anthropic's event stream, read as it passes: usage, stop reason, first delta, tool names."""

    def __init__(self, rec: Exchange, t0: float):
        self.rec, self.t0, self.buf = rec, t0, b""

    def feed(self, chunk: bytes) -> None:
        self.buf += chunk
        while b"\n\n" in self.buf:
            block, self.buf = self.buf.split(b"\n\n", 1)
            for line in block.split(b"\n"):
                if line.startswith(b"data:"):
                    self._event(line[5:].strip())

    def _event(self, raw: bytes) -> None:
        try:
            ev = json.loads(raw)
        except ValueError:
            return
        kind, rec = ev.get("type"), self.rec
        if kind == "message_start":
            rec.served_model = (ev.get("message") or {}).get("model")
            self._usage(ev.get("message", {}).get("usage") or {})
        elif kind == "content_block_start" and (ev.get("content_block") or {}).get("type") == "tool_use":
            rec.tool_uses.append(ev["content_block"].get("name"))
            self._first()
        elif kind == "content_block_delta":
            self._first()
            text = (ev.get("delta") or {}).get("text")
            if text and len(rec.reply) < TEXT_LIMIT:
                rec.reply = (rec.reply + text)[:TEXT_LIMIT]
        elif kind == "message_delta":
            rec.stop_reason = (ev.get("delta") or {}).get("stop_reason")
            self._usage(ev.get("usage") or {})
        elif kind == "error":
            rec.error = json.dumps(ev.get("error"))[:500]

    def _first(self) -> None:
        if self.rec.ttft_s is None:
            self.rec.ttft_s = time.perf_counter() - self.t0

    def _usage(self, usage: dict) -> None:
        for name in ("input_tokens", "cache_read_input_tokens", "output_tokens"):
            if usage.get(name) is not None:
                setattr(self.rec, name, usage[name])


class LoggingProxy:
    """``with LoggingProxy(upstream) as proxy:`` point the client at ``proxy.url``; ``proxy.exchanges`` fills up."""

    def __init__(self, upstream: str, *, port: int, bodies_dir=None):
        self.upstream, self.port = upstream.rstrip("/"), port
        self.bodies_dir = bodies_dir  # a folder to keep each request body in (request-<index>.json), or None
        self.exchanges: list[Exchange] = []
        self.url = f"http://127.0.0.1:{port}"
        self._t0 = time.perf_counter()
        self._server = None
        self._thread: threading.Thread | None = None
        self._client = None  # httpx.AsyncClient, opened and closed by the proxy's own event loop

    def retarget(self, upstream: str) -> None:
        """Send what comes next to another server (a restarted one on a new port)."""
        self.upstream = upstream.rstrip("/")

    def __enter__(self) -> "LoggingProxy":
        import uvicorn
        from starlette.applications import Starlette
        from starlette.routing import Route

        app = Starlette(routes=[Route("/{path:path}", self._handle, methods=["GET", "POST", "DELETE", "HEAD"])],
                        lifespan=self._lifespan)
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                     timeout_keep_alive=600))
        self._thread = threading.Thread(target=self._server.run, name="logging-proxy", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"the logging proxy did not start on port {self.port}")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        import httpx

        async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0, connect=30.0)) as self._client:
            yield

    async def _handle(self, request):
        import httpx
        from starlette.responses import Response, StreamingResponse

        t0 = time.perf_counter()
        body = await request.body()
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        rec = Exchange(len(self.exchanges), path, round(t0 - self._t0, 3))
        self.exchanges.append(rec)
        if self.bodies_dir is not None:
            self.bodies_dir.mkdir(parents=True, exist_ok=True)
            (self.bodies_dir / f"request-{rec.index:03d}.json").write_bytes(body)
        try:
            sent = json.loads(body) if body else {}
        except ValueError:
            sent = {}
        if isinstance(sent, dict):
            rec.model, rec.stream, rec.max_tokens = sent.get("model"), bool(sent.get("stream")), sent.get("max_tokens")
            rec.messages, rec.tools = len(sent.get("messages") or []), len(sent.get("tools") or [])
            rec.asked = last_user_text(sent.get("messages"))
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
        client = self._client  # one for the proxy's life: no connection set up inside a timed request
        upstream = client.build_request(request.method, self.upstream + path, content=body, headers=headers)
        try:
            answer = await client.send(upstream, stream=True)
        except httpx.HTTPError as exc:
            rec.status, rec.error, rec.wall_s = 502, f"upstream: {exc!r}"[:500], time.perf_counter() - t0
            return Response(json.dumps({"type": "error", "error": {"type": "api_error", "message": rec.error}}),
                            status_code=502, media_type="application/json")
        rec.status = answer.status_code
        clamped = answer.headers.get("x-max-tokens-clamped")
        rec.clamped_max_tokens = int(clamped) if clamped and clamped.isdigit() else None
        reader = _Reader(rec, t0)
        out_headers = {k: v for k, v in answer.headers.items() if k.lower() not in HOP | {"content-encoding"}}

        async def relay():
            kept = b""
            try:
                async for chunk in answer.aiter_raw():
                    if rec.stream:
                        reader.feed(chunk)
                    elif len(kept) < 4 << 20:
                        kept += chunk
                    yield chunk
            finally:
                await answer.aclose()
                rec.wall_s = time.perf_counter() - t0
                if not rec.stream:
                    self._whole(rec, kept)

        return StreamingResponse(relay(), status_code=answer.status_code, headers=out_headers)

    @staticmethod
    def _whole(rec: Exchange, raw: bytes) -> None:
        """A non-streamed answer: its usage, stop reason and tool names (or its error)."""
        rec.ttft_s = rec.wall_s
        try:
            doc = json.loads(raw)
        except ValueError:
            if (rec.status or 0) >= 400:
                rec.error = raw[:300].decode(errors="replace")
            return
        if not isinstance(doc, dict):
            return
        if (rec.status or 0) >= 400:
            rec.error = json.dumps(doc.get("error", doc))[:500]
        usage = doc.get("usage") or {}
        for name in ("input_tokens", "cache_read_input_tokens", "output_tokens"):
            if usage.get(name) is not None:
                setattr(rec, name, usage[name])
        rec.stop_reason, rec.served_model = doc.get("stop_reason"), doc.get("model")
        rec.reply = "".join(b.get("text") or "" for b in doc.get("content") or [] if isinstance(b, dict))[:TEXT_LIMIT]
        rec.tool_uses = [b.get("name") for b in doc.get("content") or [] if b.get("type") == "tool_use"]


def last_user_text(messages) -> str | None:
    """The text of the last user message (its text blocks but reminders, joined; tool results left out), cut."""
    for m in reversed(messages or []):
        if not isinstance(m, dict) or m.get("role") != "user":
            continue
        content = m.get("content")
        if isinstance(content, str):
            return content[:TEXT_LIMIT]
        texts = [b.get("text") or "" for b in content or [] if isinstance(b, dict) and b.get("type") == "text"]
        # Claude Code puts <system-reminder> blocks (context, the date) before the prompt: the prompt is what was asked
        asked = [t for t in texts if not t.lstrip().startswith("<system-reminder>")] or texts
        return "\n".join(asked)[:TEXT_LIMIT] if asked else None
    return None
