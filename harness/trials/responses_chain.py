"""EXP-013: the Responses API's ``previous_response_id`` chain against the chat path, and a thinking model's history.

**The chain** (a real model, :func:`_chains`). One server (ours). Each
conversation is ``turns`` user messages under a long set of instructions,
sent two ways, turn by turn in alternation (the first side swaps each turn):

- ``chain``: ``POST /v1/responses`` with the instructions, the new message as
  ``input`` and ``previous_response_id``: the server holds the conversation;
- ``chat``: ``POST /v1/chat/completions`` with the whole history under a
  ``prompt_cache_key``, so its agent's cache is warm too.

Both stream; TTFT is the client's, to the first output text. Each side has
its own API key, so its own tenant: the two never share a cached block, and
each turn finds only what its own side left (without this, whichever side
went second would find the other's identical blocks). Then the server
is stopped (SIGTERM) and started again on the same caches, and one more turn
goes down the chain, against the same tokens prefilled cold (the chat path,
anonymous, under a ``cache_salt`` used once).

**A thinking model's history** (``think_model``: the tiny thinking model,
random weights, whose template drops old reasoning from history). One agent,
``turns`` chat turns under a long system prompt, each reply's content sent
back; ours with echo-stable history, and with ``--no-echo-history`` beside
it: cached ÷ prompt tokens per turn.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

from harness.servers import processes
from harness.servers.targets import OURS, TARGETS
from harness.trials.base import TrialKind, Param, register

KEYS = {"chain": "sk-chain", "chat": "sk-chat"}  # a tenant per side: no block is shared between them
QUESTIONS = ["Which module holds the block pool?", "What does the saver do on a full disk?",
             "Name the test that covers eviction.", "How is a tenant's cache kept apart?",
             "Why are blocks 256 tokens long?", "What survives a SIGKILL?", "Summarize what we said."]


def run(ctx) -> None:
    from mlx_lm.utils import load_tokenizer

    from harness import models
    from harness.models.tiny import write_tiny_tool_llama

    p, res, work = ctx.params, ctx.results, Path(tempfile.mkdtemp(prefix="exp013-"))
    if ctx.model_name == p["think_model"]:
        model_dir = write_tiny_tool_llama(work / "model", "think")
        rows = _thinking(ctx, model_dir, load_tokenizer(model_dir), work)
        res.output("think_turns", rows)
        for k, v in think_checks(rows).items():
            res.check(k, v)
        return
    model_dir = Path(models.prepare(ctx.model_name, variant=models.default_variant(ctx.config.model_variant)))
    rows = _chains(ctx, model_dir, load_tokenizer(model_dir), work)
    res.output("chain_turns", rows)
    for k, v in chain_checks(rows).items():
        res.check(k, v)
    for side in ("chain", "chat"):
        samples = [r["ttft_s"] for r in rows if r["side"] == side and 2 <= r["turn"] <= p["turns"]]
        if samples:
            res.metric(f"ttft_{side}", samples, "s", "lower", f"{side}: client TTFT of turns 2..{p['turns']}")


def _start(model_dir: Path, model_id: str, workdir: Path, **settings) -> processes.Running:
    return processes.start(TARGETS[OURS], model_dir, processes.free_port(), workdir, model_id=model_id,
                           python=sys.executable, **settings)


async def _ttft_chat(client, model: str, messages: list[dict], max_tokens: int, **extra) -> tuple[float, str, dict]:
    t0, first, text, usage = time.perf_counter(), None, "", None
    stream = await client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, stream=True,
                                                  stream_options={"include_usage": True}, **extra)
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter() - t0
            text += chunk.choices[0].delta.content
        if chunk.usage is not None:
            usage = chunk.usage
    return first or time.perf_counter() - t0, text, {"prompt": usage.prompt_tokens,
                                                     "cached": usage.prompt_tokens_details.cached_tokens}


async def _ttft_chain(client, model: str, instructions: str, text: str, previous: str | None,
                      max_tokens: int) -> tuple[float, str, dict, str]:
    t0, first, done = time.perf_counter(), None, None
    stream = await client.responses.create(model=model, instructions=instructions, input=text, stream=True,
                                           previous_response_id=previous, max_output_tokens=max_tokens)
    async for event in stream:
        if event.type == "response.output_text.delta" and event.delta:
            first = first or time.perf_counter() - t0
        if event.type in ("response.completed", "response.incomplete"):
            done = event.response
    usage = done.usage
    return first or time.perf_counter() - t0, done.output_text, {
        "prompt": usage.input_tokens, "cached": usage.input_tokens_details.cached_tokens}, done.id


def _chains(ctx, model_dir: Path, tokenizer, work: Path) -> list[dict]:
    import openai

    from harness.prompts import text_of_tokens

    p, rows = ctx.params, []
    ctx.progress.total = p["conversations"]
    server = _start(model_dir, ctx.model_name, work / "server", api_keys=tuple(KEYS.values()))
    try:
        for c in range(p["conversations"]):
            head = f"Repository guide {c + 1}. You are a careful coding agent. Reference material:"
            instructions = text_of_tokens(tokenizer, p["instruction_tokens"], 300 + 173 * c, head)
            history, previous = [{"role": "system", "content": instructions}], None

            async def turn(t: int, question: str) -> None:
                nonlocal previous
                for side in (("chain", "chat") if t % 2 else ("chat", "chain")):
                    async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEYS[side], max_retries=0,
                                                  timeout=900) as client:
                        if side == "chain":
                            ttft, text, usage, previous = await _ttft_chain(
                                client, server.model, instructions, question, previous, p["max_tokens"])
                        else:
                            ttft, text, usage = await _ttft_chat(
                                client, server.model, history + [{"role": "user", "content": question}],
                                p["max_tokens"], extra_body={"prompt_cache_key": f"chat-{c}"})
                            history.extend([{"role": "user", "content": question},
                                            {"role": "assistant", "content": text}])
                        rows.append({"conversation": c, "turn": t, "side": side, "ttft_s": ttft, "text": text[:120],
                                     "prompt_tokens": usage["prompt"], "cached_tokens": usage["cached"]})

            for t, question in enumerate(QUESTIONS[: p["turns"]], start=1):
                asyncio.run(turn(t, question))
            ctx.progress.update(1)
        server.stop()  # SIGTERM: saves land; then the same caches come back
        server = _start(model_dir, ctx.model_name, work / "server", api_keys=tuple(KEYS.values()))
        rows += asyncio.run(_after_restart(server, p, instructions, history, previous))
    finally:
        server.stop()
    return rows


async def _after_restart(server: processes.Running, p: dict, instructions: str, history: list[dict],
                         previous: str) -> list[dict]:
    """The last conversation's next turn down its chain, then the same tokens prefilled cold (anonymous,
    under a cache_salt used once, so no block of it can match)."""
    import uuid

    import openai

    question, t = QUESTIONS[p["turns"]], p["turns"] + 1
    async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEYS["chain"], max_retries=0,
                                  timeout=900) as client:
        ttft, text, usage, _ = await _ttft_chain(client, server.model, instructions, question, previous,
                                                 p["max_tokens"])
    async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEYS["chat"], max_retries=0,
                                  timeout=900) as client:
        cold_ttft, cold_text, cold = await _ttft_chat(client, server.model,
                                                      history + [{"role": "user", "content": question}],
                                                      p["max_tokens"], extra_body={"cache_salt": uuid.uuid4().hex})
    return [{"conversation": -1, "turn": t, "side": "restart_chain", "ttft_s": ttft, "text": text[:120],
             "prompt_tokens": usage["prompt"], "cached_tokens": usage["cached"]},
            {"conversation": -1, "turn": t, "side": "restart_cold", "ttft_s": cold_ttft, "text": cold_text[:120],
             "prompt_tokens": cold["prompt"], "cached_tokens": cold["cached"]}]


def chain_checks(rows: list[dict]) -> dict:
    """``ttft_chain_over_chat_max``: over turns 2..N, the largest median (over conversations) of chain ÷ chat
    TTFT; ``ttft_restart_over_cold``: the chain's turn after the restart ÷ the same tokens prefilled cold."""
    checks: dict = {}
    turns = sorted({r["turn"] for r in rows if r["side"] in ("chain", "chat") and r["turn"] >= 2})
    ratios = []
    for t in turns:
        pairs = {}
        for r in rows:
            if r["turn"] == t and r["side"] in ("chain", "chat"):
                pairs.setdefault(r["conversation"], {})[r["side"]] = r["ttft_s"]
        per = [v["chain"] / v["chat"] for v in pairs.values() if "chain" in v and v.get("chat")]
        if per:
            ratios.append(statistics.median(per))
    checks["ttft_chain_over_chat_by_turn"] = [round(x, 3) for x in ratios]
    checks["ttft_chain_over_chat_max"] = max(ratios) if ratios else None
    restart = {r["side"]: r for r in rows if r["side"] in ("restart_chain", "restart_cold")}
    if len(restart) == 2:
        checks["ttft_restart_over_cold"] = restart["restart_chain"]["ttft_s"] / restart["restart_cold"]["ttft_s"]
        checks["cached_ratio_restart"] = restart["restart_chain"]["cached_tokens"] / restart["restart_chain"]["prompt_tokens"]
    chain_later = [r["cached_tokens"] / r["prompt_tokens"] for r in rows if r["side"] == "chain" and r["turn"] >= 2]
    checks["cached_ratio_min_chain"] = min(chain_later) if chain_later else None
    return checks


# ---------------------------------------------------------------- a thinking model


def _thinking(ctx, model_dir: Path, tokenizer, work: Path) -> list[dict]:
    import openai

    from harness.prompts import text_of_tokens

    p, rows = ctx.params, []
    ctx.progress.total = 2
    system = text_of_tokens(tokenizer, p["instruction_tokens"], 911, "You are a careful agent. Reference material:")
    for side, settings in (("echo", {}), ("no_echo", {"echo_history": False})):
        server = _start(model_dir, ctx.model_name, work / side, **settings)
        try:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=600)
            history = [{"role": "system", "content": system}]
            for t, question in enumerate(QUESTIONS[: p["turns"]], start=1):
                history.append({"role": "user", "content": question})
                r = client.chat.completions.create(model=server.model, messages=history,
                                                   max_tokens=p["think_max_tokens"], user="thinker")
                message = r.choices[0].message
                history.append({"role": "assistant", "content": message.content or ""})
                rows.append({"side": side, "turn": t, "prompt_tokens": r.usage.prompt_tokens,
                             "cached_tokens": r.usage.prompt_tokens_details.cached_tokens,
                             "reasoning_chars": len((message.model_extra or {}).get("reasoning_content") or "")})
        finally:
            server.stop()
        ctx.progress.update(1)
    return rows


def think_checks(rows: list[dict]) -> dict:
    checks = {}
    for side in ("echo", "no_echo"):
        later = [r["cached_tokens"] / r["prompt_tokens"] for r in rows if r["side"] == side and r["turn"] >= 2]
        checks[f"think_cached_ratio_min_{side}"] = min(later) if later else None
    return checks


KIND = register(TrialKind(
    name="responses_chain",
    run=run,
    params={
        "turns": Param(int, 6, "user messages per conversation", min=2, max=len(QUESTIONS) - 1),
        "conversations": Param(int, 3, "conversations, each under its own instructions", min=1),
        "instruction_tokens": Param(int, 1500, "tokens of the instructions (the system prompt)"),
        "max_tokens": Param(int, 16, "tokens each reply may take", min=1),
        "think_model": Param(str, "tiny-think", "the model run as the thinking model (written for the run)"),
        "think_max_tokens": Param(int, 128, "tokens each of the thinking model's replies takes (its reasoning)"),
    },
    needs_model=False,
    trial_code=(_ttft_chat, _ttft_chain, _chains, _thinking),
))
