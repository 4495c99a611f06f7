"""EXP-007: agents at work. Multi-turn conversations through the scheduler, against re-prefill.

LMCache's multi-round QA shape, scaled to the machine: ``users`` agents share
a system prompt with tool definitions (``system_tokens``), each carries
``history_tokens`` of its own earlier exchange, and every round each asks a
``question_tokens`` question and gets a ``answer_tokens`` reply. Every turn
is the whole conversation rendered with the model's chat template, as a
client sends it; the scheduler reuses what the caches cover.

Per round, the other users' turns run concurrently; then user 0's turn runs
alone through the scheduler (cached) and, at the ``reference_turns``, the
same history runs alone in an engine with a pool of its own (a full
re-prefill), and so does a prefill of only the new tokens (the ideal), the
three in alternating order. Ideal speedup = re-prefill / new-only prefill;
efficiency = (re-prefill / cached) / ideal.

Then: resident KV bytes of ``sharing_agents`` agents that share the system
prompt, against the same caches unshared and against the ideal (the prefix
once plus each agent's own tokens); and a restart: a fresh process opens the
cache directory and continues every conversation, timed against re-prefill.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from harness import plots
from harness.common.children import run_child
from harness.executors import fresh_first_token, logprob_diff, make_executor, open_scheduler
from harness.prompts import question, system_prompt, text_of_tokens, user_history
from harness.prompts import shared_prefix as _common_len  # the name _sharing's benchmark id was made with
from harness.trials.base import TrialKind, Param, register
from semantic import Request, encode, render_chat


def _pair(order: int, sides: dict):
    """Run the timed sides in alternating order (A B, then B A), for drift."""
    names = list(sides) if order % 2 == 0 else list(sides)[::-1]
    return {n: sides[n]() for n in names}


def _bytes_report(scheds_blocks: dict, spec, shared_tokens: int) -> dict:
    """Resident bytes of these agents' caches: unique blocks (sharing), summed per agent (none), ideal."""
    unique = {}
    for blocks in scheds_blocks.values():
        for b in blocks.unique_blocks():
            unique[id(b)] = b.nbytes
    with_sharing = sum(unique.values())
    without = sum(b.nbytes for b in scheds_blocks.values())
    tb = spec.token_bytes()
    own = sum(b.total_tokens - shared_tokens for b in scheds_blocks.values())
    ideal = tb * (shared_tokens + own)
    return {
        "agents": len(scheds_blocks), "shared_prefix_tokens": shared_tokens,
        "bytes_with_sharing": with_sharing, "bytes_without_sharing": without, "bytes_ideal": ideal,
        "ratio_to_ideal": with_sharing / ideal, "unshared_ratio_to_ideal": without / ideal,
        "per_agent": {a: {"tokens": b.total_tokens, "bytes": b.nbytes} for a, b in scheds_blocks.items()},
    }


def run(ctx) -> None:
    p, loaded = ctx.params, ctx.loaded
    tok = loaded.tokenizer
    users, rounds = p["users"], p["rounds"]
    ref_turns = set(p["reference_turns"] or range(1, rounds + 1))
    system = system_prompt(tok, p["system_tokens"])
    convo = {u: [system, *user_history(tok, u, p["history_tokens"])] for u in range(users)}
    fresh = make_executor(loaded, p["pool_blocks"])
    fresh_first_token(fresh, tok.encode("warm up the kernels", add_special_tokens=True))
    per_turn, concurrent_ttft, decode_tps = [], [], []
    ctx.progress.total = rounds + 3
    cache_dir = Path(tempfile.mkdtemp(prefix="exp007-"))
    sched = open_scheduler(loaded, cache_dir, p["pool_blocks"], max_batch=max(users, p["sharing_agents"]))
    try:
        for turn in range(1, rounds + 1):
            row, got = _round(sched, fresh, tok, convo, turn, p, turn in ref_turns)
            per_turn.append(row)
            for u, r in got.items():
                if turn > 1 and u:
                    concurrent_ttft.append(r.ttft_s * 1e3)
                decode_tps.append(r.decode_tokens_per_s)
                convo[u].append({"role": "assistant", "content": r.text})
            ctx.progress.update(1)

        mem = _sharing(sched, tok, system, p)
        stats = sched.stats()
        ctx.progress.update(1)

        restart = _restart(ctx, cache_dir, convo, users, rounds + 1)
        ctx.progress.update(1)
    finally:
        sched.close()
        shutil.rmtree(cache_dir, ignore_errors=True)

    _record(ctx, per_turn, concurrent_ttft, decode_tps, stats, mem, restart, ref_turns)


def _round(sched, fresh, tok, convo: dict, turn: int, p: dict, reference: bool) -> tuple[dict, dict]:
    """One round: every user asks; users 1.. run together, then user 0 alone through the scheduler
    and, on a ``reference`` turn, also as a full re-prefill and a prefill of only the new tokens.
    Returns user 0's row and every user's Completion."""
    users = len(convo)
    for u in range(users):
        convo[u].append(question(tok, u, turn, p["question_tokens"]))
    others = {u: sched.submit(Request(f"user-{u}", encode(tok, convo[u]), p["answer_tokens"]), timeout=None) for u in range(1, users)}
    got = {u: f.result() for u, f in others.items()}
    ids0 = render_chat(tok, convo[0])
    row = {"turn": turn, "context_tokens": len(ids0)}
    sides = {"cached": lambda: sched.submit(Request("user-0", encode(tok, convo[0]), p["answer_tokens"]), timeout=None).result()}
    if reference:
        sides["uncached"] = lambda: fresh_first_token(fresh, ids0)
    timed = _pair(turn, sides)
    got[0] = cached = timed["cached"]
    row.update(cached_ms=cached.ttft_s * 1e3, new_tokens=cached.prompt_tokens,
               cached_tokens=cached.cached_tokens, reuse=cached.reuse)
    if "uncached" in timed:
        new_only = fresh_first_token(fresh, ids0[-cached.prompt_tokens:])
        full = timed["uncached"]
        row.update(uncached_ms=full.ttft_s * 1e3, new_only_ms=new_only.ttft_s * 1e3,
                   first_token_match=full.token_ids[0] == cached.token_ids[0],
                   first_logprob_diff=logprob_diff(full.logprobs[:1], cached.logprobs[:1]))
        row["speedup"] = row["uncached_ms"] / row["cached_ms"]
        row["ideal_speedup"] = row["uncached_ms"] / row["new_only_ms"]
        row["efficiency"] = row["speedup"] / row["ideal_speedup"]
    return row, got


def _sharing(sched, tok, system: dict, p: dict) -> dict:
    """Prefix sharing: ``sharing_agents`` more agents with the same system prompt, each with a short
    question of its own; the resident bytes of their caches."""
    share = {f"share-{i}": [system, question(tok, 1000 + i, 1, p["question_tokens"])] for i in range(p["sharing_agents"])}
    futures = {a: sched.submit(Request(a, encode(tok, m), p["answer_tokens"]), timeout=None) for a, m in share.items()}
    share_results = {a: f.result() for a, f in futures.items()}
    sched.flush()
    bt = sched.store.pool.block_tokens
    shared_tokens = _common_len([render_chat(tok, m) for m in share.values()])
    mem = _bytes_report({a: sched.resident_cache(a) for a in share}, sched.store.spec, shared_tokens)
    mem["shared_whole_blocks"] = shared_tokens // bt
    mem["reuse_of_later_agents"] = sorted({r.reuse for a, r in share_results.items()})
    return mem


def _restart(ctx, cache_dir: Path, convo: dict, users: int, turn: int) -> dict:
    """A fresh process continues every conversation from the files alone."""
    p, tok = ctx.params, ctx.loaded.tokenizer
    spec = {"model": ctx.model_name, "variant": ctx.loaded.variant, "cache_dir": str(cache_dir), "pool_blocks": p["pool_blocks"],
            "answer_tokens": p["answer_tokens"], "conversations": {}}
    for u in range(users):
        spec["conversations"][f"user-{u}"] = convo[u] + [question(tok, u, turn, p["question_tokens"])]
    if p["restart_context_tokens"]:
        spec["conversations"]["long"] = _long_conversation(ctx, cache_dir)
    spec["reference"] = "long" if p["restart_context_tokens"] else "user-0"
    return run_child("multiturn", spec, "restart child")


def _long_conversation(ctx, cache_dir: Path) -> list[dict]:
    """An agent with ``restart_context_tokens`` of history, run once here and saved, then asked again."""
    p, tok = ctx.params, ctx.loaded.tokenizer
    system = system_prompt(tok, p["system_tokens"])
    body = text_of_tokens(tok, p["restart_context_tokens"] - p["system_tokens"], 400, "Project log:")
    convo = [system, {"role": "user", "content": body}]
    sched = open_scheduler(ctx.loaded, cache_dir, p["pool_blocks"])
    try:
        reply = sched.submit(Request("long", encode(tok, convo), p["answer_tokens"]), timeout=None).result()
    finally:
        sched.close()
    return convo + [{"role": "assistant", "content": reply.text}, question(tok, 9, 99, p["question_tokens"])]


def _record(ctx, per_turn, concurrent_ttft, decode_tps, stats, mem, restart, ref_turns) -> None:
    res, p = ctx.results, ctx.params
    res.output("per_turn", per_turn)
    res.output("memory", mem)
    res.output("restart", restart)
    res.output("scheduler", {"completed": stats.completed, "failed": stats.failed, "saves": stats.saves,
                             "save_errors": stats.save_errors, "prompt_tokens": stats.prompt_tokens,
                             "cached_tokens": stats.cached_tokens})
    later = [r for r in per_turn if r["turn"] > 1]
    refs = [r for r in per_turn if "uncached_ms" in r]
    res.metric("ttft_cached_ms", [r["cached_ms"] for r in later], "ms", description="user 0 alone, turns 2..R, through the scheduler")
    res.metric("ttft_uncached_ms", [r["uncached_ms"] for r in refs], "ms", description="the same histories, full re-prefill")
    res.metric("ttft_new_only_ms", [r["new_only_ms"] for r in refs], "ms", description="prefill of only the new tokens (ideal)")
    if concurrent_ttft:
        res.metric("ttft_concurrent_ms", concurrent_ttft, "ms", description="users 1.. submitted together, turns 2..R (queueing included)")
    res.metric("decode_tokens_per_s", decode_tps, "tokens/s", "higher", "per turn and user, after the first token")
    last = refs[-1] if refs else {}
    res.check("final_turn", last.get("turn"))
    res.check("final_context_tokens", last.get("context_tokens"))
    res.check("final_speedup", last.get("speedup"))
    res.check("final_ideal_speedup", last.get("ideal_speedup"))
    res.check("final_efficiency", last.get("efficiency"))
    res.check("first_tokens_match", all(r["first_token_match"] for r in refs))
    res.check("max_first_logprob_diff", max((r["first_logprob_diff"] for r in refs), default=0.0))
    hist = sum(r["cached_tokens"] + r["new_tokens"] for r in later)
    res.check("token_hit_rate", sum(r["cached_tokens"] for r in later) / hist if hist else 0.0)
    res.check("turn_hit_rate", sum(r["cached_tokens"] > 0 for r in later) / len(later) if later else 0.0)
    res.check("all_token_hit_rate", stats.token_hit_rate)
    res.check("sharing_bytes_ratio", mem["ratio_to_ideal"])
    res.check("unshared_bytes_ratio", mem["unshared_ratio_to_ideal"])
    res.check("restart_context_tokens", restart["reference_context_tokens"])
    res.check("restart_speedup", restart["reference_uncached_ms"] / restart["reference_cached_ms"])
    res.check("restart_all_from_disk", all(r["cached_tokens"] > 0 for r in restart["turns"].values()))
    res.check("restart_first_token_match", restart["first_token_match"])
    res.check("errors", stats.failed + stats.save_errors)

    if "ttft_per_turn" in ctx.config.plots:
        series = {"cached (scheduler)": ([r["turn"] for r in per_turn], [r["cached_ms"] for r in per_turn], None),
                  "re-prefill": ([r["turn"] for r in refs], [r["uncached_ms"] for r in refs], None),
                  "new tokens only (ideal)": ([r["turn"] for r in refs], [r["new_only_ms"] for r in refs], None)}
        ctx.plots.append(plots.scaling_plot(series, ctx.plot_path("ttft-per-turn"), "turn", "time to first token (ms)",
                                            f"EXP-007 {ctx.model_name}: user 0, context {per_turn[0]['context_tokens']}"
                                            f"-{per_turn[-1]['context_tokens']} tokens", logy=True))
    if "memory_per_agent" in ctx.config.plots:
        per = mem["per_agent"]
        ctx.plots.append(plots.bars_plot(
            {"unshared\n(sum / agent)": mem["bytes_without_sharing"] / len(per) / 1e6,
             "shared pool\n(unique / agent)": mem["bytes_with_sharing"] / len(per) / 1e6,
             "ideal\n(/ agent)": mem["bytes_ideal"] / len(per) / 1e6},
            ctx.plot_path("memory-per-agent"), "resident KV per agent (MB)",
            f"EXP-007 {ctx.model_name}\n{len(per)} agents share {mem['shared_prefix_tokens']} tokens"))


def _validate(p: dict) -> None:
    if any(not 1 <= t <= p["rounds"] for t in p["reference_turns"]):
        raise ValueError(f"reference_turns must lie in 1..{p['rounds']}")


KIND = register(TrialKind(
    name="multiturn",
    run=run,
    params={
        "users": Param(int, 4, "agents in conversation (LMCache: 10)", min=1),
        "rounds": Param(int, 8, "turns per agent (LMCache: 5)", min=2),
        "system_tokens": Param(int, 1024, "shared system prompt and tool definitions (LMCache: 1000)", min=1),
        "history_tokens": Param(int, 1024, "each user's earlier exchange (LMCache: 2000)", min=0),
        "question_tokens": Param(int, 32, "each new question", min=1),
        "answer_tokens": Param(int, 16, "each reply (no stop token: exactly this many)", min=1),
        "reference_turns": Param(list, [], "turns of user 0 timed against a full re-prefill; [] = every turn"),
        "sharing_agents": Param(int, 8, "agents sharing the system prompt in the memory measurement", min=2),
        "restart_context_tokens": Param(int, 0, "context of a dedicated agent for the restart test; 0 = the conversations"),
        "pool_blocks": Param(int, 512, "blocks of 256 tokens in the pool"),
    },
    plots=frozenset({"ttft_per_turn", "memory_per_agent"}),
    validate=_validate,
    trial_code=(fresh_first_token, _pair, _round, _sharing, _bytes_report),
))
