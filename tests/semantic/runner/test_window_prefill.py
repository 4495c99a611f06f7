"""A sliding-window model prefills in the chunks a global-attention model uses, and reuses exactly what
it did when its prefill stopped at every block boundary.

Tiny Gemma (windows of 8 and 10 tokens) in blocks of 4. The cached-token counts below are what the
engine reused when every prefill stopped, and pooled its whole cache, at each block boundary; each
turn continues exactly like a fresh prefill in an engine of its own.
"""

from __future__ import annotations

import pytest
from mlx_lm.models import gemma3_text

from semantic.cache import convert
from tests.cache_helpers import check, make_executor, history, run
from semantic import BatchExecutor, Request
from tests.tiny_models import tiny_gemma3

pytestmark = pytest.mark.compat

STEPS = 3


@pytest.fixture
def counted(monkeypatch):
    """The width of every forward pass, and every whole-cache extraction (a turn's end, or a checkpoint)."""
    seen = {"passes": [], "extracts": 0}
    call, extract = gemma3_text.Model.__call__, convert.extract

    def counting_call(self, inputs, *a, **k):
        seen["passes"].append(inputs.shape[1])
        return call(self, inputs, *a, **k)

    def counting_extract(*a, **k):
        seen["extracts"] += 1
        return extract(*a, **k)

    monkeypatch.setattr(gemma3_text.Model, "__call__", counting_call)
    monkeypatch.setattr(convert, "extract", counting_extract)
    return seen


def _same(got, ref, model):
    """A turn and a fresh prefill of its prompt: the same tokens, both mlx-lm's own generation within its measured noise."""
    assert got.token_ids == ref.token_ids
    check(model, got, what="from the cache")
    check(model, ref, what="fresh prefill")


def _turn(executor, agent, ids, own=None):
    uid = executor.submit(Request(agent, ids, STEPS), own)
    return run(executor)[uid]


def _fresh(model, ids):
    executor = make_executor(model)
    uid = executor.submit(Request("ref", ids, STEPS), share=False)
    return run(executor)[uid]


# window 10: the window's edge starts mid-block, a shared full block or a private partial
@pytest.mark.parametrize("window", [8, 10])
def test_every_turn_type_reuses_what_block_boundary_stops_reused_with_one_extraction_a_turn(counted, window):
    model = tiny_gemma3(window=window)
    executor = make_executor(model)
    system = history(14, seed=21)
    t1 = system + history(16, seed=22)                                   # 30 tokens: the window moved far past 0
    counted["passes"].clear()
    first = _turn(executor, "a", t1)
    # one chunk, then decoding (stops: seven of 4 tokens and one of 2); the last token is never fed
    assert counted["passes"] == [30, 1, 1]
    t2 = t1 + first.token_ids + history(9, seed=23)                       # append: a tool's output
    second = _turn(executor, "a", t2, own=first.blocks)
    first.blocks.release()
    again = _turn(executor, "a", t2, own=second.blocks)                        # regenerate: all but the last token
    branch = t2 + second.token_ids
    second.blocks.release()
    edited = t2[:33] + [45, 46, 47, 48, 49]                               # the last message edited
    edit = _turn(executor, "a", edited, own=again.blocks)
    again.blocks.release()
    back = _turn(executor, "a", branch + [50, 51, 52], own=edit.blocks)        # back to the first branch
    sub = system + history(6, seed=24)                                    # a sub-agent on the shared system prompt
    b = _turn(executor, "b", sub)
    other = history(14, seed=25)                                         # another prompt, still decoding when
    d = executor.submit(Request("d", other + history(12, seed=26), 40))        # a sub-agent on it arrives
    executor.step_once(), executor.step_once()
    c_ids = other + history(7, seed=27)
    c = executor.submit(Request("c", c_ids, STEPS))
    done = run(executor)
    turns = [(first, t1), (second, t2), (again, t2), (edit, edited), (back, branch + [50, 51, 52]), (b, sub),
             (done[c], c_ids)]
    # first, append, regenerate, edit, back to a branch, sub-agent, sub-agent beside a decoding one
    # (append and back to a branch: all but the previous reply's last token, never fed)
    assert [t.cached_tokens for t, _ in turns] == [0, 32, 41, 33, 44, 14, 14]
    assert counted["extracts"] == 8  # one a turn (a checkpoint at every block boundary: 27)
    for got, ids in turns:
        _same(got, _fresh(model, ids), model)


def test_a_prefill_of_several_chunks_pools_every_block_its_window_passes(counted):
    model = tiny_gemma3(window=8)
    base = make_executor(model)
    executor = BatchExecutor(model, base.tokenizer, base.pool, base.spec, stop_tokens=[], prefill_chunk=10)
    long = history(41, seed=31)
    counted["passes"].clear()
    _turn(executor, "a", long).blocks.release()
    assert counted["passes"][:5] == [10, 10, 10, 10, 1]  # stopping at every block: ten passes of 4, one of 1
    # the window at 37 is [29, 37): blocks [28, 32) and [32, 36) passed in the chunk [30, 40)
    got = {n: _turn(executor, f"b{n}", long[:n] + [7, 7, 7]) for n in (9, 13, 23, 30, 37)}
    assert {n: g.cached_tokens for n, g in got.items()} == {9: 9, 13: 13, 23: 23, 30: 30, 37: 37}
    assert counted["extracts"] == 6  # one a turn (checkpoints too: 18)
    for n, g in got.items():
        _same(g, _fresh(model, long[:n] + [7, 7, 7]), model)
