"""Where a streamed turn's first token goes inside our server, hop by hop, timed from one clock.

``semantic serve`` runs under this module (``serve``), which stamps (wall clock, so the client's stamps
line up) each hop of a chat turn before handing over to the server's own ``main``::

    arrived     the POST's first bytes reach uvicorn's protocol
    handler     the route's first check ran (FastAPI routed it, pydantic parsed the body)
    prepared    ``Backend.prepare`` returned (chat template, tokenizer, agent id, off the event loop)
    admitted    the scheduler starts the turn (its cache found in the pool or on disk)
    prefilled   the step loop's prefill that fed the prompt's last tokens returned (its first token sampled)
    token       the first token's callback ran on the scheduler's thread
    chunk       the first content chunk was handed to the stream

Then (``run``) one agent's first turn caches a system prompt, and each timed turn is a new agent's on
it with a short task (a sub-agent), streamed through the OpenAI SDK; per hop the median ms after the
POST arrived, and the client's own first content chunk. The turns alternate between two arrivals: at
an idle server (its stats polled until no turn or save is pending) and back to back, sent as soon as the
last reply ended (as a task tool starts its next sub-agent), where whatever the server still does for
the turn before delays the admission.

    python -m harness.trials.serving.hops run --model smollm2-135m --system-tokens 500 --turns 10
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

HOPS = ("arrived", "handler", "prepared", "admitted", "prefilled", "token", "chunk")
STAMPS_ENV = "HARNESS_HOPS_STAMPS"  # the file the stamped server appends its stamps to
ARRIVALS = ("idle", "back_to_back")  # the timed turns alternate between them


def install(write) -> list:
    """Wrap the server's functions so each hop calls ``write(hop)``; returns the undo list
    ``[(owner, attr, original)]``."""
    from uvicorn.protocols.http import h11_impl

    from semantic.runner import steploop
    from semantic.sched import scheduler
    from semantic.serve.openai import router
    from semantic.serve.turn import backend

    undo = []

    def wrap(owner, attr, make):
        orig = getattr(owner, attr)
        setattr(owner, attr, make(orig))
        undo.append((owner, attr, orig))

    def before(hop):
        def make(orig):
            def call(*a, **k):
                write(hop)
                return orig(*a, **k)
            return call
        return make

    def arrived(orig):
        def data_received(self, data):
            if data[:5] == b"POST ":
                write("arrived")
            return orig(self, data)
        return data_received

    def prepared(orig):
        async def prepare(self, req):
            out = await orig(self, req)
            write("prepared")
            return out
        return prepare

    def prefilled(orig):
        def prefill(self):
            done, fed = orig(self)
            if done:
                write("prefilled")
            return done, fed
        return prefill

    def token(orig):
        def on_token(self, *a, **k):
            if not getattr(self, "_hops_seen", False):
                self._hops_seen = True
                write("token")
            return orig(self, *a, **k)
        return on_token

    def chunk(orig):
        def sse(c, *a, **k):
            if c.choices and c.choices[0].delta.content:
                write("chunk")
            return orig(c, *a, **k)
        return sse

    wrap(h11_impl.H11Protocol, "data_received", arrived)
    wrap(router, "_common_checks", before("handler"))
    wrap(backend.Backend, "prepare", prepared)
    wrap(scheduler.ConcurrentScheduler, "_start", before("admitted"))
    wrap(steploop.StepLoop, "_prefill", prefilled)
    wrap(backend._Relay, "on_token", token)
    wrap(router, "_sse", chunk)
    return undo


def uninstall(undo: list) -> None:
    for owner, attr, orig in reversed(undo):
        setattr(owner, attr, orig)
    undo.clear()


def hop_table(turns: list[dict]) -> dict:
    """Per hop, the median ms after the POST arrived over ``turns`` (each ``{"client_t0", "client_first",
    "stamps": {hop: t}}``, wall-clock seconds); ``client_to_arrival`` is how long the request took to reach
    the server, ``client_first`` the client's own first content chunk, after the arrival too."""
    rows = [t for t in turns if "arrived" in t["stamps"]]
    out = {}
    for hop in HOPS:
        ms = [(t["stamps"][hop] - t["stamps"]["arrived"]) * 1000 for t in rows if hop in t["stamps"]]
        out[hop] = round(statistics.median(ms), 1) if ms else None
    first = [(t["client_first"] - t["stamps"]["arrived"]) * 1000 for t in rows if t["client_first"] is not None]
    out["client_first"] = round(statistics.median(first), 1) if first else None
    out["client_to_arrival"] = round(statistics.median((t["stamps"]["arrived"] - t["client_t0"]) * 1000
                                                       for t in rows), 1) if rows else None
    return out


def _serve(argv: list[str]) -> int:
    """``semantic serve`` with every hop stamped into the file ``$HARNESS_HOPS_STAMPS`` names."""
    import semantic.blas

    semantic.blas.enable()  # before anything imports mlx, as the server's own main does
    path, lock = os.environ[STAMPS_ENV], threading.Lock()
    out = open(path, "a")

    def write(hop: str) -> None:
        with lock:
            out.write(json.dumps([hop, time.time()]) + "\n")
            out.flush()

    install(write)
    from semantic.serve.cli import main

    return main(argv)


def _wait_idle(srv, timeout_s: float = 60.0) -> None:
    """Poll the server's stats until no turn is queued or in flight and no save is pending (at most
    ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        doc = srv.stats()
        busy = doc["requests"]["queued"] + doc["requests"]["in_flight"] + doc["saves"]["pending"]
        if not busy:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server is still busy after {timeout_s:.0f} s: {doc['requests']}, {doc['saves']}")
        time.sleep(0.02)


def _run(a) -> dict:
    from harness import models
    from harness.prompts import system_prompt
    from harness.servers import processes
    from harness.servers.client import client, stream_turn
    from harness.servers.targets import OURS, TARGETS
    from harness.trials.window_trace.trace import task
    from mlx_lm.utils import load_tokenizer

    model_dir = models.prepared_dir(a.model, models.default_variant(None))
    system = system_prompt(load_tokenizer(model_dir), a.system_tokens)
    work = Path(tempfile.mkdtemp(prefix="hops-"))
    stamps = work / "stamps.jsonl"
    stamps.touch()
    ours = TARGETS[OURS]

    def command(launch) -> list[str]:  # python -m semantic.serve ARGS -> python -m <this module> serve ARGS
        python, flag, module, *args = ours.command(launch)
        assert (flag, module) == ("-m", "semantic.serve"), (flag, module)
        return [python, flag, "harness.trials.serving.hops", "serve", *args]

    stamped = dataclasses.replace(ours, command=command, env=lambda l: {**ours.env(l), STAMPS_ENV: str(stamps)})
    srv = processes.start(stamped, model_dir, processes.free_port(), work / "server")
    turns = []
    try:
        cl = client(srv.url, 600.0)
        stream_turn(cl, srv.model, [system, task(0)], 2, agent="hops-first")  # caches the system prompt
        seen = len(stamps.read_text().splitlines())
        for k in range(2 * a.turns):
            arrival = ARRIVALS[k % 2]
            if arrival == "idle":
                _wait_idle(srv)  # not beside the last one's save
            t0 = time.time()
            got = stream_turn(cl, srv.model, [system, task(0, k)], a.max_tokens, agent=f"hops-sub-{k}")
            # every hop was stamped and flushed before its first chunk left the server: all are in the file
            lines = stamps.read_text().splitlines()
            stamped_now: dict = {}
            for line in lines[seen:]:
                hop, t = json.loads(line)
                stamped_now.setdefault(hop, t)
            seen = len(lines)
            turns.append({"arrival": arrival, "client_t0": t0, "client_first": t0 + got.ttft_s, "stamps": stamped_now,
                          "prompt_tokens": got.prompt_tokens, "cached_tokens": got.cached_tokens})
            print(f"turn {k + 1}/{2 * a.turns} ({arrival}): {got.cached_tokens}/{got.prompt_tokens} cached, first "
                  f"content {got.ttft_s * 1000:.0f} ms at the client", flush=True)
    finally:
        srv.stop()
        shutil.rmtree(work, ignore_errors=True)
    return {"model": a.model, "system_tokens": a.system_tokens, "turns": turns,
            "hops_ms": {arrival: hop_table([t for t in turns if t["arrival"] == arrival]) for arrival in ARRIVALS}}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        return _serve(argv[1:])
    p = argparse.ArgumentParser(prog="python -m harness.trials.serving.hops", description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=["run"])
    p.add_argument("--model", default="smollm2-135m", help="a registered model name (prepared by `make models`)")
    p.add_argument("--system-tokens", type=int, default=500, help="the shared system prompt's tokens")
    p.add_argument("--turns", type=int, default=10, help="timed sub-agent turns of each arrival")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--json", type=Path, help="write the turns and the table here")
    a = p.parse_args(argv)
    result = _run(a)
    print(json.dumps(result["hops_ms"], indent=1))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
