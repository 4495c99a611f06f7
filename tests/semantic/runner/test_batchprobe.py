"""Models whose own code cannot decode a batch exactly run one sequence at a time, and stay exact."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from harness.models import zoo
from semantic import BlockPool, BatchExecutor, ModelCacheSpec, Request
from semantic.runner.batchprobe import batch_problem
from tests.tiny_models import byte_tokenizer, tiny_llama


def test_a_model_that_batches_exactly_passes_the_probe():
    m = tiny_llama()
    assert batch_problem(m, ModelCacheSpec.from_model(m)) is None


@pytest.mark.parametrize("model_type", ["gpt_bigcode", "gemma2"])
def test_a_model_whose_code_fails_or_drifts_in_a_batch_decodes_one_sequence_at_a_time_exactly(model_type):
    if model_type not in zoo.model_types():
        pytest.skip(f"this mlx-lm has no {model_type}")
    m, _ = zoo.build(model_type)
    spec = ModelCacheSpec.from_model(m)
    executor = BatchExecutor(m, byte_tokenizer(), BlockPool(spec, 200, block_tokens=16), spec, stop_tokens=[])
    assert executor.batch_off is not None
    rng = np.random.default_rng(0)
    for i, n in enumerate((9, 33, 70)):
        executor.submit(Request(f"r{i}", [int(x) for x in rng.integers(1, 250, n)], 5), None)
    done = list(executor.step())
    assert len(done) == 3
    for d in done:
        ref = [int(t) for t, _ in generate_step(mx.array(list(d.request.ids)), m, max_tokens=len(d.token_ids))]
        assert d.token_ids == ref


def test_the_probes_answer_is_kept_beside_the_caches_and_asked_again_for_other_versions(tmp_path, monkeypatch):
    from semantic.runner import batchprobe

    m = tiny_llama()
    spec = ModelCacheSpec.from_model(m)
    asked = []
    monkeypatch.setattr(batchprobe, "batch_problem", lambda model, s: asked.append(1) or "drifts")
    assert batchprobe.remembered(m, spec, tmp_path) == "drifts"
    assert batchprobe.remembered(m, spec, tmp_path) == "drifts" and len(asked) == 1  # a reload asks nothing
    monkeypatch.setattr(batchprobe, "_versions", lambda: {"mlx": "0", "mlx_lm": "0"})
    assert batchprobe.remembered(m, spec, tmp_path) == "drifts" and len(asked) == 2  # another mlx-lm: asked again
    (tmp_path / batchprobe.MEMO).write_text("{not json")
    assert batchprobe.remembered(m, spec, tmp_path) == "drifts" and len(asked) == 3  # damaged: asked again
    assert batchprobe.remembered(m, spec, None) == "drifts" and len(asked) == 4       # nowhere to keep it


def test_each_questions_answer_is_kept_beside_the_other_in_one_memo(tmp_path, monkeypatch):
    from semantic.runner import batchprobe

    m = tiny_llama()
    spec = ModelCacheSpec.from_model(m)
    asked = []

    def replay_problem(model, s):
        asked.append(1)
        return "ignores lengths"

    assert batchprobe.remembered(m, spec, tmp_path) is None
    assert batchprobe.remembered(m, spec, tmp_path, replay_problem) == "ignores lengths"
    assert batchprobe.remembered(m, spec, tmp_path, replay_problem) == "ignores lengths" and len(asked) == 1
    monkeypatch.setattr(batchprobe, "batch_problem", lambda model, s: asked.append(2) or "drifts")
    assert batchprobe.remembered(m, spec, tmp_path) is None and asked == [1]  # the first answer is still there
