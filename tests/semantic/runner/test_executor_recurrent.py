"""Models that resume only from snapshots: recurrent layers (qwen3_next's Gated DeltaNet, lfm2's short
convolutions) and a sliding window shorter than a block (gpt_oss). Every turn type an agent makes
starts from a cache and must equal a fresh prefill of the same ids: mlx-lm's generate_step's greedy
tokens, and logprobs within the spread its chunked and batched variants show on this machine
(``tests.cache_helpers.reference``; only the chunking of the attention matmuls differs, the recurrent
state is carried token by token and comes out bit-equal)."""

from __future__ import annotations

import numpy as np
import pytest

from semantic import BlockPool, BatchExecutor, ModelCacheSpec, Request
from semantic.decode.promptlookup import SpecConfig
from semantic.cache.snapshots import FEW_NEW, SnapshotPositions
from tests.cache_helpers import check
from tests.tiny_models import byte_tokenizer, tiny_gpt_oss, tiny_lfm2, tiny_qwen3_next

BT = 16
pytestmark = pytest.mark.compat
MODELS = {"qwen3_next": tiny_qwen3_next, "lfm2": tiny_lfm2, "gpt_oss": tiny_gpt_oss}
# from the zoo: nested caches (falcon_h1's recurrent state beside attention; deepseek_v32's MLA latent and
# indexer caches), chunked attention (llama4), KV-shared layers that own no cache (gemma4_text)
ZOO = ("falcon_h1", "deepseek_v32", "llama4", "gemma4_text")


@pytest.fixture(scope="module", params=sorted(MODELS) + list(ZOO))
def model(request):
    if request.param in MODELS:
        return request.param, MODELS[request.param]()
    from harness.models import zoo

    from semantic import compat

    if request.param not in zoo.model_types():
        pytest.skip(f"this mlx-lm has no {request.param}")
    if request.param == "llama4" and not compat.CHUNKED_TRIMS_TOKENS:
        pytest.skip("this mlx-lm's ChunkedKVCache breaks on a chunked prefill: refused at load")
    if request.param == "deepseek_v32" and compat.MLX_LM_VERSION.startswith("0.30"):
        pytest.skip("mlx-lm 0.30.4's deepseek_v32 indexer fails on batch caches (BatchKVCache)")
    return request.param, zoo.build(request.param)[0]


def _executor(model, blocks=400, **kw):
    spec = ModelCacheSpec.from_model(model)
    return BatchExecutor(model, byte_tokenizer(), BlockPool(spec, blocks, block_tokens=BT), spec,
                                stop_tokens=[], **kw)


def _ids(n, seed):
    return [int(x) for x in np.random.default_rng(seed).integers(1, 250, n)]


def _turn(executor, model, agent, ids, own=None, n=6, boundaries=()):
    executor.submit(Request(agent, ids, n, boundaries=boundaries), own)
    (done,) = list(executor.step())
    _assert_fresh(model, done)
    return done


def _assert_fresh(model, done):
    check(model, done, spec=ModelCacheSpec.from_model(model))


def test_every_turn_type_resumes_from_a_snapshot_and_equals_a_fresh_prefill(model):
    _, m = model
    executor = _executor(m)
    system = _ids(40, 1)
    first = _turn(executor, m, "a", system + _ids(15, 2), boundaries=(40,))
    assert first.cached_tokens == 0
    append = first.request.ids + tuple(first.token_ids) + tuple(_ids(20, 3))
    # its new message's start marked, as the service does: the first turn's cache ends one token before it
    second = _turn(executor, m, "a", append, first.blocks, boundaries=(len(append) - 20,))
    # the whole previous turn but its reply's last token, never fed
    assert second.cached_tokens == len(first.request.ids) + len(first.token_ids) - 1
    regen = _turn(executor, m, "a", append, second.blocks)
    # the whole prompt but the token that gives the logits: it brought more than FEW_NEW new tokens
    assert regen.cached_tokens == len(append) - 1
    edited = append[:-20] + tuple(_ids(7, 4))
    edit = _turn(executor, m, "a", edited, regen.blocks, boundaries=(len(append) - 20,))
    assert edit.cached_tokens == len(append) - 20  # everything before the edited message
    other = _turn(executor, m, "b", system + _ids(12, 5))
    assert other.cached_tokens == 40  # the shared system prompt


def test_a_batch_of_agents_of_different_lengths_each_equals_its_fresh_prefill(model):
    _, m = model
    executor = _executor(m)
    prompts = {f"r{i}": _ids(n, 10 + i) for i, n in enumerate((9, 37, 70))}
    for agent, ids in prompts.items():
        executor.submit(Request(agent, ids, 5 + len(ids) % 4), None)
    done = list(executor.step())
    assert len(done) == 3
    for d in done:
        _assert_fresh(m, d)
    # again, each from its own snapshot, all three in one batch
    for d in done:
        executor.submit(Request(d.agent_id, d.request.ids + tuple(d.token_ids) + (7, 8, 9), 6), d.blocks)
    again = list(executor.step())
    for d in again:
        assert d.cached_tokens == d.history_tokens - 4  # the 3 new tokens and the reply's last one, never fed
        _assert_fresh(m, d)


def test_a_sampled_neighbour_changes_nothing_for_a_greedy_sequence(model):
    from semantic.decode.sampling import SamplingParams

    _, m = model
    executor = _executor(m)
    greedy = _ids(30, 20)
    executor.submit(Request("g", greedy, 8), None)
    executor.submit(Request("s", _ids(21, 21), 8, sampling=SamplingParams(temperature=1.0, seed=3)), None)
    done = {d.agent_id: d for d in executor.step()}
    _assert_fresh(m, done["g"])


def test_a_stored_snapshot_is_a_copy_that_later_decoding_never_changes(model):
    _, m = model
    executor = _executor(m)
    first = _turn(executor, m, "a", _ids(30, 30), n=4)
    before = {b.block_id: [np.array(x) for kv in b.layer_data.values() for side in kv
                           for x in (side if isinstance(side, tuple) else (side,))]
              for blocks in first.blocks.groups.values() for b in blocks}
    for _ in range(2):  # two more turns decode from (rebuilt copies of) it
        _turn(executor, m, "a", first.request.ids + tuple(first.token_ids) + (3, 4), first.blocks, n=8)
    for blocks in first.blocks.groups.values():
        for b in blocks:
            after = [np.array(x) for kv in b.layer_data.values() for side in kv
                     for x in (side if isinstance(side, tuple) else (side,))]
            assert all(np.array_equal(x, y) for x, y in zip(before[b.block_id], after))


def test_a_cancelled_turn_keeps_a_cache_that_continues_exactly(model):
    _, m = model
    executor = _executor(m)
    ids = _ids(25, 40)
    uid = executor.submit(Request("a", ids, 50), None)
    for _ in range(4):
        executor.step_once()
    cut = executor.cancel(uid)
    assert cut.finish_reason == "cancelled" and cut.blocks is not None
    held = cut.blocks.total_tokens
    assert held == len(ids) + len(cut.token_ids) - 1  # the newest token was never fed
    nxt = tuple(ids) + tuple(cut.token_ids) + (5,)
    done = _turn(executor, m, "a", nxt, cut.blocks)
    assert done.cached_tokens == held


def test_speculation_is_on_for_recurrent_hybrids_and_windows():
    on = SpecConfig()
    for m in (tiny_lfm2(), tiny_qwen3_next(), tiny_gpt_oss()):
        executor = _executor(m, speculation=on)
        assert executor.speculation_off is None and executor._loop.speculation is on


@pytest.mark.parametrize("model_type, why", [
    ("mamba", "recurrent layers ignore a row's length"),  # its scan runs over padding: no exact replay
    ("llama4", "chunked layers decode one sequence at a time"),
])
def test_where_speculation_stays_off_the_executor_says_why(model_type, why):
    from harness.models import zoo

    from semantic import compat

    if model_type not in zoo.model_types():
        pytest.skip(f"this mlx-lm has no {model_type}")
    if model_type == "llama4" and not compat.CHUNKED_TRIMS_TOKENS:
        pytest.skip("this mlx-lm's ChunkedKVCache breaks on a chunked prefill: refused at load")
    executor = _executor(zoo.build(model_type)[0], speculation=SpecConfig())
    assert why in executor.speculation_off and executor._loop.speculation is None


def test_snapshot_points_stop_at_boundaries_the_last_token_but_one_and_a_grid():
    spec = ModelCacheSpec.from_model(tiny_lfm2())
    pts = SnapshotPositions(spec, BT)
    assert pts.required and pts.interval == BT  # a state smaller than a block of KV: every block
    assert pts.taken(0, 40, (21,)) == [16, 21, 32, 39]
    assert pts.taken(20, 40, (21,)) == [21, 32, 39]
    # a prompt of at most FEW_NEW new tokens stops at no last token but one (a second forward over the whole
    # context, every such turn): its regenerate resumes where it did, carried
    few = 40 - FEW_NEW
    assert 39 not in pts.taken(few, 40) and 39 in pts.taken(few - 1, 40)
    assert pts.carried(few, 40) == (few,) and pts.carried(few - 1, 40)[0] == 39
    glob = SnapshotPositions(ModelCacheSpec.from_model(tiny_qwen3_next()), 4)
    assert glob.interval > 4  # a state bigger than a block of KV: a sparser grid


def test_a_rebuilt_full_window_never_writes_into_the_pooled_blocks_it_came_from():
    # a rotating cache at its full window writes its first decoded token into its buffer in place:
    # the buffer must be a new object, never the array a pooled block holds
    from tests.tiny_models import tiny_gemma3

    m = tiny_gemma3(window=8)
    spec = ModelCacheSpec.from_model(m)
    executor = BatchExecutor(m, byte_tokenizer(), BlockPool(spec, 400, block_tokens=8), spec, stop_tokens=[])
    ids = _ids(24, 50)
    first = _turn(executor, m, "a", ids, n=1)
    snap = {b.block_id: [np.array(x) for kv in b.layer_data.values() for x in kv]
            for blocks in first.blocks.groups.values() for b in blocks}
    for extra in ((3, 4), (5, 6)):
        _turn(executor, m, "a", tuple(ids) + tuple(first.token_ids) + extra, first.blocks, n=6)
    for blocks in first.blocks.groups.values():
        for b in blocks:
            assert all(np.array_equal(x, np.array(y)) for x, y in
                       zip(snap[b.block_id], [y for kv in b.layer_data.values() for y in kv]))


def test_8_bit_kv_on_a_hybrids_attention_layers_resumes_exactly_like_its_own_fresh_turn():
    # the reference quantizes as the engine does: mlx-lm's generate_step in caches of the same 8-bit spec
    m = tiny_qwen3_next(heads=2, kv_heads=1, head_dim=32)  # heads a group of 32 divides
    spec = ModelCacheSpec.from_model(m, kv_bits=8, kv_group_size=32)
    assert {l.kind for l in spec.layers} == {"recurrent", "global"} and spec.quantized
    executor = BatchExecutor(m, byte_tokenizer(), BlockPool(spec, 400, block_tokens=BT), spec, stop_tokens=[])
    first_ids = _ids(40, 60)
    executor.submit(Request("a", first_ids, 6), None)
    (first,) = list(executor.step())
    nxt = tuple(first_ids) + tuple(first.token_ids) + (9, 8, 7)
    executor.submit(Request("a", nxt, 6), first.blocks)
    (resumed,) = list(executor.step())
    executor.submit(Request("b", nxt, 6), None, share=False)
    (fresh,) = list(executor.step())
    # the reply's last token was never fed
    assert resumed.cached_tokens == len(first_ids) + len(first.token_ids) - 1 and fresh.cached_tokens == 0
    assert resumed.token_ids == fresh.token_ids
    check(m, resumed, spec=spec, what="resumed")  # 8-bit K/V amplifies the noise: measured in the same caches
    check(m, fresh, spec=spec, what="fresh")


def test_a_finished_cache_carries_the_prompts_snapshot_and_ends_before_the_stop_so_a_re_rendered_reply_resumes():
    m = tiny_qwen3_next()
    ids = _ids(40, 70)
    probe = _executor(m)
    probe.submit(Request("p", ids, 6), None)
    (dry,) = list(probe.step())
    stop = dry.token_ids[2]
    executor = _executor(m)
    executor.stop_tokens = executor._loop.stop_tokens = frozenset([stop])
    executor.submit(Request("a", ids, 20), None)
    (first,) = list(executor.step())
    assert first.token_ids[-1] == stop and first.finish_reason == "stop"
    snaps = [b.end for b in first.blocks.groups["recurrent"]]
    total = len(ids) + len(first.token_ids)
    # a regenerate, and the whole turn: the stop token is never fed, so it ends where a reply without it does
    assert snaps == [len(ids) - 1, total - 1] and first.blocks.total_tokens == total - 1
    # the client sends the reply back without the stop token (its template renders its own end)
    again = tuple(ids) + tuple(first.token_ids[:-1]) + (10, 11, 12)
    done = _turn(executor, m, "a", again, first.blocks)
    assert done.cached_tokens == total - 1 and done.reuse == "own"  # the finished cache whole, no snapshot cut
