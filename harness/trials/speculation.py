"""EXP-014: prompt-lookup speculation, turn time on edit-style and plain chat replies.

Three servers on one model directory, started side by side and asked in
turn (the first side rotates each sample), so each sample's three turns run
under the same load:

- ``on``: ours, speculation on (the default);
- ``off``: ours with ``--no-speculation``;
- ``mlx_lm``: ``mlx_lm.server``.

**Edit-style turns**: the user message holds a ~300-token stretch of this
repository's own source and asks for it back with one name changed; the
reply copies most of it. **Chat turns**: a question whose answer is not
in the prompt. Each sample is a prompt no side has seen (another file,
another stretch), so every side prefills it once, cold. Batch 1 sends one
turn at a time; batch ``batch`` sends that many different turns at once to
the same side and times the slowest.

Turn time is the client's: request sent to the whole (non-streamed) reply
read. Replies are greedy and must be the same text on every side: a
difference is counted, and the time ratios are only meaningful without one.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from harness.servers import processes
from harness.servers.targets import MLX_LM, OURS, ROOT, TARGETS
from harness.trials.base import TrialKind, Param, register

SIDES = ("on", "off", "mlx_lm")
SOURCES = ("semantic/sched/scheduler.py", "semantic/sched/planner.py", "semantic/runner/executor.py", "semantic/store/__init__.py",
           "semantic/cache/pool.py", "semantic/cache/blocks.py", "semantic/chat/echo.py", "semantic/service.py",
           "semantic/sched/residency.py", "semantic/chat/toolformat.py", "semantic/cache/convert.py", "semantic/cache/reuse.py")
RENAMES = (("self", "this"), ("seq", "sequence"), ("blocks", "pages"), ("agent", "worker"), ("cache", "memo"))
SYSTEM = ("You are a careful coding assistant. When asked to edit code, reply with the complete edited code "
          "and nothing else.")
QUESTIONS = ("Why is the sky blue?", "What makes a good breakfast?", "How do birds know where to migrate?",
             "Give me three tips for learning a new language.", "What is the difference between weather and climate?",
             "Why do cats purr?", "How does a bicycle stay upright?", "What should I pack for a weekend hike?",
             "Explain what a rainbow is to a child.", "Why do we dream?")


def edit_prompt(tokenizer, sample: int, span_tokens: int) -> list[dict]:
    """An edit-style turn: ``span_tokens`` of a source file, to be returned with one name changed."""
    text = (ROOT / SOURCES[sample % len(SOURCES)]).read_text()
    ids = tokenizer.encode(text)
    start = min(len(ids) - span_tokens, 400 + 97 * (sample // len(SOURCES)))
    code = tokenizer.decode(ids[max(start, 0): max(start, 0) + span_tokens])
    old, new = RENAMES[sample % len(RENAMES)]
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Here is some Python code:\n\n```python\n{code}\n```\n\n"
                                        f"Rename `{old}` to `{new}` everywhere and reply with the whole code."}]


def chat_prompt(sample: int) -> list[dict]:
    return [{"role": "user", "content": QUESTIONS[sample % len(QUESTIONS)]}]


def _turn(url: str, model: str, messages: list[dict], max_tokens: int) -> dict:
    body = json.dumps({"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=900) as r:
        doc = json.loads(r.read())
    return {"s": time.perf_counter() - t0, "text": doc["choices"][0]["message"]["content"] or "",
            "tokens": doc["usage"]["completion_tokens"]}


def _spec_counts(url: str) -> dict:
    with urllib.request.urlopen(url + "/v1/cache/stats", timeout=30) as r:
        return json.loads(r.read()).get("speculation", {})


def run(ctx) -> None:
    from mlx_lm.utils import load_tokenizer

    from harness import models

    p, res = ctx.params, ctx.results
    model_dir = Path(models.prepare(ctx.model_name, variant=models.default_variant(ctx.config.model_variant)))
    tokenizer = load_tokenizer(model_dir)
    work = Path(tempfile.mkdtemp(prefix="exp014-"))
    launch = {"on": (OURS, {}), "off": (OURS, {"speculation": False}), "mlx_lm": (MLX_LM, {})}
    servers: dict[str, processes.Running] = {}
    rows: list[dict] = []
    plan = [("edit", 1, s) for s in range(p["edit_samples"])] + [("chat", 1, s) for s in range(p["chat_samples"])]
    plan += [("edit", p["batch"], s) for s in range(p["batch_samples"])]
    ctx.progress.total = len(plan)
    try:
        for side, (target, settings) in launch.items():
            servers[side] = processes.start(TARGETS[target], model_dir, processes.free_port(), work / side,
                                            model_id=ctx.model_name, python=sys.executable, **settings)
        for i, (shape, batch, sample) in enumerate(plan):
            turns = [edit_prompt(tokenizer, 1000 * batch + sample * batch + j, p["span_tokens"]) if shape == "edit"
                     else chat_prompt(sample * batch + j) for j in range(batch)]
            max_tokens = p["edit_max_tokens"] if shape == "edit" else p["chat_max_tokens"]
            for side in SIDES[i % 3:] + SIDES[: i % 3]:  # the first side rotates
                s = servers[side]
                t0 = time.perf_counter()
                with cf.ThreadPoolExecutor(batch) as pool:
                    out = list(pool.map(lambda m: _turn(s.url, s.model, m, max_tokens), turns))
                rows.append({"shape": shape, "batch": batch, "sample": sample, "side": side,
                             "wall_s": time.perf_counter() - t0, "turn_s": [o["s"] for o in out],
                             "tokens": [o["tokens"] for o in out], "texts": [o["text"] for o in out]})
            ctx.progress.update(1)
        counts = {side: _spec_counts(servers[side].url) for side in ("on", "off")}
    finally:
        for s in servers.values():
            s.stop()
    res.output("turns", [{k: v for k, v in r.items() if k != "texts"} for r in rows])
    res.output("speculation", counts)
    for k, v in checks(rows).items():
        res.check(k, v)
    for shape, batch in {(r["shape"], r["batch"]) for r in rows}:
        for side in SIDES:
            res.metric(f"{shape}_b{batch}_{side}_s", [r["wall_s"] for r in rows if (r["shape"], r["batch"], r["side"])
                                                       == (shape, batch, side)], "s", "lower",
                       f"{shape} turns, batch {batch}, {side}: client time to the whole reply")


def checks(rows: list[dict]) -> dict:
    """Per (shape, batch): the median over samples of on ÷ off and on ÷ mlx_lm turn time; texts that differ."""
    out: dict = {}
    by = {(r["shape"], r["batch"], r["sample"], r["side"]): r for r in rows}
    groups = sorted({(r["shape"], r["batch"]) for r in rows})
    differ = 0
    for shape, batch in groups:
        samples = sorted({k[2] for k in by if k[:2] == (shape, batch)})
        for other in ("off", "mlx_lm"):
            ratios = [by[shape, batch, s, "on"]["wall_s"] / by[shape, batch, s, other]["wall_s"] for s in samples]
            out[f"{shape}_b{batch}_on_over_{other}"] = statistics.median(ratios)
        for s in samples:
            texts = {side: by[shape, batch, s, side]["texts"] for side in SIDES}
            differ += sum(texts["on"][j] != texts[o][j] for o in ("off", "mlx_lm") for j in range(batch))
        out[f"{shape}_b{batch}_tokens_median"] = statistics.median(
            t for s in samples for t in by[shape, batch, s, "on"]["tokens"])
    out["text_differences"] = differ
    return out


KIND = register(TrialKind(
    name="speculation",
    run=run,
    params={
        "edit_samples": Param(int, 5, "edit-style turns at batch 1, per side", min=1),
        "chat_samples": Param(int, 5, "plain chat turns at batch 1, per side", min=1),
        "batch": Param(int, 4, "turns sent at once in the batched samples", min=1),
        "batch_samples": Param(int, 3, "batched edit-style samples, per side", min=0),
        "span_tokens": Param(int, 300, "tokens of source code an edit-style turn quotes", min=1),
        "edit_max_tokens": Param(int, 400, "the most tokens an edit-style reply takes"),
        "chat_max_tokens": Param(int, 160, "the most tokens a chat reply takes"),
    },
    needs_model=False,
    trial_code=(_turn, edit_prompt, chat_prompt),
))
