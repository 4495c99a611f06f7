"""EXP-023: how many copies of an agent's cache a server holds, measured from outside the process.

One server at a time loads a tiny-body model with a real model's KV geometry
(``harness.trials.real_geometry.models``: Qwen3-Coder-30B-A3B's 48 layers x 4 KV heads x 128 by default), so
the cache's bytes are real and the compute is cheap. An agent's first turn prefills ``first_tokens`` tokens,
then ``appends`` turns each add ``append_tokens`` (a coding agent's tool output), every one a
``/v1/completions`` of the whole text so far, greedy, ``max_tokens`` 2, the agent named by ``X-Agent-Id``
(mlx-lm's server finds the prefix in its own prompt cache). The server's resident set (it and its children)
is sampled every 100 ms from start to stop (``MemorySampler``); each turn reports its peak above the idle
server's RSS (the median of the ``settle_samples`` taken after one 4-token warm-up turn has ended) and the
RSS after it (the median of the last 3 samples of ``settle_samples``: a second by default, the least an
agent's tool call takes before its next turn), each over the KV bytes of the agent's cache at that length:
1.0 is one copy.

The sides: ours at each tree of ``trees`` (this checkout, or a commit in a worktree, as EXP-022 resolves
them), and ``mlx_lm.server`` with its own defaults, one after another on the same prompts.
"""

from __future__ import annotations

import dataclasses
import random
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

from harness.trials.base import Param, TrialKind, register

MB = 1 << 20


def kv_bytes_per_token(model_dir: Path) -> int:
    """K and V of every attention layer for one token, in the model's dtype (a global-attention geometry)."""
    import json

    c = json.loads((model_dir / "config.json").read_text())
    head = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    width = {"bfloat16": 2, "float16": 2, "float32": 4}[c.get("torch_dtype", "float32")]
    return c["num_hidden_layers"] * c["num_key_value_heads"] * head * 2 * width


def text(n: int, seed: int) -> str:
    """``n`` characters of words (the byte tokenizer: one token a character), seeded."""
    rng = random.Random(seed)
    words = ("read", "file", "def", "return", "self", "cache", "block", "token", "layer", "value", "agent")
    out: list[str] = []
    size = 0
    while size < n:
        w = rng.choice(words) + rng.choice((" ", " ", "\n", "(", ")", ": "))
        out.append(w)
        size += len(w)
    return "".join(out)[:n]


def run(ctx) -> None:
    from harness.trials.commit_compare import trees
    from harness.trials.real_geometry.models import write_model

    p = ctx.params
    model_dir = write_model(p["geometry"])
    per_token = kv_bytes_per_token(model_dir)
    work = Path(tempfile.mkdtemp(prefix="exp023-"))
    sides = [("ours", trees.resolve(t)) for t in p["trees"]] + ([("mlx_lm", None)] if p["with_mlx_lm"] else [])
    out: dict = {"geometry": p["geometry"], "kv_bytes_per_token": per_token, "sides": {}, "failed": []}
    ctx.progress.total = len(sides)
    try:
        for kind, tree in sides:
            name = f"ours-{tree.label}" if tree else "mlx_lm.server"
            try:
                out["sides"][name] = _side(kind, tree, model_dir, p, per_token, work / name.replace("/", "_"))
                if tree:
                    out["sides"][name]["tree"] = {**dataclasses.asdict(tree), "root": str(tree.root)}
            except Exception as exc:  # recorded (a P0 fails); the other sides still run
                out["failed"].append({"part": name, "error": "".join(traceback.format_exception(exc))[-6000:]})
                print(f"EXP-023 {name} failed: {exc}", file=sys.stderr)
            ctx.progress.update(1)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _record(ctx, out)


def _side(kind: str, tree, model_dir: Path, p: dict, per_token: int, work: Path) -> dict:
    import httpx

    from harness.servers import processes
    from harness.servers.targets import MLX_LM, OURS, TARGETS
    from harness.trials.multi_model.sampler import MemorySampler

    target = TARGETS[OURS if kind == "ours" else MLX_LM]
    if tree is not None:
        target = dataclasses.replace(target, name=f"ours-{tree.label}",
                                     env=lambda launch: {"PYTHONPATH": str(tree.root)})
    running = processes.start(target, model_dir, processes.free_port(), work, model_id="m")
    sampler = MemorySampler(lambda: running.pid, None, interval_s=0.1, phase="idle").start()
    turns: list[dict] = []
    try:
        with httpx.Client(base_url=running.url, timeout=p["timeout_s"]) as http:
            def turn(prompt: str, agent: str | None) -> float:
                headers = {"X-Agent-Id": agent} if agent and kind == "ours" else {}
                began = time.perf_counter()
                body = {"prompt": prompt, "max_tokens": 2, "temperature": 0.0}
                # mlx_lm.server loads a named model it does not hold: unnamed, it answers with the one loaded
                r = http.post("/v1/completions", headers=headers, json={**body, "model": "m"} if kind == "ours" else body)
                r.raise_for_status()
                return time.perf_counter() - began

            turn("Hi\nH", None)
            idle = settled_rss(sampler, p["settle_samples"])
            prompt = text(p["first_tokens"], 0)
            for i in range(p["appends"] + 1):
                if i:
                    prompt += text(p["append_tokens"], i)
                sampler.phase = f"turn{i}"
                seconds = turn(prompt, "agent")
                sampler.phase = f"after{i}"
                sampler.wait_samples(p["settle_samples"])
                during = [r["rss_bytes"] for r in sampler.rss if r["phase"] in (f"turn{i}", f"after{i}")]
                after = [r["rss_bytes"] for r in sampler.rss if r["phase"] == f"after{i}"][-3:]
                kv = len(prompt) * per_token
                turns.append({"turn": i, "tokens": len(prompt), "kv_bytes": kv, "seconds": seconds,
                              "peak_above_idle": max(during) - idle, "after_above_idle": _median(after) - idle,
                              "peak_x_kv": (max(during) - idle) / kv, "after_x_kv": (_median(after) - idle) / kv})
                print(f"  {target.name} turn {i}: {len(prompt)} tokens, peak {turns[-1]['peak_x_kv']:.2f}x, "
                      f"after {turns[-1]['after_x_kv']:.2f}x the KV, {seconds:.1f} s", file=sys.stderr)
    except Exception as exc:
        raise RuntimeError(f"{exc!r}\n{running.log_tail(2500)}") from exc
    finally:
        sampler.stop()
        running.stop(signal.SIGTERM)
    return {"idle_rss_bytes": idle, "turns": turns, "samples": len(sampler.rss)}


def settled_rss(sampler, n: int) -> int:
    """The median RSS of ``n`` samples taken from now on, in a phase of their own. (The samples of the
    phase before include the warm-up turn's own working memory: the last ten of them, taken as the idle
    server's RSS, read 137-274 MB from run to run where the settled server holds 136.)"""
    sampler.phase = "settled"
    sampler.wait_samples(n)
    return _median([r["rss_bytes"] for r in sampler.rss if r["phase"] == "settled"])


def _median(xs: list[int]) -> int:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else 0


def summary(out: dict) -> dict:
    """Per side: the largest peak over the appends, the largest and the last RSS after a turn, in copies of
    the cache (the first turn apart: a prefill's working memory is no copy)."""
    s = {}
    for name, d in out["sides"].items():
        appends = [t for t in d["turns"] if t["turn"] > 0]
        s[name] = {"first_peak_x_kv": d["turns"][0]["peak_x_kv"], "first_after_x_kv": d["turns"][0]["after_x_kv"],
                   "append_peak_x_kv": max((t["peak_x_kv"] for t in appends), default=None),
                   "append_after_x_kv_max": max((t["after_x_kv"] for t in appends), default=None),
                   "last_after_x_kv": d["turns"][-1]["after_x_kv"],
                   "append_seconds_median": _median([t["seconds"] for t in appends]) if appends else None,
                   "idle_rss_mb": d["idle_rss_bytes"] / MB}
    return s


def _record(ctx, out: dict) -> None:
    s = summary(out)
    ours = {k: v for k, v in s.items() if k.startswith("ours")}
    ctx.results.checks({"parts_failed": len(out["failed"]),
                        "ours_append_peak_x_kv": min((v["append_peak_x_kv"] for v in ours.values()), default=None),
                        "ours_after_x_kv": min((v["append_after_x_kv_max"] for v in ours.values()), default=None),
                        "summary": s})
    for name, d in out["sides"].items():
        ctx.results.metric(f"peak_x_kv_{name}", [t["peak_x_kv"] for t in d["turns"]], "x",
                           description="peak RSS above idle during each turn ÷ the cache's KV bytes")
        ctx.results.metric(f"after_x_kv_{name}", [t["after_x_kv"] for t in d["turns"]], "x",
                           description="RSS above idle after each turn ÷ the cache's KV bytes")
    for k in ("geometry", "kv_bytes_per_token", "sides", "failed"):
        ctx.results.output(k, out[k])
    text_ = text_table(out)
    print(text_)
    (ctx.out_dir / "README.md").write_text(f"# {ctx.config.name}\n\n```\n{text_}\n```\n")


def text_table(out: dict) -> str:
    """The console's and the README's table: one line per side, in copies of the cache."""
    lines = [f"{out['geometry']}: {out['kv_bytes_per_token'] // 1024} KiB of KV a token; copies of the cache "
             "(RSS above the idle server ÷ KV bytes)",
             f"{'side':28s} {'first peak':>10s} {'first after':>11s} {'append peak':>11s} {'after (max)':>11s} "
             f"{'last after':>10s} {'append s':>8s}"]
    for name, v in summary(out).items():
        lines.append(f"{name:28s} {v['first_peak_x_kv']:10.2f} {v['first_after_x_kv']:11.2f} "
                     f"{v['append_peak_x_kv'] or 0:11.2f} {v['append_after_x_kv_max'] or 0:11.2f} "
                     f"{v['last_after_x_kv']:10.2f} {v['append_seconds_median'] or 0:8.1f}")
    return "\n".join(lines)


KIND = register(TrialKind(
    name="memory_copies",
    run=run,
    needs_model=False,
    params={
        "geometry": Param(str, "qwen3-coder-30b-a3b", "a real_geometry model (a global-attention one)",
                          ("qwen3-coder-30b-a3b", "llama-3.1-8b")),
        "trees": Param(list, ["."], "our sides: '.' (this checkout) or commits/branches, as EXP-022 resolves them",
                       nonempty=True),
        "with_mlx_lm": Param(bool, True, "mlx_lm.server on the same prompts too"),
        "first_tokens": Param(int, 4096, "the agent's first turn", min=16),
        "append_tokens": Param(int, 250, "each append's new tokens", min=1),
        "appends": Param(int, 20, "turns after the first", min=1),
        "settle_samples": Param(int, 10, "RSS samples after a turn before the next (100 ms each: a second, as an "
                                         "agent's tool call at the least); 'after' is the median of the last 3",
                                min=1),
        "timeout_s": Param(float, 900.0, "one request's limit", min=1.0),
    },
    trial_code=(run, _side),
))
