"""EXP-004: in one batch, each sequence's cache is extracted the moment it finishes.

Three short prompts run in one continuous batch with different token
budgets, so they finish at different steps. Each finished cache is recorded
(layers and their types), saved to its own file, reloaded into a fresh pool
in a new engine, and continued; each continuation must equal a fresh
prefill of the same tokens. Time to first token with the reloaded cache and
without any cache is measured, interleaved, for the longest sequence.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import mlx.core as mx

from harness import plots
from harness.executors import make_executor, match_report, record_ttft, run_one, time_ttft
from harness.timing import time_once
from harness.trials.base import TrialKind, Param, register
from semantic import Request, cachefile, compat


def _same_caches(a: list, b: list) -> bool:
    for x, y in zip(a, b, strict=True):
        sx, sy = compat.read_layer(x), compat.read_layer(y)
        if (type(x), sx.offset) != (type(y), sy.offset):
            return False
        for u, v in ((sx.keys, sy.keys), (sx.values, sy.values)):
            pairs = zip(u, v) if isinstance(u, tuple) else [(u, v)]
            if not all(mx.array_equal(p, q).item() for p, q in pairs):
                return False
    return True


def run(ctx) -> None:
    p = ctx.params
    if len(p["prompts"]) != len(p["max_tokens"]):
        raise ValueError("params.prompts and params.max_tokens need the same length")
    executor = make_executor(ctx.loaded)
    finished = _finish_in_one_batch(ctx, executor)
    with tempfile.TemporaryDirectory(prefix="exp004-") as tmp:
        reloaded_executor = make_executor(ctx.loaded)
        save_ms, load_ms, (cont, blocks, full) = _save_reload_continue(ctx, executor, reloaded_executor, finished, Path(tmp))
        samples = record_ttft(ctx, reloaded_executor, (cont, blocks), (full,),
                              "reloaded cache of the last sequence: reconstruct, prefill the continuation, first token",
                              "fresh prefill of the same tokens, first token")

    if "cdf" in ctx.config.plots:
        ctx.plots.append(plots.cdf_plot(
            {"reloaded cache": samples["cached"].ms, "fresh prefill": samples["fresh"].ms},
            ctx.plot_path("ttft-cdf"), xlabel="time to first token (ms)", title=f"EXP-004 {ctx.model_name}"))
    if "bars" in ctx.config.plots:
        ctx.plots.append(plots.bars_plot(
            {"save": float(sum(save_ms) / len(save_ms)), "load": float(sum(load_ms) / len(load_ms))},
            ctx.plot_path("save-load"), ylabel="mean ms per cache", title=f"EXP-004 {ctx.model_name}: save and reload"))


def _finish_in_one_batch(ctx, executor) -> list[tuple]:
    """Run every prompt in one batch, step by step; (step, Completion, still in flight) as each finishes.
    Records the finish order and whether each finished while others were still running."""
    p, tok, res = ctx.params, ctx.loaded.tokenizer, ctx.results
    agents = [f"seq{i}" for i in range(len(p["prompts"]))]
    for agent, prompt, n in zip(agents, p["prompts"], p["max_tokens"]):
        executor.submit(Request(agent, tok.encode(prompt), n), share=False)

    finished, step = [], 0
    while executor.in_flight:
        step += 1
        for c in executor.step_once():
            finished.append((step, c, executor.in_flight))
    order = [c.agent_id for _, c, _ in finished]
    expected = [a for _, a in sorted(zip(p["max_tokens"], agents))]
    res.output("finish_order", [
        {"agent": c.agent_id, "step": s, "still_in_flight": left, "tokens": len(c.token_ids), "text": c.text}
        for s, c, left in finished
    ])
    res.check("finished_independently", order == expected and all(left > 0 for _, _, left in finished[:-1]))
    return finished


def _save_reload_continue(ctx, executor, reloaded_executor, finished: list[tuple], tmp: Path) -> tuple[list, list, tuple]:
    """Each finished cache: check its layers, save it, load it into ``reloaded_executor``'s pool, compare,
    and continue it against a fresh prefill. Returns the save and load times and, for the last
    sequence, (continuation ids, reloaded blocks, full ids)."""
    p, tok, res = ctx.params, ctx.loaded.tokenizer, ctx.results
    caches_info, layers_ok = [], True
    save_ms, load_ms, identical, continuations = [], [], True, []
    for _, c, _ in finished:
        caches = executor.reconstruct_cache(c.blocks)
        types = [type(x).__name__ for x in caches]
        layers_ok &= types == [l.cache_kind for l in executor.spec.layers]
        path = tmp / f"{c.agent_id}.safetensors"
        box = {}

        def save():
            cachefile.save(path, c.blocks, model_fingerprint=ctx.loaded.fingerprint)

        def load():  # into the second engine's empty pool: every tensor is read and verified
            box["blocks"] = cachefile.load(path, reloaded_executor.pool, model_fingerprint=ctx.loaded.fingerprint)

        save_ms.append(time_once(save)[0])
        load_ms.append(time_once(load)[0])
        reloaded = box["blocks"]
        identical &= reloaded.token_ids == c.blocks.token_ids and _same_caches(caches, reloaded_executor.reconstruct_cache(reloaded))
        caches_info.append({"agent": c.agent_id, "layers": len(caches), "layer_types": sorted(set(types)),
                            "tokens": c.blocks.total_tokens, "bytes": c.blocks.nbytes, "file_bytes": path.stat().st_size})

        cont = tok.encode(p["continuation"], add_special_tokens=False)
        with_cache = run_one(reloaded_executor, c.agent_id, cont, reloaded, p["continue_tokens"])
        fresh = run_one(reloaded_executor, c.agent_id + "-fresh", list(reloaded.token_ids) + cont, None, p["continue_tokens"])
        continuations.append({"agent": c.agent_id, "text": with_cache.text, "fresh_text": fresh.text, **match_report(with_cache, fresh)})
        last = (cont, reloaded, list(reloaded.token_ids) + cont)
    res.output("caches", caches_info)
    res.output("continuations", continuations)
    res.check("layers_ok", bool(layers_ok))
    res.check("reload_identical", bool(identical))
    res.check("continuations_match", all(x["tokens_equal"] for x in continuations))
    res.check("max_abs_logprob_diff", max(x["max_abs_logprob_diff"] for x in continuations))
    res.metric("save_ms", save_ms, "ms", description="cachefile.save per finished cache, fsync included (one sample per sequence)")
    res.metric("load_ms", load_ms, "ms", description="cachefile.load into a fresh pool, checksums verified (one sample per sequence)")
    return save_ms, load_ms, last


def _validate(p: dict) -> None:
    if len(p["prompts"]) != len(p["max_tokens"]):
        raise ValueError("prompts and max_tokens need the same length")
    if len(set(p["max_tokens"])) != len(p["max_tokens"]):
        raise ValueError("max_tokens must be distinct, so sequences finish at different steps")


KIND = register(TrialKind(
    name="per_sequence_extraction",
    run=run,
    params={
        "prompts": Param(list, ["The capital of France is", "Machine learning is", "Python programming language"],
                         "one sequence per prompt, all in one batch", nonempty=True),
        "max_tokens": Param(list, [10, 4, 7], "tokens per prompt; distinct, so each finishes at its own step", min=1),
        "continuation": Param(str, " In short,", "text appended to each sequence before continuing"),
        "continue_tokens": Param(int, 8, "tokens generated when continuing, compared with a fresh prefill", min=1),
    },
    plots=frozenset({"cdf", "bars"}),
    validate=_validate,
    trial_code=(_finish_in_one_batch, _save_reload_continue, time_ttft, match_report, _same_caches),
))
