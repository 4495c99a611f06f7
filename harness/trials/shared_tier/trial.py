"""EXP-016: any server resumes any agent. Two ``semantic serve`` processes sharing one Redis (``--remote``).

Both serve the same model with ``--sync-saves``, each with its own cache directory, on one real
``redis-server`` (``harness.trials.shared_tier.redis_server``). Three phases, every turn streamed through the
``openai`` SDK and timed at the client:

1. **Resume elsewhere.** Per trial, two agents with their own ``history_tokens``-token histories
   take a first turn on server 1 (a cold prefill, timed). Server 1 is then restarted (SIGTERM), so
   its next turns read local disk, not RAM. Then, interleaved per trial: agent L's second turn on
   server 1 (*local*: its file), agent R's second turn on server 2 (*remote*: server 2 never saw
   R; it fetches R's file from Redis), and R's second turn sent to server 2 anonymously under a fresh
   salt (*cold*: a full prefill). Each reply must equal the cold one's of its own history.
2. **A system prompt seen elsewhere.** An agent on server 1 prefills a ``system_tokens`` system
   prompt; a new agent on server 2 with the same prompt must find its full blocks cached.
3. **Redis faults under load.** ``fault_agents`` agents alternate servers turn by turn while Redis is
   SIGKILLed and restarted empty, paused (SIGSTOP: every call times out) and filled (``maxmemory``
   at what it holds, ``noeviction``). Every turn is checked against a fresh salted prefill.
"""

from __future__ import annotations

import shutil
import signal
import statistics
import tempfile
import threading
import time
import uuid
from pathlib import Path

from harness.common.report import verdict_table
from harness.prompts import shared_prefix
from harness.servers.client import client
from harness.servers.ours import OurServer
from harness.trials.base import TrialKind, Param, register
from harness.trials.chaos.agents import openai_turn
from harness.trials.shared_tier.redis_server import RedisMissing, RedisServer


def _turn(server, messages, p, agent=None, salt=None):
    """One streamed greedy turn: the reply (text, prompt and cached tokens, client TTFT)."""
    headers = {**({"X-Agent-Id": agent} if agent else {}), **({"X-Cache-Salt": salt} if salt else {})}
    body = {"model": server.model_id, "messages": messages, "max_tokens": p["max_tokens"], "temperature": 0}
    reply, _ = openai_turn(client(server.url, p["request_timeout_s"]), body, headers, stream=True, usage=True)
    return reply


def _fresh(server, messages, p):
    return _turn(server, messages, p, salt=uuid.uuid4().hex)


def _published(server: OurServer, count: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (server.stats() or {}).get("remote", {}).get("published", 0) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"server published fewer than {count} caches in {timeout_s:.0f} s")
        time.sleep(0.1)


def run(ctx) -> None:
    from mlx_lm.utils import load_tokenizer

    from harness import models
    from harness.prompts import question, system_prompt, user_history

    p, res = ctx.params, ctx.results
    model_dir = Path(p["model_dir"] or models.prepare(ctx.model_name, variant=models.default_variant(
        ctx.config.model_variant)))
    tok = load_tokenizer(model_dir)
    work = Path(tempfile.mkdtemp(prefix="exp016-"))
    redis = RedisServer(work)
    try:
        redis.start()
    except RedisMissing as exc:
        res.output("skipped", str(exc))
        shutil.rmtree(work, ignore_errors=True)
        return
    args = ["--sync-saves", "--remote", redis.url, "--pool-mb", str(p["pool_mb"]), "--disk-mb", str(p["disk_mb"])]
    servers = [OurServer(model_dir, ctx.model_name, work / f"cache-{i}", work / f"server-{i}.log", args)
               for i in (1, 2)]
    out: dict = {"server_args": args}
    ctx.progress.total = 3
    try:
        for s in servers:
            s.start()
        out["resume"] = _resume_elsewhere(servers, p, tok, system_prompt, user_history, question)
        ctx.progress.update(1)
        out["shared_prompt"] = _shared_prompt(servers, p, tok, system_prompt, question)
        ctx.progress.update(1)
        out["faults"] = _faults(servers, redis, p, tok, system_prompt, question)
        ctx.progress.update(1)
        out["stats"] = [s.stats() for s in servers]
    finally:
        out["logs"] = [s.log_tail(3000) for s in servers]
        for s in servers:
            s.kill_now()
        redis.stop()
        shutil.rmtree(work, ignore_errors=True)
    _record(ctx, out)


def _row(trial: int, phase: str, agent: str, r, **extra) -> dict:
    return {"trial": trial, "phase": phase, "agent": agent, "ttft_s": r.ttft_s, "text": r.text,
            "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens, **extra}


def _resume_elsewhere(servers, p, tok, system_prompt, user_history, question) -> dict:
    one, two = servers
    system = system_prompt(tok, 300)
    rows, histories = [], {}
    for i in range(p["trials"]):
        for role in ("local", "remote"):
            agent, user = f"{role}-{i}", 2 * i + (role == "remote")
            messages = [system, *user_history(tok, user, p["history_tokens"] - 300), question(tok, user, 1, 30)]
            r = _turn(one, messages, p, agent=agent)
            rows.append(_row(i, "first", agent, r))
            histories[agent] = messages + [{"role": "assistant", "content": r.text}, question(tok, user, 2, 30)]
    _published(one, 2 * p["trials"])
    one.stop(signal.SIGTERM)  # its RAM is gone: its next turns read their files
    one.start()
    for i in range(p["trials"]):
        order = [("local", one), ("remote", two), ("cold", two)]
        if i % 2:
            order.reverse()
        replies = {}
        for kind, server in order:
            agent = f"{'remote' if kind == 'cold' else kind}-{i}"
            cold = kind == "cold"
            replies[kind] = (agent, _turn(server, histories[agent], p, agent=None if cold else agent,
                                          salt=uuid.uuid4().hex if cold else None))
        local_fresh = _fresh(one, histories[f"local-{i}"], p)
        # each resumed reply against a cold prefill of its own history (the cold turn is R's)
        reference = {"local": local_fresh.text, "remote": replies["cold"][1].text}
        for kind, (agent, r) in replies.items():
            extra = {"same_as_fresh": r.text == reference[kind]} if kind in reference else {}
            rows.append(_row(i, kind, agent, r, **extra))
        rows.append(_row(i, "local_fresh", f"local-{i}", local_fresh))
    return {"rows": rows}


def _shared_prompt(servers, p, tok, system_prompt, question) -> dict:
    one, two = servers
    system = system_prompt(tok, p["system_tokens"])
    before = (one.stats() or {})["remote"]["published"]
    first = _turn(one, [system, question(tok, 900, 1, 30)], p, agent="shared-first")
    _published(one, before + 1)  # publishing runs behind the save
    messages = [system, question(tok, 901, 1, 30)]
    second = _turn(two, messages, p, agent="shared-second")
    ids = [tok.apply_chat_template([system, question(tok, n, 1, 30)], add_generation_prompt=True)
           for n in (900, 901)]
    common = shared_prefix(ids)
    return {"system_tokens": p["system_tokens"], "common_prefix_tokens": common,
            "full_blocks_tokens": common // 256 * 256, "first_cached": first.cached_tokens,
            "second_cached": second.cached_tokens, "second_prompt_tokens": second.prompt_tokens,
            "second_ttft_s": second.ttft_s}


def _faults(servers, redis, p, tok, system_prompt, question) -> dict:
    system = system_prompt(tok, 300)
    stop = threading.Event()
    turns, failures, wrong, checked = [], [], [], [0]
    lock = threading.Lock()

    def agent(i: int) -> None:
        messages = [system]
        for n in range(p["fault_turns"]):
            if stop.is_set():
                return
            server = servers[(i + n) % 2]
            messages.append(question(tok, 1000 + i, n, 20))
            t = time.monotonic()
            try:
                r = _turn(server, messages, p, agent=f"fault-{i}")
                f = _fresh(server, messages, p)
            except Exception as exc:  # every failure is counted, whatever it is
                with lock:
                    failures.append({"agent": i, "turn": n, "error": repr(exc)[:300]})
                messages.pop()
                continue
            with lock:
                checked[0] += 1
                turns.append({"agent": i, "turn": n, "server": (i + n) % 2 + 1, "t": t, "ttft_s": r.ttft_s,
                              "cached_tokens": r.cached_tokens, "prompt_tokens": r.prompt_tokens})
                if r.text != f.text:
                    wrong.append({"agent": i, "turn": n, "reply": r.text, "fresh": f.text})
            messages.append({"role": "assistant", "content": r.text})

    threads = [threading.Thread(target=agent, args=(i,), daemon=True) for i in range(p["fault_agents"])]
    tier = _TierWatch(servers)
    t0 = tier.t0
    for t in threads:
        t.start()
    try:
        events = _fault_schedule(redis, tier, p["fault_hold_s"], t0)
    finally:
        stop.set()
        for t in threads:
            t.join(p["request_timeout_s"] * 2 + 10)
    # the tier's own recovery, not the schedule's
    up_wait_s = tier.wait(lambda ups: all(u is True for u in ups), UP_CEILING_S)
    tier.close()
    remote = [(s.stats() or {}).get("remote", {}) for s in servers]
    return {"events": events, "turns": turns, "failures": failures, "wrong": wrong, "checked": checked[0],
            "remote": remote, "up_wait_s": up_wait_s, "recovery_s": tier.recoveries(events),
            "up_samples": tier.samples}


UP_CEILING_S = 60.0  # the longest the run waits for a server to find a returned Redis (the prober takes ~1 s)


def _fault_schedule(redis, tier: "_TierWatch", hold_s: float, t0: float) -> list[dict]:
    """Each fault held ``hold_s``; an outage (kill, pause) is held until both servers felt it, so that
    every outage is measured on both, however slowly the agents' turns come on a busy machine."""
    full = lambda: redis.config(maxmemory=str(redis.used_memory() + 1), maxmemory_policy="noeviction")  # noqa: E731
    # each fault, how many holds it lasts, and whether both servers must have seen the tier down before the next
    schedule = [("calm", lambda: None, 1, False), ("kill", redis.stop, 1, True),
                ("restarted empty", redis.start, 1, False), ("pause", redis.pause, 1, True),
                ("resume", redis.resume, 1, False), ("full", full, 2, False),
                ("room again", lambda: redis.config(maxmemory="0"), 1, False)]
    events = []
    for name, act, holds, felt in schedule:
        act()
        events.append({"t": round(time.monotonic() - t0, 3), "fault": name})
        time.sleep(holds * hold_s)  # the fault's length is the experiment's design, not a wait for a condition
        if felt:
            # felt: every server says its tier is down (one whose stats did not answer is no proof)
            waited = tier.wait(lambda ups: all(u is False for u in ups), UP_CEILING_S)
            events[-1]["felt_after_s"] = None if waited is None else round(holds * hold_s + waited, 3)
    return events


class _TierWatch:
    """Samples every server's ``remote.up`` four times a second, so an outage's end is timed on the tier."""

    def __init__(self, servers, every_s: float = 0.25):
        self.servers, self.every_s, self.samples = servers, every_s, []
        self.t0, self._stop = time.monotonic(), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _ups(self) -> list[bool | None]:
        return [((s.stats(timeout_s=5) or {}).get("remote") or {}).get("up") for s in self.servers]

    def _sample(self) -> None:
        while not self._stop.wait(self.every_s):
            self.samples.append({"t": round(time.monotonic() - self.t0, 3), "up": self._ups()})

    def wait(self, cond, ceiling_s: float) -> float | None:
        """Seconds until ``cond(ups)`` held (polled), or None past the ceiling."""
        start = time.monotonic()
        while not cond(self._ups()):
            if time.monotonic() - start > ceiling_s:
                return None
            time.sleep(0.1)
        return round(time.monotonic() - start, 3)

    def recoveries(self, events: list[dict]) -> dict:
        """Per Redis return (a restart, a resume; both timed from ``t0``): seconds until every server was
        sampled up again, or None."""
        out = {}
        for e in (e for e in events if e["fault"] in ("restarted empty", "resume")):
            up = next((x["t"] for x in self.samples if x["t"] >= e["t"] and all(x["up"])), None)
            out[e["fault"]] = None if up is None else round(up - e["t"], 3)
        return out

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)


def _record(ctx, out: dict) -> None:
    res = ctx.results
    if "resume" not in out:
        return
    rows = out["resume"]["rows"]
    by = {k: [r for r in rows if r["phase"] == k] for k in ("first", "local", "remote", "cold", "local_fresh")}
    for k, rs in by.items():
        if rs:
            res.metric(f"ttft_{k}_s", [r["ttft_s"] for r in rs], "s", description=f"client TTFT, {k} turns")
    med = {k: statistics.median(r["ttft_s"] for r in rs) for k, rs in by.items() if rs}
    sp, fl = out["shared_prompt"], out["faults"]
    checks = {
        "history_tokens": statistics.median(r["prompt_tokens"] for r in by["remote"]),
        "remote_over_local": med["remote"] / med["local"],
        "remote_over_cold": med["remote"] / med["cold"],
        "local_over_cold": med["local"] / med["cold"],
        "remote_resumes_fully_cached": all(r["cached_tokens"] >= f["prompt_tokens"] for r, f in
                                           zip(by["remote"], [x for x in by["first"] if x["agent"].startswith("remote")])),
        "local_resumes_fully_cached": all(r["cached_tokens"] >= f["prompt_tokens"] for r, f in
                                          zip(by["local"], [x for x in by["first"] if x["agent"].startswith("local")])),
        "resume_replies_differing": sum(1 for r in rows if r.get("same_as_fresh") is False),
        "shared_prompt_cached": sp["second_cached"], "shared_prompt_full_blocks": sp["full_blocks_tokens"],
        "shared_prompt_hit": sp["second_cached"] >= sp["full_blocks_tokens"] > 0,
        "fault_turns": len(fl["turns"]), "fault_failed_requests": len(fl["failures"]),
        "fault_wrong_replies": len(fl["wrong"]),
        "fault_remote_errors": sum(r.get("errors", 0) for r in fl["remote"]),
        "fault_remote_refused": sum(r.get("refused", 0) for r in fl["remote"]),
        "fault_remote_up_at_end": all(r.get("up") for r in fl["remote"]),
        # a return never seen within the run counts as the ceiling the run waits at the end
        "fault_remote_recovery_s": max(UP_CEILING_S if v is None else v for v in fl["recovery_s"].values()),
    }
    res.checks(checks)
    for k in ("resume", "shared_prompt", "faults", "stats", "server_args", "logs"):
        res.output(k, out.get(k))
    _readme(ctx, checks, med)


def _readme(ctx, c: dict, med: dict) -> None:
    verdicts = ctx.results.evaluate()
    run_id = ctx.results.doc["run_id"]
    ttft = " | ".join(f"{k} {med[k]:.3f} s" for k in ("first", "local", "remote", "cold") if k in med)
    (ctx.out_dir / "README.md").write_text(f"""# EXP-016: any server resumes any agent

`make exp-016` (`harness run experiments/exp_016_shared_tier.toml`) runs two `semantic serve` on
{ctx.model_name} sharing one `redis-server` (`--remote`), with their own cache directories. See
`harness/trials/shared_tier/trial.py` for the phases. This file is written by the run. Latest run:
`{run_id}` ({ctx.results.doc['created_at'][:19]} UTC), results `{run_id}.json`.

Median client TTFT at {c['history_tokens']:.0f} prompt tokens: {ttft}.
Remote / local {c['remote_over_local']:.2f}x, remote / cold {c['remote_over_cold']:.3f}x,
local / cold {c['local_over_cold']:.3f}x. A new agent on a {ctx.params['system_tokens']}-token system prompt
first seen on the other server: {c['shared_prompt_cached']} tokens cached ({c['shared_prompt_full_blocks']} in
full blocks). Under Redis faults: {c['fault_turns']} turns, {c['fault_failed_requests']} failed,
{c['fault_wrong_replies']} wrong; after each return of Redis, both servers used it again within
{c['fault_remote_recovery_s']:.1f} s (their probers ping a down tier once a second).

{verdict_table(verdicts, 'None')}
""")


KIND = register(TrialKind(
    name="shared_tier",
    run=run,
    params={
        "trials": Param(int, 3, "agents resumed on each side (local, remote), interleaved"),
        "history_tokens": Param(int, 7900, "tokens of each resumed agent's history before its first question"),
        "system_tokens": Param(int, 2048, "tokens of the system prompt the second phase shares across servers"),
        "max_tokens": Param(int, 8, "max_tokens of every turn (greedy)"),
        "fault_agents": Param(int, 3, "agents alternating servers while Redis fails"),
        "fault_turns": Param(int, 200, "the most turns each of them takes"),
        "fault_hold_s": Param(float, 6.0, "seconds each Redis fault (and each calm between) lasts"),
        "request_timeout_s": Param(float, 300.0, "the client's bound on every request"),
        "pool_mb": Param(int, 2048, "--pool-mb of each server"),
        "disk_mb": Param(int, 16384, "--disk-mb of each server"),
        "model_dir": Param(str, "", "a model directory to serve instead of the prepared one"),
    },
    needs_model=False,
))
