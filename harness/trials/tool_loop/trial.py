"""EXP-011: agents that act. A tool loop's cache reuse over HTTP, and what a JSON grammar costs decode.

**Tool loops.** Each conversation is ``turns`` requests of one named agent:
a call on every turn but the last (guaranteed by tool_choice), each call's
result sent back, then an answer (``harness.trials.tool_loop.loops``), over the
OpenAI API and the Anthropic API (Claude Code's volatile first system block
included). Sides, each a server started from the same model directory
(``harness.servers.processes``), take turns request by request:

- ``echo``: ours, echo-stable history on (a reply sent back is the token ids it was generated as);
- ``no_echo``: ours with ``--no-echo-history`` (every message rendered by the chat template);
- ``mlx_lm``: ``mlx_lm.server``, on a model with a native tool format only (it has no tool_choice and no
  grammar: it serves tools through the model's own template and parser), OpenAI API only.

On every turn: cached ÷ prompt tokens (each API's usage), cached ÷ what the
server saw on the previous turn (its prompt and reply), and client-side TTFT.

**Constrained decoding.** ``BatchExecutor`` decodes the same prompts
with and without a JSON-schema grammar (``Request(..., grammar=...)``), at
each batch size, the two sides in turn (A B, then B A). The schema's array
needs more items than the token budget, so the grammar cannot end a
sequence early: both sides decode exactly the budget. Decode tokens/s is
counted from the moment every row has its first token (as ``steploop``):
each stamp is taken when the engine has read the token (materialized).
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from harness import plots
from harness.common.report import median, ratio
from harness.servers import processes
from harness.servers.targets import MLX_LM, OURS, TARGETS
from harness.trials.base import TrialKind, Param, register
from harness.trials.tool_loop import loops as T

# side -> (server, its settings, the APIs it serves here)
SIDES = {
    "echo": (OURS, {}, ("openai", "anthropic")),
    "no_echo": (OURS, {"echo_history": False}, ("openai", "anthropic")),
    "mlx_lm": (MLX_LM, {}, ("openai",)),
}
LABELS = {"echo": "ours, echo-stable history", "no_echo": "ours, --no-echo-history", "mlx_lm": "mlx_lm.server"}
OUR_SIDES = ("echo", "no_echo")
APIS = ("openai", "anthropic")
OPENAI_CLIENTS = ("agents", "openai")
# tiny random-weight models with a native tool format (harness.models.tiny), written for the run
TINY_TOOL_MODELS = {"tiny-hermes": "hermes", "tiny-mistral": "mistral"}
DECODE_SIDES = ("free", "json")


def run(ctx) -> None:
    from mlx_lm.utils import load_tokenizer

    p, res = ctx.params, ctx.results
    work = Path(tempfile.mkdtemp(prefix="exp011-"))
    model_dir = _model_dir(ctx, work)
    tokenizer = load_tokenizer(model_dir)
    native = bool(getattr(tokenizer, "has_tool_calling", False))
    sides = [s for s in p["sides"] if s != "mlx_lm" or native]
    # mlx_lm.server's replies hold no call: the Agents SDK would end the run at the first, so every side of
    # such a model gets the plain client (the same requests on every side)
    client = "openai" if "mlx_lm" in sides else p["openai_client"]
    extra = {"mlx_lm": {"logit_bias": _ascii_only(tokenizer)}} if ctx.model_name in TINY_TOOL_MODELS else {}
    res.output("setup", {
        "model_dir": str(model_dir), "native_tool_format": native, "sides": sides, "openai_client": client,
        "not_run": {} if native or "mlx_lm" not in p["sides"] else {
            "mlx_lm": "no native tool format: mlx_lm.server serves tools only through the model's own chat "
                      "template and parser (here it logs 'model does not support tool calling' and writes text; "
                      "it has no tool_choice and no grammar), so it cannot be held to a call"},
        "mlx_lm_request_extra": "logit_bias: bytes >= 128 and the tool-call markers banned (a random-weight model "
                                "otherwise writes invalid UTF-8, whose replacement characters re-encode differently)"
                                if extra else None,
        "clients": _client_versions(),
    })
    decode = ctx.model_name in p["decode_models"]
    trials = ctx.config.protocol.warmup + ctx.config.protocol.trials
    ctx.progress.total = p["conversations"] * len(p["apis"]) + (trials if decode else 0)
    servers, events = {}, []
    try:
        for side in sides:
            servers[side] = _start(side, model_dir, ctx.model_name, work, events)
        rows = _conversations(ctx, servers, tokenizer, client, extra)
        # what our servers say they did: prompts spliced from the generated ids, or rendered by the template
        res.output("server_stats", {s: {k: st[k] for k in ("echo", "tokens")}
                                    for s, srv in servers.items() if SIDES[s][0] == OURS for st in [srv.stats()]})
    finally:
        for s in servers.values():
            s.stop()
    res.output("events", events)
    record_loops(ctx, [r.row() for r in rows], p["apis"], p["turns"])
    if decode:
        _decode(ctx)


def _model_dir(ctx, work: Path) -> Path:
    from harness import models
    from harness.models.tiny import write_tiny_tool_llama

    p = ctx.params
    if p["model_dir"]:
        return Path(p["model_dir"])
    if ctx.model_name in TINY_TOOL_MODELS:
        return write_tiny_tool_llama(work / ctx.model_name, TINY_TOOL_MODELS[ctx.model_name])
    return Path(models.prepare(ctx.model_name, variant=models.default_variant(ctx.config.model_variant)))


def _ascii_only(tokenizer) -> dict[int, float]:
    """A byte-level tiny model's logit bias: no byte >= 128 and no tool-call marker token."""
    markers = [getattr(tokenizer, a, None) for a in ("tool_call_start", "tool_call_end")]
    return {i: -100.0 for i in range(128, 256)} | {tokenizer.convert_tokens_to_ids(m): -100.0 for m in markers if m}


def _client_versions() -> dict:
    from harness.environment import packages

    return packages(("openai-agents", "openai", "anthropic"), missing=True)


def _start(side: str, model_dir: Path, model_id: str, work: Path, events: list) -> processes.Running:
    target, settings, _ = SIDES[side]
    running = processes.start(TARGETS[target], model_dir, processes.free_port(), work / side, model_id=model_id,
                              python=sys.executable, **settings)
    events.append({"event": "started", "side": side, "server": target, "settings": settings,
                   "start_to_ready_s": running.start_to_ready_s, "blas": running.blas_mapping().openblas})
    return running


def _conversations(ctx, servers: dict, tokenizer, client: str, extra: dict) -> list[T.Turn]:
    """Every conversation over every API, the sides that serve it taking turns; the first side rotates."""
    from harness.prompts import text_of_tokens

    p, rows = ctx.params, []
    for c in range(p["conversations"]):
        for j, api in enumerate(p["apis"]):
            # every conversation of every API has its own system prompt: its first turn is cold on every
            # server, and no agent finds another's turns cached (greedy calls and the same results repeat)
            k = c * len(p["apis"]) + j
            head = f"Ship's log {k + 1}. You are a careful research agent who reads the log with tools. Reference material:"
            system = text_of_tokens(tokenizer, p["system_tokens"], 500 + 211 * k, head)
            names = [s for s in servers if api in SIDES[s][2]]
            names = names[c % len(names):] + names[: c % len(names)]
            loop = T.Loop(c, system, p["turns"], p["call_tokens"], p["answer_tokens"], f"{ctx.model_name}-{api}-{c}")
            rows += asyncio.run(_conversation(servers, names, api, loop, client, extra))
            ctx.progress.update(1)
    return rows


async def _conversation(servers: dict, names: list[str], api: str, loop: T.Loop, client: str,
                        extra: dict) -> list[T.Turn]:
    import anthropic
    import openai

    baton = T.Baton(names)

    async def side(name: str) -> list[T.Turn]:
        srv = servers[name]
        try:
            if api == "anthropic":
                async with anthropic.AsyncAnthropic(base_url=srv.url, api_key="none", max_retries=0, timeout=900) as c:
                    return await T.anthropic_loop(c, srv.model, name, loop, baton)
            async with openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=900) as c:
                if client == "agents":
                    return await T.agents_loop(c, srv.model, name, loop, baton)
                return await T.openai_loop(c, srv.model, name, loop, baton, extra.get(name))
        finally:
            await baton.leave(name)

    return [r for rows in await asyncio.gather(*(side(n) for n in names)) for r in rows]


# ---------------------------------------------------------------- the loops' results


def _cells(rows: list[dict]) -> list[tuple[str, str]]:
    return sorted({(r["api"], r["side"]) for r in rows}, key=lambda k: (APIS.index(k[0]), list(SIDES).index(k[1])))


def reused_of_previous(rows: list[dict]) -> dict[tuple, float | None]:
    """Per (api, side, conversation, turn >= 2): cached ÷ the previous turn's prompt and reply tokens
    (1.0: everything the server saw last turn was found again)."""
    by = {(r["api"], r["side"], r["conversation"], r["turn"]): r for r in rows if r["error"] is None}
    out = {}
    for (api, side, conv, turn), r in by.items():
        prev = by.get((api, side, conv, turn - 1))
        if prev is not None and None not in (prev["prompt_tokens"], prev["completion_tokens"]):
            out[(api, side, conv, turn)] = ratio(r["cached_tokens"], prev["prompt_tokens"] + prev["completion_tokens"])
    return out


def loop_table(rows: list[dict], turns: int) -> dict[str, dict[str, list[float | None]]]:
    """api -> side -> per turn (1..turns): the median cached ÷ prompt over the conversations."""
    table: dict = {}
    for api, side in _cells(rows):
        these = [r for r in rows if r["api"] == api and r["side"] == side and r["error"] is None]
        table.setdefault(api, {})[side] = [
            median(ratio(r["cached_tokens"], r["prompt_tokens"]) for r in these if r["turn"] == t)
            for t in range(1, turns + 1)]
    return table


def loop_checks(rows: list[dict], turns: int) -> dict:
    """The goal's checks and their neighbours, from the turns' rows.

    ``cached_ratio_min_{api}_{side}``: the smallest cached ÷ prompt over every turn after the first of every
    conversation (None where a turn reported no cached tokens, or a side has no such turn).
    ``reused_of_previous_min_{api}_{side}``: the smallest cached ÷ (previous prompt + reply).
    ``turns_done_{api}_{side}``: turns answered without an error, of conversations × ``turns``.
    ``our_errors``: failed requests of our sides; ``our_choice_misses``: our turns where tool_choice was
    not honoured (no call before the last turn, a call on it).
    ``ttft_echo_over_no_echo_{api}``: median TTFT of turns after the first, echo on over off.
    """
    checks: dict = {}
    reuse = reused_of_previous(rows)
    conversations = len({r["conversation"] for r in rows})
    for api, side in _cells(rows):
        these = [r for r in rows if r["api"] == api and r["side"] == side]
        ok = [r for r in these if r["error"] is None]
        later = [ratio(r["cached_tokens"], r["prompt_tokens"]) for r in ok if r["turn"] >= 2]
        checks[f"cached_ratio_min_{api}_{side}"] = min(later) if later and None not in later else None
        mine = [v for (a, s, _, _), v in reuse.items() if (a, s) == (api, side)]
        checks[f"reused_of_previous_min_{api}_{side}"] = min(mine) if mine and None not in mine else None
        checks[f"turns_done_{api}_{side}"] = f"{len(ok)}/{conversations * turns}"
    ours = [r for r in rows if r["side"] in OUR_SIDES]
    checks["our_errors"] = sum(r["error"] is not None for r in ours) + sum(
        conversations * turns - len([r for r in ours if (r["api"], r["side"]) == cell])
        for cell in {(r["api"], r["side"]) for r in ours})  # a turn never sent counts as failed too
    checks["our_choice_misses"] = sum((r["calls"] == 0) if r["turn"] < turns else (r["calls"] > 0)
                                      for r in ours if r["error"] is None)
    for api in sorted({r["api"] for r in rows}):
        med = {s: median(r["ttft_s"] for r in rows if r["api"] == api and r["side"] == s and r["turn"] >= 2
                          and r["error"] is None) for s in OUR_SIDES}
        checks[f"ttft_echo_over_no_echo_{api}"] = ratio(med["echo"], med["no_echo"])
    return checks


def record_loops(ctx, rows: list[dict], apis: list[str], turns: int) -> None:
    """The loops' rows as outputs, metrics, checks and the per-turn plot."""
    res = ctx.results
    table = loop_table(rows, turns)
    res.output("turns", [{**r, "text": r["text"][:200]} for r in rows])
    res.output("by_turn", table)
    for api, side in _cells(rows):
        ok = [r for r in rows if r["api"] == api and r["side"] == side and r["error"] is None]
        for name, picked, desc in ((f"ttft_{api}_{side}", [r for r in ok if r["turn"] >= 2], "turns after the first"),
                                   (f"ttft_first_{api}_{side}", [r for r in ok if r["turn"] == 1], "the cold first turn")):
            samples = [r["ttft_s"] for r in picked if r["ttft_s"] is not None]
            if samples:
                res.metric(name, samples, "s", "lower", f"{LABELS[side]}, {api} API, {desc} (client-side TTFT)")
        ratios = [x for r in ok if r["turn"] >= 2 if (x := ratio(r["cached_tokens"], r["prompt_tokens"])) is not None]
        if ratios:
            res.metric(f"cached_ratio_{api}_{side}", ratios, "ratio", "higher",
                       f"{LABELS[side]}, {api} API: cached ÷ prompt tokens, turns after the first")
    for k, v in loop_checks(rows, turns).items():
        res.check(k, v)
    if "cached_ratio" in ctx.config.plots and table:
        # turn 1 is cold by design (its own system prompt): the turns after it are the goal's
        panels = {f"{api} API": {LABELS[s]: v[1:] for s, v in table[api].items()} for api in apis if api in table}
        ctx.plots.append(plots.turn_lines_plot(
            panels, ctx.plot_path("cached-ratio"), "cached ÷ prompt tokens (median)",
            f"{ctx.model_name}: {turns}-turn tool loop, cached share of each prompt after the cold first turn",
            goal=0.95, first_turn=2))


def headline(doc: dict) -> list[str]:
    """The per-turn cached ÷ prompt table and the decode ratios, for the console."""
    table = doc["outputs"].get("by_turn") or {}
    lines = ["  cached ÷ prompt per turn (median over conversations):"] if table else []
    for api, by_side in table.items():
        for side, values in by_side.items():
            cells = " ".join("  -  " if v is None else f"{v:5.3f}" for v in values)
            lines.append(f"    {api:9} {side:8} {cells}")
    for b in doc["outputs"].get("decode_batches", []):
        ratio = doc["checks"].get(f"decode_json_over_free_b{b}")
        if ratio is not None:
            lines.append(f"  decode tokens/s, JSON schema ÷ free, batch {b}: {ratio:.3f}")
    return lines


# ---------------------------------------------------------------- constrained decoding


def decode_schema(items: int) -> dict:
    """An object with an array of short strings that needs at least ``items`` items: with ``items`` at
    least the token budget, the grammar cannot be complete (and end the sequence) within it."""
    return {"type": "object", "additionalProperties": False, "required": ["items"],
            "properties": {"items": {"type": "array", "minItems": items, "maxItems": 4 * items,
                                     "items": {"type": "string", "minLength": 1, "maxLength": 16}}}}


def _decode_prompts(tokenizer, batch: int) -> list[list[int]]:
    return [tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Fleet {i + 1}: list every ship's name as JSON, {{\"items\": [...]}}."}],
        add_generation_prompt=True) for i in range(batch)]


def _decode_trial(loaded, prompts: list[list[int]], tokens: int, grammar) -> dict:
    """One batch decoded to ``tokens`` tokens per row: decode tokens/s once every row has its first token."""
    from semantic import BlockPool, BatchExecutor, ModelCacheSpec, Request

    spec = ModelCacheSpec.from_model(loaded.model)
    blocks = sum((len(q) + tokens) // 256 + 2 for q in prompts)
    executor = BatchExecutor(loaded.model, loaded.tokenizer, BlockPool(spec, blocks), spec, stop_tokens=[],
                                  max_batch=len(prompts), prefill_chunk=sum(map(len, prompts)))
    stamps: dict[int, list[float]] = {i: [] for i in range(len(prompts))}
    for i, q in enumerate(prompts):
        # the stamp is taken once the engine has read the token: it is materialized
        executor.submit(Request(f"d{i}", q, tokens, grammar=grammar,
                              on_token=lambda tok, lp, row, i=i: stamps[i].append(time.perf_counter()) and False))
    done = list(executor.step())
    for c in done:
        c.blocks.release()
    start = max(s[0] for s in stamps.values())
    after = sorted(t for s in stamps.values() for t in s if t > start)
    return {"decode_tps": len(after) / (after[-1] - start), "tokens": [len(s) for s in stamps.values()]}


def _decode(ctx) -> None:
    from harness import models
    from semantic.decode.constraint import Grammar

    p, res = ctx.params, ctx.results
    loaded = models.load(ctx.model_name, models.default_variant(ctx.config.model_variant))
    grammar = Grammar.json_schema(decode_schema(p["decode_tokens"]))
    warmup, trials = ctx.config.protocol.warmup, ctx.config.protocol.trials
    got = {(s, b): [] for s in DECODE_SIDES for b in p["decode_batches"]}
    for trial in range(warmup + trials):
        for b in p["decode_batches"]:
            prompts = _decode_prompts(loaded.tokenizer, b)
            for side in (DECODE_SIDES if trial % 2 == 0 else DECODE_SIDES[::-1]):
                out = _decode_trial(loaded, prompts, p["decode_tokens"], grammar if side == "json" else None)
                if trial >= warmup:
                    got[(side, b)].append(out)
        ctx.progress.update(1)
    for (side, b), outs in got.items():
        res.metric(f"decode_tps_{side}_b{b}", [o["decode_tps"] for o in outs], "tokens/s", "higher",
                   f"batch {b}, {p['decode_tokens']} tokens a row, {'a JSON-schema grammar' if side == 'json' else 'no grammar'}")
    for k, v in decode_checks(got, p["decode_batches"], p["decode_tokens"]).items():
        res.check(k, v)
    res.output("decode_batches", p["decode_batches"])
    res.output("decode_schema", decode_schema(p["decode_tokens"]))
    if "decode" in ctx.config.plots:
        med = lambda side, b: float(np.median([o["decode_tps"] for o in got[(side, b)]]))  # noqa: E731
        ctx.plots.append(plots.throughput_plot(
            {f"batch {b}": {"no grammar": med("free", b), "JSON schema": med("json", b)} for b in p["decode_batches"]},
            ctx.plot_path("decode"), "decode tokens/s (median)",
            f"{ctx.model_name}: decode, JSON-schema grammar vs none"))


def decode_checks(got: dict[tuple[str, int], list[dict]], batches: list[int], tokens: int) -> dict:
    """``decode_json_over_free_b{b}``: median decode tokens/s with the grammar over without;
    ``decode_tokens_equal``: every row of every trial decoded exactly ``tokens`` tokens on both sides."""
    checks = {}
    for b in batches:
        free, json_ = ([o["decode_tps"] for o in got[(s, b)]] for s in DECODE_SIDES)
        checks[f"decode_json_over_free_b{b}"] = float(np.median(json_) / np.median(free)) if free and json_ else None
    checks["decode_tokens_equal"] = all(n == tokens for outs in got.values() for o in outs for n in o["tokens"])
    return checks


def _validate(p: dict) -> None:
    if not set(p["sides"]) <= set(SIDES) or "echo" not in p["sides"]:
        raise ValueError(f"sides must include 'echo' and name known sides ({list(SIDES)}), not {p['sides']}")


KIND = register(TrialKind(
    name="tool_loop",
    run=run,
    params={
        "sides": Param(list, list(SIDES), f"servers, of {list(SIDES)} (mlx_lm runs only on a native tool format)"),
        "apis": Param(list, list(APIS), "APIs the loops use (mlx_lm.server serves OpenAI's only)", APIS,
                      nonempty=True),
        "openai_client": Param(str, "agents", "the OpenAI loop's client: the Agents SDK's Runner, or the plain SDK "
                                             "(plain wherever mlx_lm.server runs)", OPENAI_CLIENTS),
        "turns": Param(int, 8, "requests per conversation: a call on each but the last, which answers",
                       min=2),
        "conversations": Param(int, 2, "conversations per API, each with its own system prompt", min=1),
        "system_tokens": Param(int, 1500, "tokens of the system prompt (the tools' note is added by the server)"),
        "call_tokens": Param(int, 96, "max_tokens of a call turn (a ceiling: a call ends where its grammar does)"),
        "answer_tokens": Param(int, 32, "max_tokens of the last turn's answer"),
        "decode_models": Param(list, ["smollm2-135m"], "models whose constrained decoding is timed too"),
        "decode_batches": Param(list, [1, 8], "batch sizes of the decode measurement", min=1),
        "decode_tokens": Param(int, 128, "tokens every row decodes (the grammar cannot end sooner)", min=2),
        "model_dir": Param(str, "", "a model directory to serve instead of the named one (tests: a tiny model)"),
    },
    plots=frozenset({"cached_ratio", "decode"}),
    needs_model=False,
    validate=_validate,
    trial_code=(T.openai_loop, T._openai_turn, T.agents_loop, T._turn_model_class, T.anthropic_loop,
                T._anthropic_turn, T.Baton, _conversations, _decode_trial, _decode),
    headline=headline,
))
