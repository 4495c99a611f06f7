"""EXP-012, two models: Claude Code against one server holding two models, its names mapped by aliases alone.

One ``semantic serve`` holds ``main`` (Gemma 3 270M) and ``small`` (SmolLM2), with
``--alias 'claude-*haiku*=small' --alias 'claude-*=main' --alias 'gpt-*=main'``. Claude Code (EXP-012's
install, print mode) gets nothing but the base URL and a token: no model variable of any kind, so it
sends its own names. Two sessions in one scratch repository, their steps taken in turn::

    probe main │ probe small │ main 1 │ small 1 │ main 2 │ small 2 │ main 3
    (defaults, stopped at the first answer)   (each step one ``claude -p``; --resume its session after the first)

**main** is Claude Code as it starts: its default model (``claude-opus-5-5`` in 2.1.330), every tool.
**small** runs as an agent defined with ``model: haiku`` (``--agents`` / ``--agent``, Claude Code's own
way to put an agent on its Haiku model), so its requests go out as ``claude-haiku-5-5``. In print mode
Claude Code sends no side requests (titles, summaries) with a token that is not Anthropic's, and its
Haiku name reaches the server only this way (see the experiment's README). The steps bound replies
with ``CLAUDE_CODE_MAX_OUTPUT_TOKENS`` (not a model variable), as EXP-012 does; the probes set nothing.
Every request passes EXP-012's logging proxy, which records the name sent and the reply's ``model``
(the id it resolved to); :mod:`harness.trials.claude_code.model_routes` counts them.
"""

from __future__ import annotations

import json
import tempfile
import time
import urllib.request
from pathlib import Path

from harness import plots
from harness.servers import processes
from harness.servers.targets import OURS, TARGETS
from harness.trials.base import TrialKind, Param, register
from harness.trials.claude_code import session as cc
from harness.trials.claude_code.model_routes import count_by_model, kind_of
from harness.trials.claude_code.proxy import LoggingProxy
from harness.trials.claude_code.trial import _trim, scratch_repo, transcript_text

SESSIONS = ("main", "small")


def run(ctx) -> None:
    p, res = ctx.params, ctx.results
    try:
        install = cc.ensure(p["version"])
    except cc.ClientMissing as exc:
        res.output("skipped", str(exc))
        return
    dirs = _model_dirs(ctx)
    work = Path(tempfile.mkdtemp(prefix="exp012-models-"))
    settings = {"models": {mid: str(d) for mid, d in dirs.items()}, "aliases": dict(p["aliases"]),
                **p["server_settings"]}
    t0 = time.perf_counter()
    server = processes.start(TARGETS[OURS], dirs["main"], processes.free_port(), work / "server", model_id="main",
                             **settings)
    res.output("setup", {"claude_code": install.version, "models": settings["models"], "aliases": settings["aliases"],
                         "server_command": _command_line(server.log_path), "agent": p["small_agent"],
                         "env": sorted(cc.session_env("URL", None, work / "home", _bound(p))),
                         "steps": {"main": p["main_steps"], "small": p["small_steps"]},
                         "max_output_tokens": p["max_output_tokens"], "max_turns": p["max_turns"]})
    ctx.progress.total = 2 + len(p["main_steps"]) + len(p["small_steps"])
    try:
        with LoggingProxy(server.url, port=processes.free_port(), bodies_dir=work / "bodies") as proxy:
            sessions = _Sessions(install, proxy, scratch_repo(work / "repo"), work / "home", p)
            for name in SESSIONS:
                sessions.probe(name)
                ctx.progress.update(1)
            for name, prompt in interleave(p["main_steps"], p["small_steps"]):
                sessions.step(name, prompt)
                ctx.progress.update(1)
            time.sleep(1.0)  # the relay records a stream's last bytes after the client has them
            rows = [{**e.row(), **sessions.tags[e.index]} for e in proxy.exchanges]
        fleet = {"models": _get(server.url + "/v1/models").get("data"),
                 "stats": {mid: _get(f"{server.url}/v1/cache/stats?model={mid}") for mid in dirs}}
    finally:
        server.stop()
    run_wall_s = time.perf_counter() - t0
    record(ctx, rows, sessions.transcripts, fleet, settings, run_wall_s,
           env=cc.session_env("URL", None, work / "home", _bound(p)))


def _model_dirs(ctx) -> dict[str, Path]:
    from harness import models

    p, variant = ctx.params, models.default_variant(ctx.config.model_variant)
    return {"main": Path(p["main_dir"] or models.prepare(ctx.model_name, variant=variant)),
            "small": Path(p["small_dir"] or models.prepare(p["small_model"], variant=variant))}


def interleave(main: list[str], small: list[str]) -> list[tuple[str, str]]:
    """The two sessions' steps in turn, main first: ``[(session, prompt), ...]``."""
    out = []
    for i in range(max(len(main), len(small))):
        out += [(name, steps[i]) for name, steps in (("main", main), ("small", small)) if i < len(steps)]
    return out


def _bound(p: dict) -> dict[str, str]:
    return {"CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(p["max_output_tokens"])} if p["max_output_tokens"] else {}


class _Sessions:
    """The two Claude Code sessions in one repository and HOME: their ids, transcripts and rows' tags."""

    def __init__(self, install: cc.Install, proxy: LoggingProxy, repo: Path, home: Path, p: dict):
        self.install, self.proxy, self.repo, self.home, self.p = install, proxy, repo, home, p
        self.ids: dict[str, str | None] = {}
        self.steps = {name: 0 for name in SESSIONS}
        self.transcripts: dict[str, list] = {name: [] for name in SESSIONS}
        self.tags: dict[int, dict] = {}

    def args(self, name: str) -> tuple[str, ...]:
        if name == "main":
            return ()
        agent = dict(self.p["small_agent"])
        return ("--agents", json.dumps({agent.pop("name"): agent}), "--agent", self.p["small_agent"]["name"])

    def _tag(self, first: int, **tag) -> None:
        for e in self.proxy.exchanges[first:]:
            self.tags.setdefault(e.index, tag)

    def step(self, name: str, prompt: str) -> None:
        self.steps[name] += 1
        step, first = self.steps[name], len(self.proxy.exchanges)
        resume = ("--resume", self.ids[name]) if self.ids.get(name) else ()
        s = cc.run_session(self.install, base_url=self.proxy.url, model=None, repo=self.repo, home=self.home,
                           prompt=prompt, max_turns=self.p["max_turns"], extra_env=_bound(self.p),
                           timeout_s=self.p["step_timeout_s"], args=(*self.args(name), *resume))
        self.ids[name] = self.ids.get(name) or s.session_id
        self.transcripts[name].append({"step": step, "prompt": prompt, "returncode": s.returncode,
                                       "wall_s": round(s.wall_s, 3), "session_id": s.session_id,
                                       "events": [_trim(e) for e in s.events], "stderr": s.stderr[-1500:]})
        self._tag(first, session=name, phase="step", step=step, step_wall_s=round(s.wall_s, 3),
                  step_returncode=s.returncode)

    def probe(self, name: str) -> None:
        """Nothing set but the base URL and the token (Claude Code's own budget too), stopped at the first
        answer that streams (or a refusal, or the client's exit, or ``probe_timeout_s``)."""
        first = len(self.proxy.exchanges)
        proc = cc.start(self.install, base_url=self.proxy.url, model=None, repo=self.repo, home=self.home,
                        prompt=self.p["main_steps"][0] if name == "main" else self.p["small_steps"][0],
                        max_turns=self.p["max_turns"], args=self.args(name))
        deadline = time.monotonic() + self.p["probe_timeout_s"]
        while proc.poll() is None and time.monotonic() < deadline and not any(
                (e.status or 0) >= 400 or (e.status == 200 and e.ttft_s is not None)
                for e in self.proxy.exchanges[first:]):
            time.sleep(0.5)
        cc.stop(proc)
        proc.communicate()
        time.sleep(1.0)  # the relay notices the client left
        self._tag(first, session=f"probe-{name}", phase="probe", step=0, step_wall_s=None, step_returncode=None)


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def _command_line(log_path: Path) -> str:
    """The server's command as its log's first line records it."""
    first = log_path.read_text(errors="replace").splitlines()[:1]
    return first[0].removeprefix("$ ") if first else ""


# ---------------------------------------------------------------- results


def checks_of(counts: dict, env: dict[str, str]) -> dict:
    """The goals' figures from :func:`count_by_model`'s counts and the environment Claude Code was given."""
    c = {"requests": counts["requests"], "refused": counts["refused"], "misrouted": counts["misrouted"],
         "model_variables_set": sum(k in env for k in cc.MODEL_VARIABLES)}
    for mid, m in counts["per_model"].items():
        c[f"requests_{mid}"] = m["requests"]
        c[f"requests_with_cache_reads_{mid}"] = m["requests_with_cache_reads"]
        c[f"cached_tokens_{mid}"] = m["cached_tokens"]
        c[f"cached_ratio_min_{mid}"] = m["cached_ratio_min_after_first"]
    return c


def record(ctx, rows: list[dict], transcripts: dict, fleet: dict, settings: dict, run_wall_s: float,
           env: dict[str, str]) -> None:
    res = ctx.results
    ids = list(settings["models"])
    counts = count_by_model(rows, ids, settings["aliases"])
    res.output("requests", rows)
    res.output("by_model", counts)
    res.output("fleet", fleet)
    res.output("transcripts", transcripts)
    checks = {**checks_of(counts, env), "run_wall_s": round(run_wall_s, 1)}
    res.checks(checks)
    ctx.plot_path("transcript").with_suffix(".txt").write_text(
        proxy_log_text(rows, settings) + "\n" + sessions_text(transcripts, ctx.params["small_agent"]["name"]))
    for mid in ids:
        ttfts = [r["ttft_s"] for r in rows if r.get("served_model") == mid and r["phase"] == "step" and r["ttft_s"]]
        if ttfts:
            res.metric(f"ttft_{mid}", ttfts, "s", "lower", f"{mid}: client-side TTFT of its step requests")
    if "cached_tokens" in ctx.config.plots:
        ctx.plots.append(plot_cached(rows, ids, ctx.plot_path("cached-tokens")))


def plot_cached(rows: list[dict], ids: list[str], path: Path) -> Path:
    """Prompt and cached tokens per request, one panel per model that answered (labels: session's initial,
    step, the model's request number)."""
    panels = {mid: [(f"{r['session'][:1]}{r['step']}.{i}", r["prompt_tokens"] or 0, r["cached_tokens"] or 0)
                    for i, r in enumerate(x for x in rows if x.get("served_model") == mid)] for mid in ids}
    return plots.request_bars_plot(panels, path, "Claude Code, no model variables: tokens per request by the model "
                                                 "that answered (p: probe, m/s: main/small session step)")


def proxy_log_text(rows: list[dict], settings: dict) -> str:
    """The proxy's log as a reader skims it: per request, the session, the name sent and the model that
    answered, status, tokens, TTFT, and the first words asked and answered."""
    def cut(text, n=160) -> str:
        text = " ".join(str(text or "").split())
        return text if len(text) <= n else text[:n] + " ..."

    out = [f"aliases: {settings['aliases']}", "#  session      step  sent -> answered            kind    status "
           "prompt cached  ttft_s stop"]
    for r in rows:
        out.append(f"{r['index']:<3}{r['session']:<13}{r['step']:>4}  {r['model']} -> {r['served_model']!s:<8}"
                   f"{kind_of(r):>7} {r['status']!s:>6} {r['prompt_tokens']!s:>6} {r['cached_tokens']!s:>6} "
                   f"{(r['ttft_s'] or 0):7.2f} {r['stop_reason']}")
        out.append(f"     asked: {cut(r.get('asked'))}")
        out.append(f"     answer: {cut(r.get('reply'))}" + (f"  error: {cut(r['error'])}" if r.get("error") else ""))
    return "\n".join(out) + "\n"


def sessions_text(transcripts: dict, agent: str) -> str:
    """What Claude Code printed, per session and step, under the command each step ran (the agent's
    JSON elided), as EXP-012's transcript renders it."""
    def flags(name: str, s: dict) -> str:
        chosen = f" --agents '{{\"{agent}\": {{...}}}}' --agent {agent}" if name == "small" else ""
        return chosen + (f" --resume {s['session_id']}" if s["step"] > 1 else "")

    return transcript_text(transcripts, flags, "=== {name} session ===")


def headline(doc: dict) -> list[str]:
    if doc.get("outputs", {}).get("skipped"):
        return [f"  skipped: {doc['outputs']['skipped']}"]
    c, counts = doc.get("checks", {}), doc.get("outputs", {}).get("by_model", {})
    lines = [f"  requests {c.get('requests')}, refused {c.get('refused')}, misrouted {c.get('misrouted')}, "
             f"model variables set {c.get('model_variables_set')}, run {c.get('run_wall_s')} s",
             f"  routes: {counts.get('routes')}"]
    for mid, m in (counts.get("per_model") or {}).items():
        lines.append(f"  {mid:6} requests {m['requests']} ({m['turns']} turns, {m['helpers']} helpers), cached "
                     f"{m['cached_tokens']} tokens on {m['requests_with_cache_reads']} requests, cached÷prompt min "
                     f"{m['cached_ratio_min_after_first']}")
    return lines


def _validate(p: dict) -> None:
    if "name" not in p["small_agent"] or "prompt" not in p["small_agent"]:
        raise ValueError("small_agent needs a name and a prompt (and a model: haiku, the point of the session)")


KIND = register(TrialKind(
    name="claude_code_models",
    run=run,
    params={
        "version": Param(str, cc.VERSION, "the Claude Code release installed from npm"),
        "small_model": Param(str, "smollm2-135m", "the model served as `small` (the run's model is `main`)"),
        "main_dir": Param(str, "", "a model directory to serve as main instead of the named one"),
        "small_dir": Param(str, "", "a model directory to serve as small instead of the named one"),
        "aliases": Param(dict, {"claude-*haiku*": "small", "claude-*": "main", "gpt-*": "main"},
                         "the server's --alias PATTERN=ID, in order"),
        "main_steps": Param(list, ["Read greet.py and tell me what it prints."], "the main session's prompts",
                               nonempty=True),
        "small_steps": Param(list, ["Read greet.py and tell me what it prints."], "the small session's prompts",
                                nonempty=True),
        "small_agent": Param(dict, {"name": "quick", "description": "Answers short questions about files",
                                    "prompt": "You answer questions about this repository's files in one sentence.",
                                    "model": "haiku", "tools": ["Read"]},
                             "the agent the small session runs as (--agents / --agent)"),
        "max_turns": Param(int, 3, "claude --max-turns: requests a step may make when the model calls tools",
                           min=1),
        "max_output_tokens": Param(int, 128, "CLAUDE_CODE_MAX_OUTPUT_TOKENS in the steps (0: not set; never in "
                                             "the probes)", min=0),
        "probe_timeout_s": Param(float, 900.0, "a probe stops at its first answer, or after this long"),
        "step_timeout_s": Param(float, 1800.0, "a step's client is killed after this long"),
        "server_settings": Param(dict, {"pool_mb": 4096}, "more of our server's settings"),
    },
    plots=frozenset({"cached_tokens"}),
    needs_model=False,
    validate=_validate,
    trial_code=(_Sessions.step, _Sessions.probe, count_by_model, cc.run_session, LoggingProxy),
    headline=headline,
))
