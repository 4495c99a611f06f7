"""EXP-006: reconstruction and extraction cost against the physical floor.

Every cell (geometry x blocks x layers) builds synthetic caches in the real
cache geometry, extracts them into a pool, and then times, interleaved per
trial:

- ``memcpy_np``: numpy ``copyto`` of the cache's bytes into a preallocated
  buffer, the floor (also the control: no mlx version can move it);
  ``memcpy_mx``: an MLX copy of the same bytes into a new array
  (allocation included, as every MLX op has it);
- ``concat``: the direct method, ``mx.concatenate`` of the per-block arrays
  of every layer, then ``mx.eval``;
- ``reconstruct``: our ``reconstruct`` materialized (lazy time beside it),
  on blocks stored by one extraction (one segment per layer);
- ``reconstruct_fragmented``: ours on blocks that came from one extraction
  per block (a conversation growing by 256 tokens a turn), where each layer
  needs one concatenation;
- ``reconstruct_first_use`` / ``concat_first_use``: each followed by the
  first cache update mlx-lm makes (one new token into every layer), which is
  where a handed-over buffer gets copied: the honest end-to-end figure;
- ``extract``: live caches into pooled blocks (the copy out of the model's
  buffers);
- ``turn`` / ``turn_first_use``: what a resumed turn does to get its cache
  (``CacheManager.rebuild`` with room and a loan): the pool's own buffers,
  with room for the turn's tokens, handed over (``cache.lending``; sliding
  layers as views), then given back; the first update writes into them in
  place. Its blocks come from an extraction of their own that nothing else
  views, as a resident agent's are. The expected-p95 table's "ours" is this.
  ``turn`` is timed as its call (it evaluates everything it makes), without
  the ``mx.synchronize`` after every timed call, which costs as much here.

Sliding layers hold at most their window, so "bytes" is what the cache
really holds. Gemma 3 12B comes from its config with synthetic bf16 tensors;
``gemma3-12b-full`` is the same model with all 48 layers global (no sliding
window), the worst case for bytes per token.

The cells' summaries (the expected-p95 table, ratios to memcpy, scaling fits)
are ``harness.trials.reconstruction.report``.
"""

from __future__ import annotations

import dataclasses
import gc

import mlx.core as mx
import numpy as np

from harness.synthetic import GEMMA3_12B, live_caches
from harness.timing import Samples, time_interleaved
from harness.trials.base import TrialKind, Param, register
from harness.trials.reconstruction.report import expected_p95_table, summarize
from semantic import BlockPool, ModelCacheSpec, Request, compat
from semantic.cache import convert
from semantic.cache.lending import Loan
from semantic.cache.spec import GLOBAL

BLOCK = 256
ROOM = 64  # a turn's new tokens: a short append and its reply
GEOMETRIES = ("smollm2-135m", "gemma3-270m", "gemma3-12b", "gemma3-12b-full")


def geometry(name: str, variant: str | None = None) -> ModelCacheSpec:
    """The cache spec of a geometry: a real model's in compute ``variant`` (as the engine stores it
    here), or Gemma 3 12B's config."""
    if name == "gemma3-12b":
        return ModelCacheSpec.from_config(GEMMA3_12B)
    if name == "gemma3-12b-full":
        full = ModelCacheSpec.from_config(GEMMA3_12B)
        return ModelCacheSpec(tuple(dataclasses.replace(l, kind=GLOBAL, window=None) for l in full.layers))
    from harness import models

    return ModelCacheSpec.from_model(models.load(name, variant).model)


def first_layers(spec: ModelCacheSpec, n: int) -> ModelCacheSpec:
    return ModelCacheSpec(spec.layers[:n])


def _fragmented(pool: BlockPool, caches: list, ids: list[int]):
    """Blocks as a conversation growing one block per turn leaves them: one extraction per block."""
    blocks = None
    total = len(ids)
    for end in list(range(BLOCK, total, BLOCK)) + [total]:
        # a prefix of the live caches: trim a copy of each layer's state to `end` tokens
        part = []
        for c, layer in zip(caches, pool.spec.layers):
            st = compat.read_layer(c) if layer.kind == GLOBAL else compat.temporal_rotating(compat.read_layer(c))
            # synthetic data: a sliding layer's earlier window is stood in for by
            # the first positions it holds now; only token ids decide sharing
            held = end if layer.kind == GLOBAL else min(end, layer.window)
            k, v = st.keys[..., :held, :], st.values[..., :held, :]
            kind = compat.KV if layer.kind == GLOBAL else compat.ROTATING
            part.append(compat.build_layer(compat.LayerState(kind, k, v, end, layer.keep, layer.window, idx=held)))
        new = convert.extract(pool, part, ids[:end])
        if blocks is not None:
            blocks.release()
        blocks = new
    return blocks


def _arrays(caches: list) -> list:
    return [a for c in caches if not c.empty() for a in (c.keys, c.values)]


def _first_use(caches: list, spec: ModelCacheSpec) -> list:
    """The update mlx-lm makes when the next token arrives, in every layer."""
    out = []
    for c, layer in zip(caches, spec.layers):
        shape = (1, layer.n_kv_heads, 1, layer.head_dim)
        k = mx.zeros(shape, dtype=layer.mx_dtype)
        out += list(c.update_and_fetch(k, k))
    return out


def measure_cell(spec: ModelCacheSpec, n_blocks: int, protocol, fragmented: bool, progress) -> dict:
    """One cell: every method above timed on a cache of ``n_blocks`` blocks, interleaved per trial."""
    tokens = n_blocks * BLOCK
    ids = [int(t) for t in np.random.default_rng(n_blocks).integers(1, 30000, tokens)]
    caches = live_caches(spec, tokens)
    pool = BlockPool(spec, total_blocks=len(spec.groups()) * (n_blocks + 1) * 4, block_tokens=BLOCK)
    blocks = convert.extract(pool, caches, ids)
    nbytes = blocks.nbytes
    concat, concat_first_use = _direct(spec, blocks, tokens)
    # other token ids, so the fragmented copy shares nothing with `blocks`
    frag = _fragmented(pool, caches, [t + (1 << 20) for t in ids]) if fragmented else None
    extract, release = _extraction(pool, caches, ids)
    own = convert.extract(pool, caches, [t + (2 << 20) for t in ids])  # an agent's cache: nothing else views it
    fns = {
        **_memcpy(nbytes),
        "concat": concat,
        "reconstruct": lambda: _arrays(convert.reconstruct(blocks, materialize=False)),
        "reconstruct_first_use": lambda: _first_use(convert.reconstruct(blocks), spec),
        "concat_first_use": concat_first_use,
        "extract": extract,
        "turn": lambda: _turn(own, pool, spec, False),
        "turn_first_use": lambda: _turn(own, pool, spec, True),
    }
    if frag is not None:
        fns["reconstruct_fragmented"] = lambda: _arrays(convert.reconstruct(frag, materialize=False))
    samples = time_interleaved(fns, protocol, setup=release, progress=progress)
    # the rebuild evaluates all it makes before it returns: its call is its cost, without the harness's
    # trailing mx.synchronize (0.07 ms p50 here after a call that does nothing, as much as the whole rebuild)
    samples["turn"] = Samples(ms=samples["turn"].lazy_ms, lazy_ms=samples["turn"].lazy_ms,
                              peak_mb=samples["turn"].peak_mb)
    release()
    blocks.release()
    own.release()
    if frag is not None:
        frag.release()
    # the timed functions hold the caches and the copy buffers: free them before the next cell builds its own
    del caches, fns, concat, concat_first_use, extract
    gc.collect()
    return {"tokens": tokens, "bytes": int(nbytes), "samples": samples}


def _turn(blocks, pool: BlockPool, spec: ModelCacheSpec, first_use: bool) -> list:
    """A resumed turn's cache: rebuilt with room over the pool's buffers (grown once, in the warm-up), then
    given back; with ``first_use``, the first token written into it in place (the same slot every call).
    Without it, None: the rebuild materializes what it makes, and the pool's arrays it hands over are
    evaluated already (evaluating them again would time ``mx.eval``, not the turn)."""
    loan = Loan()
    caches = convert.reconstruct(blocks, room=ROOM, loan=loan, pool=pool)
    out = _first_use(caches, spec) if first_use else None
    loan.give_back()
    return out


def _memcpy(nbytes: int) -> dict:
    """The floor: numpy copying ``nbytes`` into a preallocated buffer, and MLX copying them into a new array."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    mx_src = mx.ones((nbytes // 2,), dtype=mx.uint16)
    mx.eval(mx_src)
    return {
        "memcpy_np": lambda: np.copyto(dst, src),
        # a plain MLX copy into a new array (mx.array(x) copies in 0.32 but not in 0.30)
        "memcpy_mx": lambda: mx.concatenate([mx_src[: mx_src.size // 2], mx_src[mx_src.size // 2 :]]),
    }


def _direct(spec: ModelCacheSpec, blocks, tokens: int):
    """The direct method: every layer's per-block arrays concatenated, alone and through the first update."""
    per_layer_blocks = [[blk.layer_data[i] for blk in blocks.blocks_for_layer(i)] for i in range(spec.n_layers)]

    def concat():
        return [mx.concatenate([kv[j] for kv in layer], axis=2) for layer in per_layer_blocks for j in (0, 1)]

    def concat_first_use():
        out = concat()
        mx.eval(out)
        cs = []
        for i, layer in enumerate(spec.layers):
            k, v = out[2 * i], out[2 * i + 1]
            kind = compat.KV if layer.kind == GLOBAL else compat.ROTATING
            cs.append(compat.build_layer(compat.LayerState(kind, k, v, tokens, layer.keep, layer.window, idx=k.shape[2])))
        return _first_use(cs, spec)

    return concat, concat_first_use


def _extraction(pool: BlockPool, caches: list, ids: list[int]):
    """``extract`` copies the live caches into new pooled blocks each call; ``release`` frees them all."""
    held = []
    turn = iter(range(1, 1 << 30))

    def extract():
        # new token ids every call: every block misses the pool, so every byte is copied
        k = next(turn)
        held.append(convert.extract(pool, caches, [t + k for t in ids]))

    def release():
        while held:
            held.pop().release()

    return extract, release


def run(ctx) -> None:
    p, res = ctx.params, ctx.results
    cells = []
    specs = {g: geometry(g, ctx.config.model_variant) for g in p["geometries"]}
    todo = [(g, b, n) for g in p["geometries"] for n in p["layers"] for b in p["blocks"] if n <= specs[g].n_layers]
    ctx.progress.total = len(todo) * ctx.config.protocol.trials
    for g, b, n in todo:
        spec = first_layers(specs[g], n)
        cell = measure_cell(spec, b, ctx.config.protocol, p["fragmented"] and b > 1, ctx.progress.update)
        name = f"{g}/b{b}/l{n}"
        stats = {}
        for method, s in cell["samples"].items():
            m = res.timing(f"{name}/{method}_ms", s, lazy_gap=method in ("reconstruct", "concat", "reconstruct_fragmented"))
            # numpy's memcpy does not depend on mlx: a change in it is the machine's
            m["control"] = method == "memcpy_np"
            stats[method] = m["stats"]
        for method in cell["samples"]:
            if method != "memcpy_np":
                res.compare(f"{name}/{method}_vs_memcpy", f"{name}/{method}_ms", f"{name}/memcpy_np_ms")
        cells.append({"geometry": g, "blocks": b, "layers": n, "tokens": cell["tokens"], "bytes": cell["bytes"],
                      **{f"{m}_p50_ms": st["median"] for m, st in stats.items()},
                      **{f"{m}_p95_ms": st["p95"] for m, st in stats.items()}})
    res.output("cells", cells)
    summarize(ctx, cells)
    if p["padded_tokens"]:
        _padded_comparison(ctx, first_layers(specs[p["geometries"][0]], specs[p["geometries"][0]].n_layers), p["padded_tokens"])
    if p["model"]:
        _with_model(ctx)


KIND = register(TrialKind(
    name="reconstruction",
    run=run,
    params={
        "geometries": Param(list, ["smollm2-135m", "gemma3-12b"], "cache geometries", GEOMETRIES,
                            nonempty=True),
        "blocks": Param(list, [1, 2, 4, 8, 16, 32], "blocks of 256 tokens", nonempty=True, min=1),
        "layers": Param(list, [12, 24, 30, 48], "first N layers of the geometry (cells with N > its layers are "
                                                 "skipped)", nonempty=True, min=1),
        "fragmented": Param(bool, True, "also time blocks stored by one extraction per block"),
        "padded_tokens": Param(int, 612, "blocks against one padded buffer at this length (0: skip)"),
        "model": Param(str, "smollm2-135m", "real model for the round trip and reuse-vs-direct ('' to skip)"),
        "model_trials": Param(int, 10, "trials for the real-model measurements (each takes seconds on a CPU)"),
        "round_trip_blocks": Param(list, [1, 8], "cache sizes (blocks) for Benchmark 3, the round trip"),
        "reuse_prompt_lengths": Param(list, [16, 64, 256, 1024], "prompt lengths for cache reuse vs direct generation"),
    },
    plots=frozenset({"scaling", "bandwidth"}),
    needs_model=False,
    trial_code=(measure_cell, _memcpy, _direct, _extraction, live_caches, _fragmented, _first_use, _turn,
                convert.reconstruct, convert.extract),
    headline=expected_p95_table,
))


# ---------------------------------------------------------------- with the real model


def _padded_comparison(ctx, spec: ModelCacheSpec, tokens: int) -> None:
    """Blocks against padding: e.g. 612 tokens as 3 blocks (256+256+100) against one buffer padded to 768,
    sliced back to 612 tokens."""
    res = ctx.results
    padded_len = -(-tokens // BLOCK) * BLOCK
    caches = live_caches(spec, tokens, seed=7)
    pool = BlockPool(spec, total_blocks=len(spec.groups()) * 8, block_tokens=BLOCK)
    blocks = convert.extract(pool, caches, range(tokens))
    padded = []
    for c, layer in zip(caches, spec.layers):
        st = compat.read_layer(c)
        pad = [(0, 0)] * 2 + [(0, padded_len - st.keys.shape[2]), (0, 0)]
        padded.append((mx.pad(st.keys, pad), mx.pad(st.values, pad)))
    mx.eval(padded)
    per_block = [[blk.layer_data[i] for blk in blocks.blocks_for_layer(i)] for i in range(spec.n_layers)]
    fns = {
        "blocks_reconstruct": lambda: _arrays(convert.reconstruct(blocks, materialize=False)),
        "blocks_concat": lambda: [mx.concatenate([kv[j] for kv in layer], axis=2) for layer in per_block for j in (0, 1)],
        "padded_slice_copy": lambda: [mx.contiguous(x[..., :tokens, :]) for kv in padded for x in kv],
    }
    samples = time_interleaved(fns, ctx.config.protocol)
    for name, s in samples.items():
        res.timing(f"padded_{tokens}/{name}_ms", s, lazy_gap=False)
    res.compare(f"padded_{tokens}/blocks_vs_padded", f"padded_{tokens}/blocks_reconstruct_ms", f"padded_{tokens}/padded_slice_copy_ms")
    res.compare(f"padded_{tokens}/concat_vs_padded", f"padded_{tokens}/blocks_concat_ms", f"padded_{tokens}/padded_slice_copy_ms")
    blocks.release()


def _with_model(ctx) -> None:
    """Benchmark 3 (round trip) and cache reuse against direct generation, with real SmolLM2.

    The KV data are synthetic (only timing is measured here; exactness is the
    engine tests' job), the model and engine are real.
    """
    from harness import models
    from harness.executors import make_executor, time_ttft

    p, res = ctx.params, ctx.results
    loaded = models.load(p["model"], ctx.config.model_variant)
    spec = ModelCacheSpec.from_model(loaded.model)
    executor = make_executor(loaded, 256)
    proto = dataclasses.replace(ctx.config.protocol, trials=min(ctx.config.protocol.trials, p["model_trials"]),
                                warmup=min(ctx.config.protocol.warmup, 1))
    follow = loaded.tokenizer.encode(" Continue.", add_special_tokens=False)

    def blocks_of(tokens: int, salt: int):
        ids = [int(t) for t in np.random.default_rng(tokens + salt).integers(100, 20000, tokens)]
        return convert.extract(executor.pool, live_caches(spec, tokens, seed=salt), ids)

    # Benchmark 3: reconstruct + prefill the follow-up + 10 tokens + extract at finish
    for n in p["round_trip_blocks"]:
        blocks = blocks_of(n * BLOCK, 1)

        def round_trip():
            executor.submit(Request("rt", [*blocks.token_ids, *follow], 10), blocks, share=False)
            for c in executor.step():
                c.blocks.release()

        s = time_interleaved({"round_trip": round_trip}, proto)["round_trip"]
        res.timing(f"round_trip/b{n}_ms", s, "reconstruct, prefill the follow-up, generate 10 tokens, extract", lazy_gap=False)
        blocks.release()

    # reuse vs direct: time to first token with the cache of L tokens vs a fresh prefill of them
    rows = []
    for L in p["reuse_prompt_lengths"]:
        blocks = blocks_of(L, 2)
        s = time_ttft(executor, (follow, blocks), (list(blocks.token_ids) + follow,), proto, None)
        a = res.timing(f"reuse/L{L}/cached_ttft_ms", s["cached"], lazy_gap=False)
        b = res.timing(f"reuse/L{L}/direct_ttft_ms", s["fresh"], lazy_gap=False)
        rows.append({"prompt_tokens": L, "cached_p50_ms": a["stats"]["median"], "direct_p50_ms": b["stats"]["median"],
                     "cache_wins": a["stats"]["median"] < b["stats"]["median"]})
        blocks.release()
    res.output("reuse_vs_direct", rows)
    wins = [r["prompt_tokens"] for r in rows if r["cache_wins"]]
    res.check("reuse_wins_from_prompt_tokens", min(wins) if wins else None)
