"""EXP-003: a cache injected into the batch generator continues exactly like a fresh prefill.

Turn 1 prefills a history plus a short prompt and generates; its cache is
extracted into pooled blocks. Turn 2 sends a follow-up twice: once with the
blocks injected (only the follow-up is prefilled) and once as a fresh prefill
of the whole sequence. The outputs must match; the time to the first token
of each is measured, interleaved, after materialization.
"""

from __future__ import annotations

from harness import plots
from harness.executors import make_executor, match_report, record_ttft, run_one, time_ttft
from harness.prompts import history_ids
from harness.trials.base import TrialKind, Param, register


def run(ctx) -> None:
    p, tok, res = ctx.params, ctx.loaded.tokenizer, ctx.results
    executor = make_executor(ctx.loaded)
    prompt = history_ids(tok, p["history_tokens"]) + tok.encode(p["prompt"], add_special_tokens=False)
    turn1 = run_one(executor, "agent", prompt, None, p["max_tokens"])
    blocks = turn1.blocks
    caches = executor.reconstruct_cache(blocks)
    followup = tok.encode(p["followup"], add_special_tokens=False)

    with_cache = run_one(executor, "agent", followup, blocks, p["continue_tokens"])
    without = run_one(executor, "fresh", list(blocks.token_ids) + followup, None, p["continue_tokens"])
    report = match_report(with_cache, without)
    res.output("turn1_text", turn1.text)
    res.output("with_cache_text", with_cache.text)
    res.output("without_cache_text", without.text)
    res.output("cache", {
        "tokens": blocks.total_tokens,
        "layers": len(caches),
        "layer_types": sorted({type(c).__name__ for c in caches}),
        "bytes": blocks.nbytes,
        "prefilled_with_cache": with_cache.prompt_tokens,
        "prefilled_without_cache": without.prompt_tokens,
    })
    res.output("match", report)
    res.check("outputs_match", report["tokens_equal"])
    res.check("max_abs_logprob_diff", report["max_abs_logprob_diff"])

    samples = record_ttft(ctx, executor, (followup, blocks), (list(blocks.token_ids) + followup,),
                          "reconstruct the blocks, prefill the follow-up, sample the first token",
                          "prefill history + turn 1 + follow-up, sample the first token")

    if "cdf" in ctx.config.plots:
        ctx.plots.append(plots.cdf_plot(
            {"injected cache": samples["cached"].ms, "fresh prefill": samples["fresh"].ms},
            ctx.plot_path("ttft-cdf"), xlabel="time to first token (ms)",
            title=f"EXP-003 {ctx.model_name}: {blocks.total_tokens}-token history"))
    if "bars" in ctx.config.plots:
        ctx.plots.append(plots.bars_plot(
            {"injected cache": res.doc["metrics"]["ttft_injected_ms"]["stats"]["median"],
             "fresh prefill": res.doc["metrics"]["ttft_fresh_ms"]["stats"]["median"]},
            ctx.plot_path("ttft-bars"), ylabel="p50 time to first token (ms)",
            title=f"EXP-003 {ctx.model_name}"))


KIND = register(TrialKind(
    name="cache_injection",
    run=run,
    params={
        "prompt": Param(str, "The quick brown fox jumps over the lazy", "turn 1's text, after the history"),
        "history_tokens": Param(int, 256, "tokens of built-in history text before the prompt", min=0),
        "max_tokens": Param(int, 10, "tokens generated in turn 1", min=1),
        "followup": Param(str, " Then the fox", "turn 2's new text"),
        "continue_tokens": Param(int, 16, "tokens generated in turn 2, compared with and without the cache",
                                 min=1),
    },
    plots=frozenset({"cdf", "bars"}),
    trial_code=(time_ttft, match_report),
))
