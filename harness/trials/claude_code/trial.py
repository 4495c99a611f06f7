"""EXP-012: Claude Code end to end. The real client, a multi-step task, ours and vllm-mlx, a SIGKILL between.

Claude Code (``harness.trials.claude_code.session``: npm, pinned, offline) runs in
print mode in a scratch git repository, one ``claude -p`` per step of a
fixed task (read a file, edit it, run it, then report after the restart),
each step after the first with ``--continue``, and up to ``max_turns``
requests per step when the model calls tools. Every request passes a
logging proxy (``harness.trials.claude_code.proxy``) that records what the client saw:
status, prompt and cached tokens, TTFT, stop reason, the clamp header. The
servers take turns step by step; before step ``restart_before`` both are
killed with SIGKILL and started again on the same state::

    probe (defaults only)     step 1   step 2   step 3   SIGKILL, start   step 4
    ours │ vllm-mlx           ours, vllm-mlx in turn, step by step        ours, vllm-mlx

**The probe** is a session with nothing set beyond the base URL, the token
and the model names (Claude Code then asks for ``max_tokens: 32000``), on a
fresh server, stopped once its first answer streams: every request it sent
until then must have been accepted. **The steps** set
``CLAUDE_CODE_MAX_OUTPUT_TOKENS`` (``max_output_tokens``), the same on both
servers: a 270M-parameter model copies its system prompt until its budget
runs out, and a 20K-token reply takes most of an hour on this CPU.
"""

from __future__ import annotations

import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from harness import plots
from harness.common.report import ratio
from harness.servers import processes, venvs
from harness.servers.targets import OURS, TARGETS
from harness.trials.base import TrialKind, Param, register
from harness.trials.claude_code import session as cc
from harness.trials.claude_code.proxy import LoggingProxy

SERVERS = (OURS, "vllm-mlx")
FILES = {"greet.py": 'def greeting(name):\n    return "Hello, " + name\n\n\nprint(greeting("world"))\n',
         "README.md": "# greet\n\nPrints a greeting.\n"}


def run(ctx) -> None:
    from harness import models

    p, res = ctx.params, ctx.results
    try:
        install = cc.ensure(p["version"])
    except cc.ClientMissing as exc:
        res.output("skipped", str(exc))
        return
    model_dir = Path(p["model_dir"] or models.prepare(ctx.model_name, variant=models.default_variant(
        ctx.config.model_variant)))
    work = Path(tempfile.mkdtemp(prefix="exp012-"))
    names = list(p["servers"])
    installed = {n: venvs.ensure_venv(TARGETS[n]) for n in names}
    pythons = {n: v.python for n, v in installed.items()}
    res.output("setup", {"claude_code": install.version, "model_dir": str(model_dir), "servers": names,
                         "max_output_tokens": p["max_output_tokens"], "steps": p["steps"],
                         "restart_before": p["restart_before"], "max_turns": p["max_turns"],
                         "versions": {n: v.pick(TARGETS[n].packages) for n, v in installed.items()}})
    ctx.progress.total = len(names) * (1 + len(p["steps"]))
    rows, transcripts, events = [], {n: [] for n in names}, []
    for name in names:
        rows += _probe(ctx, install, name, model_dir, pythons[name], work / "probe" / name, events)
        ctx.progress.update(1)
    sides = {n: _Side(n, model_dir, ctx.model_name, pythons[n], work / n, p["server_settings"].get(n, {}), events)
             for n in names}
    try:
        for step, prompt in enumerate(p["steps"], start=1):
            if step == p["restart_before"]:
                for side in sides.values():
                    side.kill_and_restart(p["grace_s"])
            for name in names:
                rows += sides[name].step(install, step, prompt, p, transcripts[name])
                ctx.progress.update(1)
    finally:
        for side in sides.values():
            side.close()
    for name in names:
        rows = [r for r in rows if r["server"] != name or r["phase"] != "session"] + with_logged_usage(
            [r for r in rows if r["server"] == name and r["phase"] == "session"], name, sides[name].server.log_path)
    res.output("events", events)
    record(ctx, rows, transcripts, names, p["restart_before"])


class _Side:
    """One server through the steps: its process, its proxy, its scratch repository and Claude Code's HOME."""

    def __init__(self, name: str, model_dir: Path, model_id: str, python: Path, work: Path, settings: dict,
                 events: list):
        self.name, self.model_dir, self.model_id, self.python = name, model_dir, model_id, python
        self.work, self.settings, self.events = work, settings, events
        self.repo, self.home = scratch_repo(work / "repo"), work / "home"
        self.restarted = False
        self.server = self._start()
        self.proxy = LoggingProxy(self.server.url, port=processes.free_port())
        self.proxy.__enter__()

    def _start(self) -> processes.Running:
        running = processes.start(TARGETS[self.name], self.model_dir, processes.free_port(), self.work / "server",
                                  model_id=self.model_id, python=self.python, **self.settings)
        self.events.append({"event": "started", "server": self.name, "restart": self.restarted,
                            "start_to_ready_s": round(running.start_to_ready_s, 3)})
        return running

    def step(self, install: cc.Install, step: int, prompt: str, p: dict, transcript: list) -> list[dict]:
        first = len(self.proxy.exchanges)
        extra = {"CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(p["max_output_tokens"])} if p["max_output_tokens"] else {}
        session = cc.run_session(install, base_url=self.proxy.url, model=self.server.model, repo=self.repo,
                                 home=self.home, prompt=prompt, max_turns=p["max_turns"], resume=step > 1,
                                 extra_env=extra, timeout_s=p["step_timeout_s"])
        transcript.append({"step": step, "prompt": prompt, "returncode": session.returncode,
                           "wall_s": round(session.wall_s, 3), "events": [_trim(e) for e in session.events],
                           "stderr": session.stderr[-1500:]})
        return [{**e.row(), "server": self.name, "phase": "session", "step": step, "after_restart": self.restarted,
                 "step_wall_s": round(session.wall_s, 3), "step_returncode": session.returncode}
                for e in self.proxy.exchanges[first:]]

    def kill_and_restart(self, grace_s: float) -> None:
        time.sleep(grace_s)  # the client has exited: a crash this long after its last reply
        stats = self.server.stats() if self.name == OURS else None
        pending = (stats or {}).get("saves", {}).get("pending")
        self.server.stop(signal.SIGKILL)
        self.events.append({"event": "sigkill", "server": self.name, "grace_s": grace_s, "pending_saves": pending})
        self.restarted = True
        self.server = self._start()
        self.proxy.retarget(self.server.url)

    def close(self) -> None:
        self.proxy.__exit__(None, None, None)
        self.server.stop()


def _probe(ctx, install: cc.Install, name: str, model_dir: Path, python: Path, work: Path, events: list) -> list[dict]:
    """A session with only the base URL, a token and the model names, on a fresh server, stopped once
    its first answer streams (or its client exits, or ``probe_timeout_s``)."""
    p = ctx.params
    server = processes.start(TARGETS[name], model_dir, processes.free_port(), work / "server",
                             model_id=ctx.model_name, python=python, **p["server_settings"].get(name, {}))
    try:
        with LoggingProxy(server.url, port=processes.free_port()) as proxy:
            proc = cc.start(install, base_url=proxy.url, model=server.model, repo=scratch_repo(work / "repo"),
                            home=work / "home", prompt=p["steps"][0], max_turns=p["max_turns"])
            deadline = time.monotonic() + p["probe_timeout_s"]
            while proc.poll() is None and time.monotonic() < deadline and not any(
                    e.status == 200 and e.ttft_s is not None and e.tools for e in proxy.exchanges):
                time.sleep(0.5)
            answered = proc.poll() is None
            cc.stop(proc)
            proc.communicate()
            time.sleep(1.0)  # the relay notices the client left
            events.append({"event": "probe", "server": name, "stopped_after_first_answer": answered})
            rows = [{**e.row(), "server": name, "phase": "probe", "step": 1, "after_restart": False}
                    for e in proxy.exchanges]
    finally:
        server.stop()
    return with_logged_usage(rows, name, server.log_path)


def with_logged_usage(rows: list[dict], name: str, log_path: Path) -> list[dict]:
    """A server whose usage gives no prompt or cached tokens (``ServerTarget.log_usage``: vllm-mlx): its own
    log's figures, request by request, where the log holds one line per accepted request (else as they were)."""
    parse = TARGETS[name].log_usage
    if parse is None:
        return rows
    logged = parse(log_path.read_text(errors="replace")) if log_path.exists() else []
    accepted = [r for r in rows if r["status"] == 200]
    if len(logged) != len(accepted):
        return rows
    for r, (prompt, cached) in zip(accepted, logged):
        r.update(prompt_tokens=prompt, cached_tokens=cached, usage_from="server log")
    return rows


def scratch_repo(path: Path) -> Path:
    """A small git repository for the task (``FILES``, one commit); made once, kept for --continue."""
    if path.exists():
        return path
    path.mkdir(parents=True)
    for name, text in FILES.items():
        (path / name).write_text(text)
    git = ["git", "-c", "user.email=exp@localhost", "-c", "user.name=exp"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "start"]):
        subprocess.run(git + args, cwd=path, check=True, capture_output=True)
    return path


def _trim(event: dict, limit: int = 2000):
    """A transcript event with long strings cut (the init event lists every tool; results hold files)."""
    if isinstance(event, dict):
        return {k: _trim(v, limit) for k, v in event.items()}
    if isinstance(event, list):
        return [_trim(v, limit) for v in event[:200]]
    if isinstance(event, str) and len(event) > limit:
        return event[:limit] + f"... ({len(event)} characters)"
    return event


# ---------------------------------------------------------------- results


def session_checks(rows: list[dict], names: list[str]) -> dict:
    """The goals' figures: refusals, cached ÷ prompt after each session's first request, wall times.

    ``refused_{server}``: requests answered with a 4xx or 5xx, probe and steps together.
    ``cached_ratio_min_{server}``: the smallest cached ÷ prompt over every request of the steps but the
    very first (the later steps continue the session; the restarted ones included).
    ``cached_ratio_min_after_restart_{server}``: the same over the requests after the restart.
    ``session_wall_s_{server}`` / ``restart_wall_s_{server}``: the client's wall time of the steps before /
    after the restart; ``wall_ratio`` / ``wall_ratio_after_restart``: ours over the peer's.
    ``ttft_later_median_s_{server}``: median TTFT of the requests after the first, before the restart;
    ``ttft_after_restart_s_{server}``: the first request's after it; ``*_ratio``: ours over the peer's.
    ``end_turn_at_budget_{server}``: replies that used the whole budget and still said ``end_turn``.
    """
    checks: dict = {}
    for name in names:
        mine = [r for r in rows if r["server"] == name]
        steps = [r for r in mine if r["phase"] == "session"]
        checks[f"refused_{name}"] = sum((r["status"] or 0) >= 400 for r in mine)
        checks[f"probe_refused_{name}"] = sum((r["status"] or 0) >= 400 for r in mine if r["phase"] == "probe")
        checks[f"requests_{name}"] = len(steps)
        later = [ratio(r["cached_tokens"], r["prompt_tokens"]) for r in steps[1:] if (r["status"] or 0) < 400]
        checks[f"cached_ratio_min_{name}"] = min(later) if later and None not in later else None
        after = [ratio(r["cached_tokens"], r["prompt_tokens"]) for r in steps if r["after_restart"]]
        checks[f"cached_ratio_min_after_restart_{name}"] = min(after) if after and None not in after else None
        checks[f"prompt_tokens_first_{name}"] = steps[0]["prompt_tokens"] if steps else None
        ttfts = [r["ttft_s"] for r in steps[1:] if not r["after_restart"] and r["ttft_s"] is not None]
        checks[f"ttft_later_median_s_{name}"] = round(statistics.median(ttfts), 3) if ttfts else None
        restarted = [r for r in steps if r["after_restart"]]
        checks[f"ttft_after_restart_s_{name}"] = round(restarted[0]["ttft_s"], 3) \
            if restarted and restarted[0]["ttft_s"] is not None else None
        # a reply the budget cut, reported as finished: the client then takes it as whole and sends no continuation
        checks[f"end_turn_at_budget_{name}"] = sum(r["stop_reason"] == "end_turn" and r["output_tokens"] is not None
                                                   and r["output_tokens"] >= (r["max_tokens"] or 0) for r in steps)
        walls = {(r["step"], r["after_restart"]): r["step_wall_s"] for r in steps}
        checks[f"session_wall_s_{name}"] = round(sum(w for (s, a), w in walls.items() if not a), 3) or None
        checks[f"restart_wall_s_{name}"] = round(sum(w for (s, a), w in walls.items() if a), 3) or None
    peer = next((n for n in names if n != OURS), None)
    if peer is not None:
        checks["wall_ratio"] = ratio(checks[f"session_wall_s_{OURS}"], checks[f"session_wall_s_{peer}"])
        checks["wall_ratio_after_restart"] = ratio(checks[f"restart_wall_s_{OURS}"], checks[f"restart_wall_s_{peer}"])
        for key in ("ttft_later_median_s", "ttft_after_restart_s"):
            checks[f"{key[:-2]}_ratio"] = ratio(checks[f"{key}_{OURS}"], checks[f"{key}_{peer}"])
    clamps = [r["clamped_max_tokens"] for r in rows if r["server"] == OURS and r["phase"] == "probe"]
    checks["probe_clamped_max_tokens_ours"] = next((c for c in clamps if c is not None), None)
    return checks


def record(ctx, rows: list[dict], transcripts: dict, names: list[str], restart_before: int) -> None:
    res = ctx.results
    res.output("requests", rows)
    res.output("transcripts", transcripts)
    ctx.plot_path("transcript").with_suffix(".txt").write_text(transcript_text(transcripts))
    res.checks(session_checks(rows, names))
    for name in names:
        ttfts = [r["ttft_s"] for r in rows if r["server"] == name and r["phase"] == "session" and r["ttft_s"]]
        if ttfts:
            res.metric(f"ttft_{name}", ttfts, "s", "lower", f"{name}: client-side TTFT of every step request")
    if "cached_tokens" in ctx.config.plots:
        panels = {name: [(f"{r['step']}{'*' if r['after_restart'] else ''}.{i}", r["prompt_tokens"] or 0,
                          r["cached_tokens"] or 0)
                         for i, r in enumerate(x for x in rows if x["server"] == name and x["phase"] == "session")]
                  for name in names}
        ctx.plots.append(plots.request_bars_plot(
            panels, ctx.plot_path("cached-tokens"),
            f"{ctx.model_name}: Claude Code, prompt and cached tokens per request (step.request; * after SIGKILL "
            f"and restart before step {restart_before})"))


def transcript_text(transcripts: dict, flags=None, title: str = "=== {name} ===") -> str:
    """What Claude Code printed, per server (or session) and step, as a reader would skim it: each step's
    command (``flags(name, step)``: what follows its prompt; default ``--continue`` after the first), the
    model's text and tool calls, the tools' results and the closing result, cut to a few lines each."""
    flags = flags or (lambda name, s: " --continue" if s["step"] > 1 else "")
    out = []
    for name, steps in transcripts.items():
        out.append(title.format(name=name))
        for s in steps:
            out.append(f"\n$ claude -p {s['prompt']!r}{flags(name, s)}   "
                       f"# step {s['step']}: exit {s['returncode']}, {s['wall_s']:.1f} s")
            for e in s["events"]:
                out.extend(_event_lines(e))
        out.append("")
    return "\n".join(out) + "\n"


def _event_lines(e: dict) -> list[str]:
    def cut(text) -> str:
        text = str(text).replace("\n", " ")
        return text if len(text) <= 240 else text[:240] + " ..."

    kind = e.get("type")
    if kind in ("assistant", "user"):
        lines = []
        for b in (e.get("message") or {}).get("content") or []:
            if not isinstance(b, dict):
                continue
            if b.get("type") == "text":
                lines.append(f"  {kind}: {cut(b.get('text'))}")
            elif b.get("type") == "tool_use":
                lines.append(f"  tool call: {b.get('name')} {cut(b.get('input'))}")
            elif b.get("type") == "tool_result":
                lines.append(f"  tool result: {cut(b.get('content'))}")
        return lines
    if kind == "result":
        return [f"  result: {e.get('subtype')}, {e.get('num_turns')} turns, stop {e.get('stop_reason')}: "
                f"{cut(e.get('result') or '')}"]
    return []


def headline(doc: dict) -> list[str]:
    c = doc.get("checks", {})
    if doc.get("outputs", {}).get("skipped"):
        return [f"  skipped: {doc['outputs']['skipped']}"]
    lines = []
    for name in doc.get("outputs", {}).get("setup", {}).get("servers", []):
        lines.append(f"  {name:9} refused {c.get(f'refused_{name}')}, requests {c.get(f'requests_{name}')}, "
                     f"cached÷prompt min {c.get(f'cached_ratio_min_{name}')}, after restart "
                     f"{c.get(f'cached_ratio_min_after_restart_{name}')}, wall {c.get(f'session_wall_s_{name}')} s"
                     f" + {c.get(f'restart_wall_s_{name}')} s after restart")
    return lines


def _validate(p: dict) -> None:
    if not p["servers"] or p["servers"][0] != OURS or not set(p["servers"]) <= set(SERVERS):
        raise ValueError(f"servers must start with {OURS!r} and be some of {SERVERS}, not {p['servers']}")
    if not p["steps"] or not 1 < p["restart_before"] <= len(p["steps"]) + 1:
        raise ValueError("steps must hold at least one prompt and 1 < restart_before <= len(steps) + 1")


KIND = register(TrialKind(
    name="claude_code",
    run=run,
    params={
        "servers": Param(list, list(SERVERS), f"ours first, then peers with an Anthropic API, of {SERVERS}"),
        "version": Param(str, cc.VERSION, "the Claude Code release installed from npm"),
        "steps": Param(list, ["Read greet.py and tell me what it prints."], "one claude -p per prompt, "
                                                                            "each after the first with --continue"),
        "restart_before": Param(int, 2, "SIGKILL and restart every server before this step (len(steps)+1: never)"),
        "max_turns": Param(int, 3, "claude --max-turns: requests a step may make when the model calls tools",
                           min=1),
        "max_output_tokens": Param(int, 256, "CLAUDE_CODE_MAX_OUTPUT_TOKENS in the steps (0: not set; never in the "
                                             "probe)", min=0),
        "grace_s": Param(float, 5.0, "seconds between a step's client exiting and the SIGKILL"),
        "probe_timeout_s": Param(float, 900.0, "the probe stops at its first answer, or after this long"),
        "step_timeout_s": Param(float, 1800.0, "a step's client is killed after this long"),
        "server_settings": Param(dict, {OURS: {"pool_mb": 4096}}, "each server's own settings (its defaults else)"),
        "model_dir": Param(str, "", "a model directory to serve instead of the named one"),
    },
    plots=frozenset({"cached_tokens"}),
    needs_model=False,
    validate=_validate,
    trial_code=(_Side.step, _probe, cc.run_session, LoggingProxy),
    headline=headline,
))
