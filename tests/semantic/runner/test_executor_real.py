"""The engine's invariant with real weights: continuing from reconstructed
blocks equals a fresh prefill of the same tokens.

For each case: generate from S, take the Completion's blocks, continue with
new tokens T for 16 greedy steps (a wrong, missing or shifted cached token
shows at the first; the rest read what the continuation itself wrote), and
compare with a fresh prefill of S + generated + T run in the same batch. Both models compute in float32 here
(on a CPU the f32 variant: the GGUF weights dequantized once, matmuls on
OpenBLAS; activations and caches are float32). The two sides differ only in
summation order (one long prefill against cached history plus a short one,
batch padding, BLAS blocking that depends on the row count), so both are
held against mlx-lm's own generate_step of that history, within the spread
its chunked and batched variants show on this device
(``tests.cache_helpers.reference``; about 1e-5 on a CPU): a
wrong, missing or shifted token moves logprobs by whole nats.

These runs are slow on a CPU (about 0.1 s per prefilled token), so each test
prefills only what its case needs and puts the fresh reference in the same
batch as the cached continuation.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import harness
from semantic import BlockPool, BatchExecutor, ModelCacheSpec, Request, compat
from tests.cache_helpers import check_executor

# Not `compat`: under mlx-lm 0.30.4 the tiny models' tests take the same paths through its API (cache classes,
# generate_step, files); these add the real weights' numerics, which do not depend on mlx-lm's version.
pytestmark = [pytest.mark.integration]

STEPS = 16
HISTORY = (Path(harness.__file__).parent / "data" / "history.txt").read_text()


def _executor(loaded, kv_bits=None, blocks=64, prefill_chunk=None):
    spec = ModelCacheSpec.from_model(loaded.model, kv_bits=kv_bits, kv_group_size=64)
    pool = BlockPool(spec, blocks)
    # No stop tokens: every sequence runs exactly max_tokens steps.
    return BatchExecutor(loaded.model, loaded.tokenizer, pool, spec, stop_tokens=[], prefill_chunk=prefill_chunk)


def _run(executor):
    return {c.uid: c for c in executor.step()}


def _assert_same(executor, cached, fresh):
    assert len(cached.token_ids) == STEPS
    assert cached.token_ids == fresh.token_ids
    check_executor(executor, cached, fresh, real=True)


def _history(tokenizer, n):
    ids = tokenizer.encode(HISTORY)
    assert len(ids) >= n, "tests/data/history.txt is too short for this case"
    return ids[:n]


def _continue_and_compare(executor, agent, first, T):
    """Continue ``first`` (a Completion) with T, beside a fresh prefill of the same tokens."""
    S_gen = [*first.request.ids, *first.token_ids]
    cached_uid = executor.submit(Request(agent, S_gen + T, STEPS), first.blocks, share=False)
    fresh_uid = executor.submit(Request(agent + "-fresh", S_gen + T, STEPS), share=False)
    done = _run(executor)
    cached, fresh = done[cached_uid], done[fresh_uid]
    # the reply's last token was never fed: it is prefilled with T
    assert (cached.prompt_tokens, cached.cached_tokens) == (1 + len(T), len(S_gen) - 1)
    assert fresh.prompt_tokens == len(S_gen) + len(T)
    _assert_same(executor, cached, fresh)
    return cached, fresh


def test_gemma3_continues_exactly_after_its_sliding_window_wrapped(gemma3):
    executor = _executor(gemma3)
    window = executor.spec.layers[0].window
    assert window == 512 and {l.kind for l in executor.spec.layers} == {"sliding", "global"}
    S = _history(gemma3.tokenizer, 530)
    uid = executor.submit(Request("a", S, 4), share=False)
    first = _run(executor)[uid]
    assert first.blocks.total_tokens == 533  # past the window: the ring has wrapped (the last token is never fed)

    # Sliding layers hold only the last 512 positions; global layers hold all.
    sliding = next(i for i, l in enumerate(executor.spec.layers) if l.kind == "sliding")
    glob = next(i for i, l in enumerate(executor.spec.layers) if l.kind == "global")
    # (the window's edge references the pooled block [0, 256) that covers it; reconstruction slices)
    rebuilt = executor.reconstruct_cache(first.blocks)
    held = lambda i: compat.read_layer(rebuilt[i]).keys.shape[2]  # noqa: E731
    assert (held(sliding), held(glob)) == (512, 533)

    T = gemma3.tokenizer.encode(" Ilse read the note twice and", add_special_tokens=False)
    cached, _ = _continue_and_compare(executor, "a", first, T)
    caches = executor.reconstruct_cache(cached.blocks)
    assert compat.read_layer(caches[sliding]).offset == 534 + len(T) + STEPS - 1  # its last token never fed


def test_smollm2_batch_of_three_finishes_at_different_steps_and_each_continues(smollm2):
    """EXP-004: sequences of different lengths finish independently, each
    cache is extracted as it finishes, and each continues exactly."""
    executor = _executor(smollm2, prefill_chunk=512)  # every prompt fits the first step's chunk budget
    ids = smollm2.tokenizer.encode(HISTORY)
    prompts = {"short": ids[:20], "medium": ids[100:145], "long": ids[200:280]}
    limits = {"short": 7, "medium": 3, "long": 5}
    uids = {a: executor.submit(Request(a, p, limits[a]), share=False) for a, p in prompts.items()}
    finished, step = {}, 0
    while executor.in_flight:
        step += 1
        for c in executor.step_once():
            finished[c.agent_id] = (step, c)
    # The first step prefills and samples one token each; each then reads its
    # last token on step max_tokens and finishes in that step (that token is
    # never fed), while the others keep going.
    assert {a: s for a, (s, _) in finished.items()} == limits
    for agent, (_, c) in finished.items():
        assert c.uid == uids[agent] and c.blocks.total_tokens == len(prompts[agent]) + limits[agent] - 1

    T = smollm2.tokenizer.encode(" The keeper wrote", add_special_tokens=False)
    pairs = {}
    for agent, (_, c) in finished.items():
        pairs[agent] = (
            executor.submit(Request(agent, [*prompts[agent], *c.token_ids, *T], STEPS), c.blocks, share=False),
            executor.submit(Request(agent + "-fresh", [*prompts[agent], *c.token_ids, *T], STEPS), share=False),
        )
    done = _run(executor)
    for agent, (cached_uid, fresh_uid) in pairs.items():
        _assert_same(executor, done[cached_uid], done[fresh_uid])


def test_two_agents_sharing_a_512_token_prefix_hold_its_blocks_once(smollm2):
    executor = _executor(smollm2)
    pool = executor.pool
    prefix = _history(smollm2.tokenizer, 512)
    tok = smollm2.tokenizer
    sa = tok.encode(" Question: who was Ilse?", add_special_tokens=False)
    sb = tok.encode(" Question: what did the keeper leave?", add_special_tokens=False)
    ua = executor.submit(Request("a", prefix + sa, 3), share=False)
    ub = executor.submit(Request("b", prefix + sb, 3), share=False)
    done = _run(executor)
    a, b = done[ua].blocks, done[ub].blocks
    # the conversations: the blocks lack each reply's last token, never fed
    ha, hb = [*prefix, *sa, *done[ua].token_ids], [*prefix, *sb, *done[ub].token_ids]

    # 512 tokens = two full 256-token blocks, stored once with two references;
    # each agent's tail (suffix + generated) is its own partial block.
    shared = a.groups["global"][:2]
    assert [blk.block_id for blk in b.groups["global"][:2]] == [blk.block_id for blk in shared]
    assert [pool.refcount(blk) for blk in shared] == [2, 2]
    assert a.groups["global"][2] is not b.groups["global"][2]
    stats = pool.stats()
    assert (stats.used, stats.shared, stats.hits) == (4, 2, 2)

    Ta = tok.encode(" Answer briefly.", add_special_tokens=False)
    Tb = tok.encode(" Answer in one sentence.", add_special_tokens=False)
    uids = {
        "a": (executor.submit(Request("a", ha + Ta, STEPS), a, share=False), executor.submit(Request("a-fresh", ha + Ta, STEPS), share=False)),
        "b": (executor.submit(Request("b", hb + Tb, STEPS), b, share=False), executor.submit(Request("b-fresh", hb + Tb, STEPS), share=False)),
    }
    done = _run(executor)
    for cached_uid, fresh_uid in uids.values():
        _assert_same(executor, done[cached_uid], done[fresh_uid])


def test_smollm2_quantized_cache_continues_exactly_in_the_solo_lane(real_variant):
    # On the exact quantized conversion: MLX's own kernels compute each row alike
    # whatever the batch shape, so both sides quantize bit-identical K/V. With the
    # f32 variant on OpenBLAS, sgemm's result for a row depends on how many rows it
    # multiplies (a 30-token prefill vs a cached 3-token one), and 8-bit KV rounding
    # turns those 1e-7 differences into about 0.03 nats at the first token: enough
    # to flip a near-tie. The same f32 weights on the reference BLAS are bit-exact.
    # A short history: MLX's quantized matmul over many rows runs at ~2 GFLOP/s on a CPU (a 68-token
    # prefill ~10 s, where f32 on OpenBLAS takes 0.4 s), and this case needs a cache, not a long one.
    smollm2 = real_variant("smollm2-135m", "quantized")
    executor = _executor(smollm2, kv_bits=8)
    assert executor.spec.quantized
    S = _history(smollm2.tokenizer, 24)
    uid = executor.submit(Request("q", S, 4), share=False)
    first = _run(executor)[uid]
    T = smollm2.tokenizer.encode(" The archivist", add_special_tokens=False)
    _continue_and_compare(executor, "q", first, T)
