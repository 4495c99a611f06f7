"""harness.noise: the variants a reference's noise is measured on, and the check against it."""

from __future__ import annotations

import pytest
from mlx_lm.models.cache import make_prompt_cache

from harness import noise
from tests.tiny_models import tiny_gemma3, tiny_llama, tiny_qwen3_next

IDS = [(7 * i + 3) % 200 + 1 for i in range(40)]


class _Counted:
    """A model that counts its forward passes."""

    def __init__(self, model):
        self.model, self.passes = model, 0

    def __call__(self, *args, **kwargs):
        self.passes += 1
        return self.model(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3, tiny_qwen3_next], ids=["llama", "gemma3-window-8", "qwen3_next"])
def test_a_teacher_forced_prefill_scores_the_references_own_tokens_within_float_noise(make):
    model = make()
    ref = noise._greedy_chunked(model, IDS, 12, lambda: make_prompt_cache(model), len(IDS))
    tokens = [t for t, _ in ref]
    forced = noise._greedy_forced(model, IDS, tokens, lambda: make_prompt_cache(model), 5)
    assert [t for t, _ in forced] == tokens
    # a few float32 ulps of a logprob, over a wrapped sliding window and a recurrent state alike
    assert noise._spread(ref, forced) < 1e-4
    # the same tokens scored after another prompt are not the same logprobs: the comparison can fail
    other = noise._greedy_forced(model, IDS[::-1], tokens, lambda: make_prompt_cache(model), 5)
    assert noise._spread(ref, other) > 1e-2


def test_the_real_models_variant_takes_a_few_passes_not_one_a_token():
    model, n = tiny_llama(), 24
    (kind,) = {name for name, sizes in noise.few_passes(IDS).items() if sizes}
    assert kind == "forced"
    (chunk,) = noise.few_passes(IDS)["forced"]
    tokens = noise.reference(model, IDS, n, lambda: make_prompt_cache(model), **noise.few_passes(IDS)).tokens
    counted = _Counted(model)
    noise._greedy_forced(counted, IDS, tokens, lambda: make_prompt_cache(model), chunk)
    # the prompt in chunks of a quarter of it, then the n scored positions in chunks of the same size
    assert counted.passes == -(-(len(IDS) - 1) // chunk) + -(-n // chunk) < n


def test_a_logprob_beyond_the_measured_tolerance_fails_the_check():
    model = tiny_llama()
    ref = noise.reference(model, IDS, 8, lambda: make_prompt_cache(model))
    assert ref.check(ref.tokens, ref.logprobs) == 8
    moved = list(ref.logprobs)
    moved[3] += 2 * ref.tolerance
    with pytest.raises(AssertionError, match="step 3 logprob"):
        ref.check(ref.tokens, moved)


def test_a_quantized_caches_probes_are_measured_only_for_a_turn_the_variants_noise_alone_would_fail():
    model = tiny_llama()
    quantized = lambda: [c.to_quantized(group_size=32, bits=8) for c in make_prompt_cache(model)]  # noqa: E731
    lazy = noise.reference(model, IDS, 8, quantized, probe="lazy")
    assert lazy.pending is not None and "probes" not in lazy.spreads
    assert "probes" in noise.reference(model, IDS, 8, quantized).spreads  # eager, as before
    measured = []
    wide = 10 * lazy.noise + 1e-3  # the probes' noise, as if they had hit a rounding step elsewhere
    counting = noise.Reference(lazy.tokens, lazy.logprobs, lazy.margins, lazy.noise, lazy.spreads,
                               pending=lambda: measured.append(wide) or wide)
    assert counting.check(lazy.tokens, lazy.logprobs) == 8
    assert measured == []  # within the variants' own tolerance: the probes could only have raised it
    moved = list(lazy.logprobs)
    moved[3] += 2 * lazy.tolerance  # beyond the variants' tolerance, within the probes'
    assert counting.check(lazy.tokens, moved) == 8
    assert measured == [wide]
    moved[3] = lazy.logprobs[3] + 2 * noise.tolerance(wide)  # beyond both: fails, with the probes measured
    with pytest.raises(AssertionError, match=rf"step 3 logprob .*\(noise {wide:.2e}\)"):
        counting.check(lazy.tokens, moved)
