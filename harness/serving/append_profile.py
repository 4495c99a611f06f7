"""Where a cached append turn's time goes: ~300 new tokens over a ~2K-token cache.

Two parts, both on one prepared model (SmolLM2-135M f32 by default):

- **engine**: in this process, a ``Service`` (the scheduler and engine the
  server runs) against mlx-lm's ``generate_step`` on the same tokens with a
  ``KVCache`` prefilled with the cached prefix. Our side is traced: every
  call of the functions named in ``TRACED`` is a span on its thread, and each
  span is placed before the turn's last token (on the client's critical
  path) or after it (the closing feed step, the extract, the save
  preparation). A few costs MLX's lazy evaluation hides inside other spans
  are timed apart: the prefill's chunking and per-chunk barrier, the
  log-softmax over the vocabulary, the chat template and the tokenizer.
- **http** (``--http``): ``semantic serve`` against ``python -m mlx_lm
  server`` on 127.0.0.1, interleaved A B / B A, timed from the client with
  streamed chat completions: TTFT (first content chunk) and the whole turn
  (the stream's end, after the usage chunk).

Each agent's first turn (``--cached`` tokens: a coding agent's system prompt
and a file it read) is untimed; its second appends ``--new`` tokens (a tool's
output) and is timed. Every sample is a fresh agent, so each timed turn
starts from the same cache.

    python -m harness.serving.append_profile --trials 5 --http --json results/exp_009_serving/long_append_profile.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SYSTEM = ("You are a coding agent in a Python repository. Tools: read_file(path), run_tests(pattern), "
          "apply_patch(diff). Keep answers short and never invent file names.")
# what the agent read (its first turn) and what a tool answered (the append): the project's own source
READ_FILE = ROOT / "semantic" / "scheduler.py"
TOOL_OUTPUT = ROOT / "semantic" / "planner.py"

# (module path, attribute, label): the engine's functions whose calls are traced as spans
TRACED = [
    ("semantic.convert", "reconstruct", "reconstruct (pooled blocks -> KVCache)"),
    ("semantic.convert", "extract", "extract (KVCache -> pooled blocks)"),
    ("semantic.cachefile", "prepare_save", "prepare_save (worker thread)"),
    ("semantic.reuse", "choose_start", "choose_start (prefix lookup)"),
    ("semantic.steploop.StepLoop", "_prefill", "prefill chunks (forward + per-chunk eval)"),
    ("semantic.steploop.StepLoop", "_decode", "decode step (queue forward)"),
    ("semantic.steploop.StepLoop", "_read_decoded", "decode read (wait for forward)"),
    ("semantic.steploop.StepLoop", "_join", "join batch (merge caches)"),
    ("semantic.engine.BlockPoolBatchEngine", "_record", "record token + on_token"),
    ("semantic.scheduler.ConcurrentScheduler", "_admit", "scheduler admit"),
    ("semantic.scheduler.ConcurrentScheduler", "_finish", "scheduler finish (save prep, residency)"),
    ("semantic.scheduler.ConcurrentScheduler", "_hold_budget", "scheduler RAM budget check"),
    ("mlx.core", "clear_cache", "mx.clear_cache"),
]


# ------------------------------------------------------------------ token material

def conversation(tokenizer, cached: int, new: int, trial: int) -> tuple[list[dict], str]:
    """A first turn's messages of about ``cached`` tokens, and a tool output of about ``new`` tokens
    (its first line names the trial, so no two samples' appends are equal)."""
    source = READ_FILE.read_text()
    lo, hi = 0, len(source)
    while hi - lo > 64:  # the longest prefix of the file that keeps the turn within ``cached`` tokens
        mid = (lo + hi) // 2
        msgs = _first_turn(source[:mid])
        n = len(tokens_of(tokenizer, msgs))
        lo, hi = (mid, hi) if n <= cached else (lo, mid)
    tool = TOOL_OUTPUT.read_text()
    ids = tokenizer.encode(tool, add_special_tokens=False)[: new - 12]
    return _first_turn(source[:lo]), f"run_tests #{trial}:\n" + tokenizer.decode(ids)


def tokens_of(tokenizer, messages: list[dict]) -> list[int]:
    """The chat template's token ids (rendered, then encoded: tokenizers differ in what ``tokenize=True`` gives)."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def _first_turn(text: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": "read_file('semantic/scheduler.py') returned:\n" + text}]


# ------------------------------------------------------------------ tracing

class Tracer:
    """Spans (label, thread, t0, t1) of the traced functions' calls, and stamps of one turn's events."""

    def __init__(self):
        self.spans: list[tuple[str, int, float, float]] = []
        self._undo = []

    def install(self) -> None:
        import importlib

        for where, attr, label in TRACED:
            parts = where.split(".")
            try:
                owner = importlib.import_module(where)
            except ModuleNotFoundError:
                owner = getattr(importlib.import_module(".".join(parts[:-1])), parts[-1])
            self._wrap(owner, attr, label)

    def _wrap(self, owner, attr: str, label: str) -> None:
        orig = getattr(owner, attr)
        spans = self.spans

        def traced(*a, **k):
            t0 = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                spans.append((label, threading.get_ident(), t0, time.perf_counter()))

        setattr(owner, attr, traced)
        self._undo.append((owner, attr, orig))

    def uninstall(self) -> None:
        for owner, attr, orig in reversed(self._undo):
            setattr(owner, attr, orig)
        self._undo.clear()


def _progress(line: str) -> None:
    print(f"[append-profile {time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.1f}] {line}", file=sys.stderr, flush=True)


def _ms(s: float) -> float:
    return round(s * 1e3, 2)


# ------------------------------------------------------------------ the engine part

def engine_part(model_dir: Path, trials: int, cached: int, new: int, max_tokens: int) -> dict:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from semantic import defaults
    from semantic.service import Service

    tmp = Path(tempfile.mkdtemp(prefix="append-profile-"))
    pool = defaults.POOL_MB << 20
    service = Service.open(str(model_dir), cache_dir=str(tmp / "agents"), pool_bytes=pool,
                           disk_budget_bytes=defaults.DISK_MB << 20, ram_budget_bytes=int(pool * defaults.RAM_SHARE))
    model, tok = service.scheduler.engine.model, service.tokenizer

    def turn(agent: str, ids, budget: int, stamps: dict | None = None):
        """One turn through the service; with ``stamps``, when each of its events happened."""
        def on_token(token, logprob, row):
            if stamps is not None:
                stamps.setdefault("first_token", time.perf_counter())
                stamps["last_token"] = time.perf_counter()
            return False

        def on_admit(n):
            if stamps is not None:
                stamps["admitted"] = time.perf_counter()

        plan = service.prepare(prompt=list(ids), max_tokens=budget, agent=agent, on_token=on_token, on_admit=on_admit)
        t0 = time.perf_counter()
        future = service.submit(plan.request)
        tokens = getattr(future, "tokens", None)
        if stamps is not None:
            stamps["submit"] = t0
            if tokens is not None:
                tokens.add_done_callback(lambda _: stamps.__setitem__("tokens_final", time.perf_counter()))
            future.add_done_callback(lambda _: stamps.__setitem__("completion", time.perf_counter()))
        c = future.result()
        service.scheduler.flush()  # the save is written before the next sample
        return c

    tracer = Tracer()
    rows, ref_rows, sides = [], [], []
    msgs, tool = conversation(tok, cached, new, 0)
    first = tokens_of(tok, msgs)
    warm = turn("warm-0", first, max_tokens)  # compiles, and leaves the prefix's blocks in the pool
    prefix = list(first) + list(warm.token_ids)
    ref_cache = prefilled(model, prefix)
    for trial in range(trials):
        _, tool = conversation(tok, cached, new, trial)
        appended = prefix + tok.encode("\n" + tool, add_special_tokens=False)
        for side in (("ours", "mlx-lm") if trial % 2 == 0 else ("mlx-lm", "ours")):
            if side == "ours":
                agent = f"append-{trial}"
                turn(agent, first, max_tokens)  # the untimed first turn: its tail over the pooled prefix
                stamps: dict = {}
                del tracer.spans[:]
                tracer.install()
                try:
                    c = turn(agent, appended, max_tokens, stamps)
                finally:
                    tracer.uninstall()
                rows.append(_account(stamps, list(tracer.spans), c, threading.get_ident()))
            else:
                ref_rows.append(_reference(model, service.eos, ref_cache, appended[len(prefix):], max_tokens,
                                           generate_step, mx))
            _progress(f"trial {trial + 1}/{trials} {side}: {(rows if side == 'ours' else ref_rows)[-1]['ttft_ms']} ms TTFT")
    micro = _micro(model, tok, prefix, appended, msgs, tool, service.scheduler.engine.prefill_chunk)
    service.close()
    return {"ours": rows, "mlx_lm": ref_rows, "micro": micro, "cached_tokens": len(prefix),
            "new_tokens": len(appended) - len(prefix), "prefill_chunk": service.scheduler.engine.prefill_chunk}


def _account(stamps: dict, spans: list, c, caller: int) -> dict:
    """One traced turn: its stamps from submit, and each label's ms before and after its last token."""
    t0 = stamps["submit"]
    last = stamps["last_token"]
    before, after = defaultdict(float), defaultdict(float)
    for label, thread, a, b in spans:
        if a < t0 or thread == caller:
            continue
        if b <= last:
            before[label] += b - a
        else:
            after[label] += b - max(a, last)
            before[label] += max(0.0, last - a)
    return {
        "cached_tokens": c.cached_tokens, "prompt_tokens": c.history_tokens, "generated": len(c.token_ids),
        "admitted_ms": _ms(stamps["admitted"] - t0), "ttft_ms": _ms(stamps["first_token"] - t0),
        "last_token_ms": _ms(last - t0), "tokens_final_ms": _ms(stamps["tokens_final"] - t0) if "tokens_final" in stamps else None,
        "completion_ms": _ms(stamps["completion"] - t0),
        "before_last_token": {k: _ms(v) for k, v in before.items()},
        "after_last_token": {k: _ms(v) for k, v in after.items()},
    }


def prefilled(model, prefix: list[int]) -> list:
    """mlx-lm's KVCache of ``prefix`` (2048-token steps, as its generate_step prefills)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    for i in range(0, len(prefix), 2048):
        model(mx.array([prefix[i:i + 2048]]), cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def back_to(cache: list, n: int) -> list:
    """``cache`` cut back to its first ``n`` tokens (a KVCache trims by moving its offset)."""
    from mlx_lm.models.cache import trim_prompt_cache

    trim_prompt_cache(cache, cache[0].offset - n)
    return cache


def _reference(model, eos, cache, new, max_tokens, generate_step, mx) -> dict:
    """mlx-lm's generate_step on ``new`` over ``cache`` (a KVCache of the prefix, cut back to it after)."""
    held = cache[0].offset
    t0 = time.perf_counter()
    first, n = None, 0
    for token, _ in generate_step(mx.array(new), model, prompt_cache=cache, max_tokens=max_tokens):
        first = first or time.perf_counter()
        n += 1
        if int(token) in eos:
            break
    t1 = time.perf_counter()
    back_to(cache, held)
    return {"ttft_ms": _ms(first - t0), "last_token_ms": _ms(t1 - t0), "generated": n}


def _micro(model, tok, prefix, appended, msgs, tool, chunk: int) -> dict:
    """Costs hidden inside other spans, each the median of a few runs."""
    import mlx.core as mx

    new = appended[len(prefix):]
    cache = prefilled(model, prefix)

    def prefill(step: int, barrier: bool, clear: bool) -> float:
        back_to(cache, len(prefix))
        t0 = time.perf_counter()
        for i in range(0, len(new), step):
            logits = model(mx.array([new[i:i + step]]), cache=cache)
            if i + step < len(new):
                if barrier:
                    mx.eval([c.state for c in cache])
                if clear:
                    mx.clear_cache()
        mx.eval(logits[:, -1, :], [c.state for c in cache])
        return time.perf_counter() - t0

    def median(f, n=3) -> float:
        f()
        return _ms(statistics.median(f() for _ in range(n)))

    _progress("micro-benchmarks")

    row = mx.random.normal((1, model.args.vocab_size))
    mx.eval(row)

    def logsoftmax():
        t0 = time.perf_counter()
        mx.eval(row - mx.logsumexp(row, axis=-1, keepdims=True))
        return time.perf_counter() - t0

    second = msgs + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": tool}]
    text = tok.apply_chat_template(second, add_generation_prompt=True, tokenize=False)

    def template():
        t0 = time.perf_counter()
        tok.apply_chat_template(second, add_generation_prompt=True, tokenize=False)
        return time.perf_counter() - t0

    def encode():
        t0 = time.perf_counter()
        tok.encode(text, add_special_tokens=False)
        return time.perf_counter() - t0

    return {
        f"prefill {len(new)} tokens in {chunk}-token chunks, eval + clear_cache between (ours)": median(lambda: prefill(chunk, True, True)),
        f"prefill in {chunk}-token chunks, eval between, no clear_cache": median(lambda: prefill(chunk, True, False)),
        f"prefill in {chunk}-token chunks, no barrier (one graph)": median(lambda: prefill(chunk, False, False)),
        f"prefill in one {len(new)}-token chunk (mlx-lm's 2048 step)": median(lambda: prefill(2048, False, False)),
        "log-softmax over the vocabulary (one row)": median(logsoftmax, 10),
        "chat template render (second turn)": median(template, 5),
        f"tokenize the second turn ({len(appended)} tokens)": median(encode, 5),
    }


# ------------------------------------------------------------------ the HTTP part

def http_part(model_dir: Path, trials: int, cached: int, new: int, max_tokens: int, workdir: Path,
              before: Path | None = None) -> dict:
    """Both servers (and, with ``before``, ours from that checkout too), their turns in rotating order."""
    import openai
    from transformers import AutoTokenizer

    from harness.serving import processes
    from harness.serving.targets import MLX_LM, OURS, TARGETS

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    sides = [(OURS, OURS, None), (MLX_LM, MLX_LM, None)] + ([(OURS + "@before", OURS, before)] if before else [])
    servers = {}
    path = os.environ.get("PYTHONPATH")
    try:
        for name, kind, checkout in sides:
            # each of ours imports ``semantic`` from its own checkout
            os.environ["PYTHONPATH"] = str(Path(checkout or ROOT).resolve())
            servers[name] = processes.start(TARGETS[kind], model_dir, processes.free_port(),
                                            workdir / name.replace(".", "_").replace("@", "_"), model_id="model")
        if path is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = path
        clients = {n: openai.OpenAI(base_url=f"{r.url}/v1", api_key="none", max_retries=0, timeout=600)
                   for n, r in servers.items()}
        samples = defaultdict(list)
        msgs, _ = conversation(tok, cached, new, 0)
        for name, client in clients.items():  # warm: compile, and the first turn's prefix cached
            _chat(client, servers[name].model, msgs, max_tokens, "warm", name)
        names = list(servers)
        for trial in range(trials):
            _, tool = conversation(tok, cached, new, trial + 1)
            k = trial % len(names)
            order = names[k:] + names[:k]  # each side first, second, ... in turn
            for name in order:
                client, model = clients[name], servers[name].model
                agent = f"append-{trial}"
                reply = _chat(client, model, msgs, max_tokens, agent, name)
                second = msgs + [{"role": "assistant", "content": reply["text"]}, {"role": "user", "content": tool}]
                got = _chat(client, model, second, max_tokens, agent, name)
                got["load"] = os.getloadavg()[0]
                samples[name].append(got)
                _progress(f"http trial {trial + 1}/{trials} {name}: TTFT {got['ttft_s']:.3f} s, turn {got['turn_s']:.3f} s")
        return {"samples": dict(samples)}
    finally:
        for r in servers.values():
            r.stop()


def _chat(client, model: str, messages: list[dict], max_tokens: int, agent: str, server: str) -> dict:
    """One streamed chat turn timed from the client: first content chunk, last content chunk, stream end."""
    from harness.serving.targets import OURS

    extra = {"prompt_cache_key": agent} if server.startswith(OURS) else {}
    t0 = time.perf_counter()
    first = last = None
    parts, usage = [], None
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                            stream=True, stream_options={"include_usage": True}, extra_body=extra)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            last = time.perf_counter()
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    end = time.perf_counter()
    details = getattr(usage, "prompt_tokens_details", None) if usage else None
    return {"text": "".join(parts), "ttft_s": (first or end) - t0, "last_token_s": (last or end) - t0,
            "turn_s": end - t0, "prompt_tokens": usage.prompt_tokens if usage else None,
            "cached_tokens": getattr(details, "cached_tokens", None) if details else None,
            "completion_tokens": usage.completion_tokens if usage else None}


# ------------------------------------------------------------------ report

def summarize(result: dict) -> dict:
    out = {}
    eng = result.get("engine")
    if eng:
        med = lambda rows, k: statistics.median(r[k] for r in rows if r.get(k) is not None) if any(
            r.get(k) is not None for r in rows) else None
        ours, ref = eng["ours"], eng["mlx_lm"]
        labels = sorted({k for r in ours for k in (*r["before_last_token"], *r["after_last_token"])})
        out["engine"] = {
            "ours_ttft_ms": med(ours, "ttft_ms"), "ours_last_token_ms": med(ours, "last_token_ms"),
            "ours_tokens_final_ms": med(ours, "tokens_final_ms"), "ours_completion_ms": med(ours, "completion_ms"),
            "ours_admitted_ms": med(ours, "admitted_ms"),
            "mlx_lm_ttft_ms": med(ref, "ttft_ms"), "mlx_lm_last_token_ms": med(ref, "last_token_ms"),
            "spans_ms": {l: {"before_last_token": statistics.median(r["before_last_token"].get(l, 0.0) for r in ours),
                             "after_last_token": statistics.median(r["after_last_token"].get(l, 0.0) for r in ours)}
                         for l in labels},
            "micro_ms": eng["micro"],
        }
    http = result.get("http")
    if http:
        s = http["samples"]
        out["http"] = {}
        for name, rows in s.items():
            out["http"][name] = {k: statistics.median(r[k] for r in rows) for k in ("ttft_s", "last_token_s", "turn_s")}
            out["http"][name]["n"] = len(rows)
            out["http"][name]["cached_tokens"] = [r["cached_tokens"] for r in rows]
        peer = s.get("mlx_lm.server")
        for name, rows in s.items():
            if peer is not None and name != "mlx_lm.server":  # the ratio of each trial's pair, then the median
                out["http"][f"ratio_{name}_over_mlx_lm"] = {
                    k: statistics.median(x[k] / y[k] for x, y in zip(rows, peer)) for k in ("ttft_s", "last_token_s", "turn_s")}
        out["http"]["load"] = [r["load"] for rows in s.values() for r in rows]
    return out


def main(argv: list[str] | None = None) -> int:
    import semantic.blas

    semantic.blas.enable()  # before anything imports mlx: its BLAS is fixed at import
    from harness import models

    p = argparse.ArgumentParser(prog="python -m harness.serving.append_profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="a registered model name (prepared by `make models`)")
    p.add_argument("--trials", type=int, default=5, help="timed samples per side")
    p.add_argument("--cached", type=int, default=2000, help="tokens of the first turn (the cache)")
    p.add_argument("--new", type=int, default=300, help="tokens the timed turn appends")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--http", action="store_true", help="also time both servers over HTTP")
    p.add_argument("--no-engine", action="store_true", help="skip the in-process part")
    p.add_argument("--before", type=Path, help="another checkout of this project: its server joins the HTTP rotation")
    p.add_argument("--json", type=Path, help="write the samples and the summary here")
    a = p.parse_args(argv)
    model_dir = models.prepared_dir(a.model, models.default_variant(None))
    result: dict = {"model": a.model, "load_before": os.getloadavg()}
    if not a.no_engine:
        result["engine"] = engine_part(model_dir, a.trials, a.cached, a.new, a.max_tokens)
    if a.http:
        with tempfile.TemporaryDirectory(prefix="append-http-") as d:
            result["http"] = http_part(model_dir, a.trials, a.cached, a.new, a.max_tokens, Path(d), a.before)
    result["load_after"] = os.getloadavg()
    result["summary"] = summarize(result)
    print(json.dumps(result["summary"], indent=1))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
