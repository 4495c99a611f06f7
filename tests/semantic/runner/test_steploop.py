"""The step loop: chunked prefill between batched decode steps, quantized KV batched.

The reference is mlx-lm's own single-sequence ``generate_step`` (one prompt,
one cache of the same type, greedy), not our loop. Batching and chunking
change the summation order only; how far that moves a logprob here is
measured beside the reference (mlx-lm's own chunked and batched variants,
``harness/noise.py``) and the turn must stay within a few times that. A
quantized row in a batch holds the same packed bytes as the solo cache
(tested below), but 8-bit KV amplifies those reordered sums: its measured
noise, and so its tolerance, is larger.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from semantic import BlockPool, BatchExecutor, ModelCacheSpec, Request, kinds
from semantic.kinds.batchquant import BatchQuantizedKVCache
from tests.cache_helpers import reference
from tests.tiny_models import byte_tokenizer

pytestmark = pytest.mark.compat

# prompt lengths around the tiny models' 4-token blocks and gemma's 8-token window
PROMPTS = {"a": 7, "b": 21, "c": 37}


def _ids(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(1, 250, n)]


def _spec(model, bits):
    return ModelCacheSpec.from_model(model, kv_bits=bits, kv_group_size=32)


def _executor(model, bits, chunk, max_batch=8):
    spec = _spec(model, bits)
    return BatchExecutor(
        model, byte_tokenizer(), BlockPool(spec, 512, block_tokens=4), spec,
        stop_tokens=[], prefill_chunk=chunk, max_batch=max_batch,
    )


@pytest.fixture(params=["llama", "llama-q8", "llama-q4", "gemma", "gemma-q8"])
def model_and_bits(request, llama_tiny, gemma_tiny):
    name, _, q = request.param.partition("-q")
    return (llama_tiny if name == "llama" else gemma_tiny), (int(q) if q else None)


@pytest.mark.parametrize("chunk", [1, 3, 4, 5, 8, 13, 64])
def test_chunked_prefill_in_a_batch_equals_mlx_lm_for_every_cache_type(model_and_bits, chunk):
    """Chunks end inside blocks (3, 5, 13), at their edges (4, 8) and past the window (13, 64);
    every turn equals mlx-lm's own generation, the first and the one continuing from pooled blocks."""
    model, bits = model_and_bits
    executor = _executor(model, bits, chunk)
    hist = {a: _ids(i, n) for i, (a, n) in enumerate(PROMPTS.items())}
    uids = {a: executor.submit(Request(a, h, 6)) for a, h in hist.items()}
    first = {c.uid: c for c in executor.step()}
    nxt = {}
    for a, h in hist.items():
        c = first[uids[a]]
        reference(model, h, 6, bits).check(c.token_ids, c.logprobs, f"{a} first turn")
        assert c.blocks.token_ids == tuple(h + c.token_ids[:-1])  # the last token is never fed
        nxt[a] = (h + c.token_ids + _ids(9, 5), c.blocks)
    uids = {a: executor.submit(Request(a, h, 5), own) for a, (h, own) in nxt.items()}
    second = {c.uid: c for c in executor.step()}
    for a, (h, _) in nxt.items():
        c = second[uids[a]]
        assert c.cached_tokens >= len(h) - 6  # all but the new tokens and the reply's last one, never fed
        reference(model, h, 5, bits).check(c.token_ids, c.logprobs, f"{a} second turn")


def test_a_long_prefill_advances_one_chunk_per_step_while_others_decode(llama_tiny):
    executor = _executor(llama_tiny, None, chunk=4)
    read = {"short": 0, "long": 0}

    def counter(agent):
        def count(token, logprob, row):
            read[agent] += 1
            return False
        return count

    executor.submit(Request("short", _ids(1, 6), 40, on_token=counter("short")))
    while read["short"] == 0:  # 6 prompt tokens: two steps of at most 4
        executor.step_once()
    executor.submit(Request("long", _ids(2, 41), 2, on_token=counter("long")))
    decoder_tokens_per_step = []
    while read["long"] == 0:
        before = read["short"]
        executor.step_once()
        decoder_tokens_per_step.append(read["short"] - before)
    assert len(decoder_tokens_per_step) == -(-41 // 4)  # 11 chunks of at most 4 tokens, one per step
    assert decoder_tokens_per_step == [1] * 11  # the decoder got its token at every one of those steps


@pytest.mark.parametrize("chunk, passes", [
    (6, [[1, 4], [4], [4], [4], [3]]),   # after a stop the rest of the budget (1, 2) waits for the next step
    (8, [[1, 4], [4, 4], [4, 3]]),       # 4 left after a stop reaches the next one: the step goes on
    (4, [[1], [4], [4], [4], [4], [3]]),
])
def test_a_prompt_starting_off_the_block_grid_is_chunked_back_onto_it(llama_tiny, chunk, passes):
    """A cache holding 3 tokens, 4-token blocks: the prompt's snapshot positions fall at 1, 5, 9, 13 and 17.
    A step's prefill ends at a stop unless its budget reaches the next one, so no forward pass
    is spent on the few tokens past a stop (each pass has a fixed cost) and chunks stay on the grid."""
    from semantic.runner.steploop import StepLoop

    calls: list[int] = []

    class Counting:
        def __init__(self, model):
            self.model = model

        def __call__(self, inputs, cache=None):
            calls.append(inputs.shape[1])
            return self.model(inputs, cache=cache)

    cache = _spec(llama_tiny, None).make_cache()
    mx.eval(llama_tiny(mx.array([_ids(3, 3)]), cache=cache))
    stopped = []
    loop = StepLoop(Counting(llama_tiny), stop_tokens=[], max_batch=8, prefill_chunk=chunk)
    loop.add(0, Request("a", _ids(3, 3) + _ids(4, 20), 1), 3, cache, snapshot_at=[1, 5, 9, 13, 17],
             on_snapshot=lambda uid, caches, fed: stopped.append((fed, caches[0].offset)))
    per_step, events = [], []
    while not events:
        calls.clear()
        events = loop.step()
        per_step.append(list(calls))
    assert per_step == passes
    assert stopped == [(1, 4), (5, 8), (9, 12), (13, 16), (17, 20)]  # each checkpoint at a block edge


def test_quantized_sequences_share_one_forward_pass_per_step(llama_tiny):
    calls = []

    class Counting:
        def __init__(self, model):
            self.model = model
            self.args, self.layers = model.args, model.layers

        def __call__(self, inputs, cache=None):
            calls.append(inputs.shape)
            return self.model(inputs, cache=cache)

    spec = _spec(llama_tiny, 8)
    executor = BatchExecutor(
        llama_tiny, byte_tokenizer(), BlockPool(spec, 256, block_tokens=4), spec, stop_tokens=[], prefill_chunk=64
    )
    executor.model = executor._loop.model = Counting(llama_tiny)
    for i in range(4):
        executor.submit(Request(f"q{i}", _ids(i, 9 + i), 8))
    done = list(executor.step())
    assert len(done) == 4
    decode = [s for s in calls if s[0] == 4]
    # 4 prompts prefilled in one step (a forward of their own each), then 7 steps of one forward each for
    # all 4 (the last token is never fed)
    assert len(calls) == 4 + 7 and [s[1] for s in decode] == [1] * 7
    assert any(isinstance(c, BatchQuantizedKVCache) for c in kinds.merge([_spec(llama_tiny, 8).make_cache()]))


def _quantized(n: int, seed: int, bits: int = 8) -> object:
    from mlx_lm.models.cache import QuantizedKVCache

    c = QuantizedKVCache(group_size=32, bits=bits)
    rng = np.random.default_rng(seed)
    k = mx.array(rng.standard_normal((1, 2, n, 64)).astype(np.float32))
    c.update_and_fetch(k, k * 0.5)
    return c


def test_batch_quantized_cache_rows_hold_the_solo_caches_bytes_through_merge_extend_filter():
    solos = [_quantized(n, i) for i, n in enumerate([5, 12, 3])]
    batch = BatchQuantizedKVCache.merge(solos[:2])
    batch.extend(BatchQuantizedKVCache.merge(solos[2:]))
    assert batch.left_padding.tolist() == [7, 0, 9] and batch.offset.tolist() == [5, 12, 3]
    for i, solo in enumerate(solos):
        row = batch.extract(i)
        assert row.offset == solo.offset
        for got, want in zip((*row.keys, *row.values), (*solo.keys, *solo.values)):
            assert mx.array_equal(got, want[..., : solo.offset, :])
    # one decode step's update lands in every row at its own position
    step = mx.ones((3, 2, 1, 64))
    batch.update_and_fetch(step, step)
    assert batch.offset.tolist() == [6, 13, 4]
    batch.filter([0, 2])  # row 1 (no padding) leaves: the shared padding shrinks
    assert batch.left_padding.tolist() == [0, 2] and batch._idx == 6
    kept = batch.extract(1)
    assert kept.offset == 4
    assert mx.array_equal(kept.keys[0][..., :3, :], solos[2].keys[0][..., :3, :])
    mask = batch.make_mask(1)
    assert mask.shape[-1] == batch._idx + 1 and not mask[1, 0, 0, 0].item() and mask[0, 0, 0, 0].item()


def test_the_executor_says_what_a_lone_turns_prefill_steps_by(llama_tiny):
    from semantic.runner.stepbudget import SOLO_CHUNK

    spec = _spec(llama_tiny, 8)

    def executor(**kw):
        return BatchExecutor(llama_tiny, byte_tokenizer(), BlockPool(spec, 16, block_tokens=4), spec,
                                    stop_tokens=[], **kw)

    assert executor(prefill_chunk=64).prefill_chunk == 64  # a fixed chunk, decoding or not
    assert executor().prefill_chunk == SOLO_CHUNK           # the step budget's, with nothing decoding
