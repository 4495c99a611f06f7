"""EXP-010: the step loop: a long prefill beside decoders, and quantized KV batched.

**Interleaving.** ``decoders`` agents decode; once each has read ``warm``
tokens, one agent submits a ``long_tokens`` prompt; the decoders go on
until it has its first token and ``warm`` tokens more. Two sides take turns
(A B, then B A) on the same prompts:

- ``mlx_lm``: mlx-lm's ``BatchGenerator`` as our engine drove it before this
  loop (``prefill_step_size`` 512, prompts inserted whole);
- ``ours``: ``BatchExecutor`` on ``semantic.runner.steploop`` (chunks of
  ``prefill_chunk`` tokens between decode steps).

Per side: the decoders' inter-token latency while nothing prefills (the
tokens before the long prompt arrives and after its first token) and while
it prefills; the long prompt's time to its first token; and total tokens/s
over that window (its prompt tokens plus every decoded token).

**Quantized KV.** ``q_agents`` agents with ``q_bits``-bit KV caches decode
``q_tokens`` tokens each: through the engine (one batched forward pass per
step) and through the solo lane it replaced (one mlx-lm ``generate_step``
per agent, round robin, exactly as the engine ran them before), interleaved.
Resident KV bytes are the pool's bytes for the finished agents' blocks
against a float16 cache of the same tokens.
"""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np

from harness import plots
from harness.trials.base import TrialKind, Param, register

SIDES = ("mlx_lm", "ours")


def _prompt(seed: int, n: int, vocab: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(100, min(vocab, 30000), n)]


def _itls(stamps: dict, lo: float, hi: float) -> tuple[list[float], list[float]]:
    """Decoder gaps (seconds) ending inside (lo, hi], and the others (after each decoder's first token)."""
    inside, outside = [], []
    for times in stamps.values():
        for a, b in zip(times, times[1:]):
            (inside if lo < b <= hi else outside).append(b - a)
    return inside, outside


def _window(stamps: dict, t0: float, t1: float, long_tokens: int) -> dict:
    """One side's figures: the long prompt arrived at t0 and had its first token at t1."""
    inside, outside = _itls(stamps, t0, t1)
    decoded = sum(1 for times in stamps.values() for t in times if t0 < t <= t1)
    return {"prefill_s": t1 - t0, "itl_during": inside, "itl_idle": outside,
            "total_tps": (long_tokens + decoded) / (t1 - t0)}


def _interleave_ours(loaded, p: dict, trial: int, chunk: int | None = None, itl_target_ms: int | None = None) -> dict:
    from semantic import BlockPool, BatchExecutor, ModelCacheSpec, Request

    spec = ModelCacheSpec.from_model(loaded.model)
    need = (p["long_tokens"] + p["decoders"] * (p["decoder_prompt"] + 4 * p["warm"] + 2048)) // 256 + 16
    executor = BatchExecutor(
        loaded.model, loaded.tokenizer, BlockPool(spec, need), spec, stop_tokens=[],
        prefill_chunk=chunk or p["prefill_chunk"] or None, max_batch=p["decoders"] + 1,
        itl_target_s=itl_target_ms / 1000 if itl_target_ms else None,
    )
    vocab = executor.vocab_size
    stamps = {i: [] for i in range(p["decoders"])}
    long_first = []

    def stamp(i):
        return lambda token, lp, row: stamps[i].append(time.perf_counter()) and False

    uids = [executor.submit(Request(f"d{i}", _prompt(100 * trial + i, p["decoder_prompt"], vocab), 100_000, on_token=stamp(i))) for i in range(p["decoders"])]
    while min(len(s) for s in stamps.values()) < p["warm"]:
        executor.step_once()
    t0 = time.perf_counter()
    executor.submit(Request("long", _prompt(7 + trial, p["long_tokens"], vocab), 2,
                          on_token=lambda token, lp, row: long_first.append(time.perf_counter()) and False))
    while not long_first:
        executor.step_once()
    t1 = long_first[0]
    after = {i: len(s) for i, s in stamps.items()}
    while min(len(s) - after[i] for i, s in stamps.items()) < p["warm"]:
        executor.step_once()
    for u in uids:
        executor.cancel(u)
    list(executor.step())
    return _window(stamps, t0, t1, p["long_tokens"])


def _interleave_mlx_lm(loaded, p: dict, trial: int) -> dict:
    from harness import baseline

    gen = baseline.make_batch_generator(loaded.model, max_tokens=100_000, stop_tokens=[],
                                      completion_batch_size=p["decoders"] + 1, prefill_batch_size=p["decoders"] + 1,
                                      prefill_step_size=512)
    vocab = loaded.model.model.embed_tokens.weight.shape[0]
    prompts = [_prompt(100 * trial + i, p["decoder_prompt"], vocab) for i in range(p["decoders"])]
    uids = baseline.insert(gen, prompts, [None] * len(prompts), [100_000] * len(prompts))
    stamps = {u: [] for u in uids}
    long_uid, long_first = None, []

    def step():
        responses = baseline.next_responses(gen)
        now = time.perf_counter()  # the tokens were read: materialized
        for r in responses:
            (stamps[r.uid] if r.uid in stamps else long_first).append(now)

    while min(len(s) for s in stamps.values()) < p["warm"]:
        step()
    t0 = time.perf_counter()
    (long_uid,) = baseline.insert(gen, [_prompt(7 + trial, p["long_tokens"], vocab)], [None], [2])
    while not long_first:
        step()
    t1 = long_first[0]
    after = {u: len(s) for u, s in stamps.items()}
    while min(len(s) - after[u] for u, s in stamps.items()) < p["warm"]:
        step()
    for u in [*uids, long_uid]:
        baseline.remove(gen, u)
    return _window(stamps, t0, t1, p["long_tokens"])


def _quantized_batched(loaded, p: dict, trial: int) -> dict:
    from semantic import BlockPool, BatchExecutor, ModelCacheSpec, Request

    spec = ModelCacheSpec.from_model(loaded.model, kv_bits=p["q_bits"], kv_group_size=p["q_group"])
    pool = BlockPool(spec, p["q_agents"] * ((p["q_prompt"] + p["q_tokens"]) // 256 + 2))
    executor = BatchExecutor(loaded.model, loaded.tokenizer, pool, spec, stop_tokens=[],
                                  max_batch=p["q_agents"], prefill_chunk=p["q_agents"] * p["q_prompt"])
    stamps = []
    for i in range(p["q_agents"]):
        executor.submit(Request(f"q{i}", _prompt(1000 * trial + i, p["q_prompt"], executor.vocab_size), p["q_tokens"], on_token=lambda *a: stamps.append(time.perf_counter()) and False))
    done = list(executor.step())
    first = stamps[p["q_agents"] - 1]  # every agent has its first token: decoding starts
    tokens = len(stamps) - p["q_agents"]
    held = sum(c.blocks.nbytes for c in done)
    fp16 = sum(c.blocks.total_tokens for c in done) * sum(2 * l.n_kv_heads * l.head_dim * 2 for l in spec.layers)
    for c in done:
        c.blocks.release()
    return {"decode_tps": tokens / (stamps[-1] - first), "kv_bytes": held, "fp16_bytes": fp16}


def _quantized_bytes_16bit(ctx, p: dict) -> dict | None:
    """The same KV layout under a 16-bit model, as on a Mac: a fresh copy of the weights cast to
    float16, so the cache's scales and biases are float16 too (under float32 weights they are
    float32: 8 bytes per 64 values, 0.5625x). None for a model that is not registered."""
    from harness.models.load import load
    from harness.models.registry import REGISTRY

    if ctx.model_name not in REGISTRY:
        return None
    loaded = load(ctx.model_name, "f32")  # a new model object: the run's own stays float32
    loaded.model.set_dtype(mx.float16)
    out = _quantized_batched(loaded, {**p, "q_agents": 2, "q_tokens": 4}, 0)
    out["dtype"] = "float16"
    return out


def _quantized_solo(loaded, p: dict, trial: int) -> dict:
    """The solo lane as the engine ran it before: one generate_step per sequence, one forward each per step."""
    from mlx_lm.generate import generate_step

    from semantic import ModelCacheSpec

    spec = ModelCacheSpec.from_model(loaded.model, kv_bits=p["q_bits"], kv_group_size=p["q_group"])
    vocab = loaded.model.model.embed_tokens.weight.shape[0]
    lanes = [generate_step(mx.array(_prompt(1000 * trial + i, p["q_prompt"], vocab)), loaded.model,
                           max_tokens=p["q_tokens"], sampler=lambda x: mx.argmax(x, -1),
                           prompt_cache=spec.make_cache(), prefill_step_size=512) for i in range(p["q_agents"])]
    for lane in lanes:  # prefill and first token: not timed (the batched side's clock starts after them too)
        next(lane)
    start, tokens = time.perf_counter(), 0
    for _ in range(p["q_tokens"] - 1):
        for lane in lanes:
            tok, _ = next(lane)
            int(tok)  # read: materialized
            tokens += 1
    return {"decode_tps": tokens / (time.perf_counter() - start)}


def run(ctx) -> None:
    p, res, loaded = ctx.params, ctx.results, ctx.loaded
    trials = ctx.config.protocol.trials
    extra = [f"ours_c{c}" for c in p["extra_chunks"]] + [f"ours_t{t}" for t in p["itl_targets"]]
    ctx.progress.total = trials * (4 + len(extra)) + 1
    inter = {s: [] for s in (*SIDES, *extra)}
    quant = {"solo": [], "batched": []}
    for trial in range(trials):
        order = [*SIDES, *extra]
        for side in (order if trial % 2 == 0 else order[::-1]):
            if side == "mlx_lm":
                inter[side].append(_interleave_mlx_lm(loaded, p, trial))
            else:
                size = int(side[6:]) if side != "ours" else None
                inter[side].append(_interleave_ours(loaded, p, trial, *((size, None) if side[5:6] == "c" else (None, size))))
            ctx.progress.update(1)
        for side in (("solo", "batched") if trial % 2 == 0 else ("batched", "solo")):
            quant[side].append((_quantized_batched if side == "batched" else _quantized_solo)(loaded, p, trial))
            ctx.progress.update(1)

    med = lambda xs: float(np.median(xs))  # noqa: E731
    for s in inter:
        during = [x * 1000 for r in inter[s] for x in r["itl_during"]]
        idle = [x * 1000 for r in inter[s] for x in r["itl_idle"]]
        res.metric(f"itl_during_ms_{s}", during, "ms", "lower", f"decoders' inter-token latency while the long prompt prefills ({s})")
        res.metric(f"itl_idle_ms_{s}", idle, "ms", "lower", f"decoders' inter-token latency with nothing prefilling ({s})")
        res.metric(f"prefill_s_{s}", [r["prefill_s"] for r in inter[s]], "s", "lower", f"long prompt to its first token ({s})")
        res.metric(f"total_tps_{s}", [r["total_tps"] for r in inter[s]], "tokens/s", "higher", f"prompt + decoded tokens per second ({s})")
        res.check(f"itl_p99_over_idle_median_{s}", float(np.percentile(during, 99)) / med(idle))
    samples = lambda name: res.doc["metrics"][name]["samples"]  # noqa: E731
    for s in ("ours", *extra):
        res.check(f"prefill_time_{s}_over_mlx_lm", med(samples(f"prefill_s_{s}")) / med(samples("prefill_s_mlx_lm")))
        res.check(f"total_tps_{s}_over_mlx_lm", med(samples(f"total_tps_{s}")) / med(samples("total_tps_mlx_lm")))
    for s in ("solo", "batched"):
        res.metric(f"q_decode_tps_{s}", [r["decode_tps"] for r in quant[s]], "tokens/s", "higher",
                   f"{p['q_agents']} agents, {p['q_bits']}-bit KV: decode tokens/s ({s})")
    res.check("q_batched_over_solo", med([r["decode_tps"] for r in quant["batched"]]) / med([r["decode_tps"] for r in quant["solo"]]))
    q = quant["batched"][0]
    res.check("q_kv_bytes_over_fp16", q["kv_bytes"] / q["fp16_bytes"])
    q16 = _quantized_bytes_16bit(ctx, p)
    ctx.progress.update(1)
    if q16 is not None:
        res.check("q_kv_bytes_over_fp16_16bit_model", q16["kv_bytes"] / q16["fp16_bytes"])
        res.output("q_16bit_model_dtype", q16["dtype"])
    res.output("prefill_chunk", p["prefill_chunk"] or "engine default")
    if "tradeoff" in ctx.config.plots:
        base = med(samples("prefill_s_mlx_lm"))
        ctx.plots.append(plots.scaling_plot(
            {s: ([med(samples(f"prefill_s_{s}")) / base], [res.doc["checks"][f"itl_p99_over_idle_median_{s}"]], None)
             for s in inter},
            ctx.plot_path("tradeoff"), "the long prompt's time to first token / BatchGenerator's (goal <= 1.2)",
            "decoders' p99 ITL during it / idle median (goal <= 3)",
            f"{ctx.model_name}: prefill chunk size trades decoder latency for prefill time", logy=True))
    if "itl" in ctx.config.plots:
        ctx.plots.append(plots.cdf_plot(
            {f"{s}, {w}": [x * 1000 for r in inter[s] for x in r[f"itl_{w}"]] for s in inter for w in ("idle", "during")},
            ctx.plot_path("itl-cdf"), "decoder inter-token latency (ms)",
            f"{ctx.model_name}: {p['decoders']} decoders beside a {p['long_tokens']}-token prefill"))


KIND = register(TrialKind(
    name="step_loop",
    run=run,
    params={
        "decoders": Param(int, 4, "agents decoding while the long prompt prefills"),
        "decoder_prompt": Param(int, 64, "each decoder's prompt tokens"),
        "warm": Param(int, 16, "decoder tokens before the long prompt arrives, and after its first token"),
        "long_tokens": Param(int, 8192, "the long prompt's tokens"),
        "prefill_chunk": Param(int, 0, "our loop's prompt tokens per step (0: the engine's default for the device)"),
        "extra_chunks": Param(list, [], "more sides: our loop with these prompt tokens per step (the trade-off curve)"),
        "itl_targets": Param(list, [], "more sides: our loop holding these inter-token latency targets (ms) by "
                                       "sizing each chunk online (--itl-target-ms)"),
        "q_agents": Param(int, 8, "agents with quantized KV caches"),
        "q_bits": Param(int, 8, "their KV bits"),
        "q_group": Param(int, 64, "their KV quantization group"),
        "q_prompt": Param(int, 64, "each quantized agent's prompt tokens"),
        "q_tokens": Param(int, 24, "tokens each quantized agent decodes"),
    },
    plots=frozenset({"itl", "tradeoff"}),
    trial_code=(_interleave_ours, _interleave_mlx_lm, _quantized_batched, _quantized_bytes_16bit, _quantized_solo, _itls, _window),
))
