"""What the recurrent kind answers for speculation (``semantic.decode.replay``): keep a batch's state, limit
a pass to each row's real inputs, put chosen rows back."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from harness import noise
from semantic import ModelCacheSpec, compat, kinds
from semantic.decode import replay
from tests.tiny_models import tiny_lfm2, tiny_qwen3_next

pytestmark = pytest.mark.compat
RECURRENT = kinds.KINDS[kinds.RECURRENT]
PROMPTS = ([1, 2, 3, 4, 5], [9, 8, 7, 6, 5, 4, 3, 2])


@pytest.fixture(scope="module", params=["lfm2", "qwen3_next"])
def model(request):
    return {"lfm2": tiny_lfm2, "qwen3_next": tiny_qwen3_next}[request.param]()


def _batch(model) -> list:
    """Two rows of different lengths, prefilled, as one batch cache per layer."""
    spec = ModelCacheSpec.from_model(model)
    rows = []
    for prompt in PROMPTS:
        c = spec.make_cache()
        model(mx.array([prompt]), cache=c)
        rows.append(c)
    return kinds.merge(rows)


def _states(batch) -> list[np.ndarray]:
    """Every recurrent array of the batch, all rows, in layer order."""
    return [np.array(a) for c in replay.replaying(batch) for a in compat.read_arrays(c)]


def test_a_kept_state_stays_as_it_was_and_is_put_back_for_the_chosen_rows_only(model):
    batch = _batch(model)
    before = _states(batch)
    caches = replay.replaying(batch)
    assert caches and all(kinds.for_cache(c) is RECURRENT for c in caches)
    kept = [RECURRENT.keep(c) for c in caches]
    model(mx.array([[11, 12], [11, 12]]), cache=batch)
    moved = _states(batch)
    assert all(not np.array_equal(m[r], b[r]) for m, b in zip(moved, before) for r in (0, 1))
    assert all(np.array_equal(np.array(a), b) for a, b in zip((a for k in kept for a in k), before))  # untouched
    for c, k in zip(caches, kept):
        RECURRENT.put_back(c, k, [True, False])
    after = _states(batch)
    assert all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], m[1]) for a, b, m in zip(after, before, moved))


def test_a_limited_row_moves_by_its_real_inputs_only(model):
    batch, plain = _batch(model), _batch(model)
    before = _states(batch)
    replay.begin(batch, [0, 1])  # row 0 feeds nothing real, row 1 one token of its two
    model(mx.array([[11, 12], [11, 12]]), cache=batch)
    replay.end(batch)
    assert all(c.lengths is None for c in replay.replaying(batch))  # the next pass is not limited
    model(mx.array([[11], [11]]), cache=plain)  # row 1's one real token, fed alone
    limited, fed = _states(batch), _states(plain)
    assert all(np.array_equal(a[0], b[0]) for a, b in zip(limited, before))
    # row 1 alone (a batch of one: other matmul shapes) is another correct computation of its state
    solo = ModelCacheSpec.from_model(model).make_cache()
    model(mx.array([PROMPTS[1]]), cache=solo)
    model(mx.array([[11]]), cache=solo)
    alone = [np.array(a) for c in replay.replaying(solo) for a in compat.read_arrays(c)]
    measured = noise.spread([a[0] for a in alone], [f[1] for f in fed])
    noise.assert_within([a[1] for a in limited], [f[1] for f in fed], measured, "limited row")
