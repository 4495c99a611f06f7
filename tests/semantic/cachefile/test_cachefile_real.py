"""EXP-005 (seed 002's test_cache_roundtrip_e2e) with real weights: generate,
save, load in a fresh process, continue, and match a fresh prefill.

This process generates from history S and saves the cache file; a new
Python process (tests/persistence_e2e_child.py) loads the model and the
file, and runs in one batch the cached continuation with T and a fresh
prefill of S + generated + T, 16 greedy steps each. Its loaded cache must be
bit-identical to the one saved (equal digests), and the two sequences must
give the same tokens, both mlx-lm's own generate_step of that history (run
here) within the spread its chunked and batched variants show on this device.

Tolerance: both models compute in float32 here (see test_executor_real.py);
the two sides differ only in summation order (one long prefill against the
cached history plus a short one, batch padding), which moves a logprob by
about 1e-5 on CPU, measured beside the reference
(``tests.cache_helpers.reference``); a wrong, missing or shifted token moves
logprobs by whole nats. Prefills are slow on a CPU (about 0.1 s per token),
so S is short for SmolLM2 and just past Gemma's 512-token window.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import harness
from semantic import BlockPool, BatchExecutor, ModelCacheSpec, Request, cachefile
from tests.cache_helpers import reference
from tests.persistence_e2e_child import digest

# Not `compat`: under mlx-lm 0.30.4 the tiny models' tests take the same paths through its API (cache classes,
# generate_step, files); these add the real weights' numerics, which do not depend on mlx-lm's version.
pytestmark = [pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[3]
HISTORY = (Path(harness.__file__).parent / "data" / "history.txt").read_text()
STEPS = 16
CASES = {  # fixture: (registry name, history tokens, generated before saving)
    "smollm2": ("smollm2-135m", 48, 8),
    "gemma3": ("gemma3-270m", 530, 4),  # 534 > 512: every sliding layer's ring has wrapped
}


@pytest.mark.parametrize("which", sorted(CASES))
def test_a_cache_saved_here_and_loaded_in_a_fresh_process_continues_like_a_fresh_prefill(request, which, tmp_path):
    loaded = request.getfixturevalue(which)
    name, n_history, n_generated = CASES[which]
    spec = ModelCacheSpec.from_model(loaded.model)
    executor = BatchExecutor(loaded.model, loaded.tokenizer, BlockPool(spec, 64), spec, stop_tokens=[])
    S = loaded.tokenizer.encode(HISTORY)[:n_history]
    assert len(S) == n_history, "harness/data/history.txt is too short for this case"
    uid = executor.submit(Request("agent", S, n_generated), share=False)
    first = {c.uid: c for c in executor.step()}[uid]
    if which == "gemma3":
        window = spec.layers[0].window
        assert first.blocks.total_tokens > window == 512
    path = tmp_path / "agent.safetensors"
    cachefile.save(path, first.blocks, model_fingerprint=loaded.fingerprint, agent_id="agent")

    T = loaded.tokenizer.encode(" And then", add_special_tokens=False)
    child = subprocess.run(
        [sys.executable, "-m", "tests.persistence_e2e_child", name, str(path), ",".join(map(str, T)), str(STEPS)],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    out = json.loads(child.stdout.strip().splitlines()[-1])
    assert out["digest"] == digest(first.blocks), "the fresh process loaded a different cache"
    cached, fresh = out["cached"], out["fresh"]
    held = n_history + n_generated - 1  # the last generated token is never fed
    assert (cached["prompt_tokens"], cached["cached_tokens"]) == (len(T), held)
    assert fresh["prompt_tokens"] == held + len(T)
    assert len(cached["tokens"]) == STEPS and cached["tokens"] == fresh["tokens"]
    print(f"{which}: loaded in {out['load_ms']:.1f} ms")
    ref = reference(loaded.model, list(first.blocks.token_ids) + T, STEPS, spec=spec, real=True)
    ref.check(cached["tokens"], cached["logprobs"], "cached, in the fresh process")
    ref.check(fresh["tokens"], fresh["logprobs"], "fresh prefill, in the fresh process")
