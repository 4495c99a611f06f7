"""The converted GGUF models load through plain mlx_lm.load and match llama.cpp.

Reference tokens come from llama.cpp run on the same GGUF files with greedy
decoding; the prompt is "The capital of France is". Both compute
variants must give them: the exact quantized conversion and its float32
dequantization (``harness.models``), which CPU runs use.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.cache import make_prompt_cache

from harness import baseline, models

pytestmark = [
    pytest.mark.integration,
    pytest.mark.compat,
    # these pin our GGUF conversion; hub weights are mlx-community's own quantization
    pytest.mark.skipif(
        models.hub_mode() and not all(map(models.gguf_prepared, models.REGISTRY)),
        reason="SEMANTIC_MODEL_SOURCE=hub: mlx-community weights, not the GGUF conversion",
    ),
]

PROMPT = "The capital of France is"
NAMES = {"smollm2": "smollm2-135m", "gemma3": "gemma3-270m"}
VARIANTS = pytest.mark.parametrize("variant", models.VARIANTS)
LLAMA_CPP = {
    "smollm2": ([504, 3575, 282, 4649, 314], [7042, 30, 198, 198]),
    "gemma3": ([2, 818, 5279, 529, 7001, 563], [506, 5279, 529, 506, 2891, 529, 7001, 236761]),
}


def _greedy(model, prompt, n):
    argmax = lambda x: mx.argmax(x, axis=-1)  # noqa: E731
    return [int(t) for (t, _), _ in zip(generate_step(mx.array(prompt), model, sampler=argmax), range(n))]


@VARIANTS
@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_tokenizer_and_greedy_decoding_match_llama_cpp(real_variant, which, variant):
    loaded = real_variant(NAMES[which], variant)
    prompt_ids, expected = LLAMA_CPP[which]
    assert loaded.tokenizer.encode(PROMPT) == prompt_ids
    assert _greedy(loaded.model, prompt_ids, len(expected)) == expected


@VARIANTS
@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_batch_generator_gives_llama_cpp_tokens_beside_another_sequence(real_variant, which, variant):
    loaded = real_variant(NAMES[which], variant)
    prompt_ids, expected = LLAMA_CPP[which]
    other = loaded.tokenizer.encode("Machine learning is a field of study that")
    gen = baseline.make_batch_generator(loaded.model, max_tokens=len(expected), stop_tokens=[])
    uid, _ = baseline.insert(gen, [prompt_ids, other], [None, None], [len(expected), 3])
    got = []
    while responses := baseline.next_responses(gen):
        got += [r.token for r in responses if r.uid == uid]
    assert got == expected


def test_smollm2_keeps_its_4_and_8_bit_quantization(real_variant):
    model = real_variant("smollm2-135m", "quantized").model
    layer = model.model.layers[0]
    assert (layer.self_attn.q_proj.bits, layer.self_attn.q_proj.group_size) == (4, 32)
    assert (layer.mlp.down_proj.bits, layer.mlp.down_proj.group_size) == (4, 32)
    assert model.model.embed_tokens.bits == 8  # Q8_0 token embedding, tied output
    assert model.args.rope_traditional and model.args.tie_word_embeddings
    assert [type(c) for c in make_prompt_cache(model)] == [mlx_cache.KVCache] * 30


def test_gemma3_layout_matches_llama_cpps_reading(real_variant):
    model = real_variant("gemma3-270m", "quantized").model
    assert model.args.model_type == "gemma3_text" and model.tie_word_embeddings
    assert model.model.embed_tokens.bits == 8
    kinds = [type(c).__name__ for c in make_prompt_cache(model)]
    assert kinds == (["RotatingKVCache"] * 5 + ["KVCache"]) * 3
    assert {c.max_size for c in make_prompt_cache(model) if isinstance(c, mlx_cache.RotatingKVCache)} == {512}
    # Gemma norms are stored as (1 + w) in GGUF; mlx-lm adds the 1 itself.
    assert float(model.model.layers[0].pre_feedforward_layernorm.weight.min()) >= -1.0


def test_the_f32_variant_is_the_exact_dequantization_with_tied_embeddings(real_variant):
    import mlx.nn as nn

    for name in NAMES.values():
        q, f = real_variant(name, "quantized").model, real_variant(name, "f32").model
        qe, fe = q.model.embed_tokens, f.model.embed_tokens
        assert isinstance(fe, nn.Embedding) and fe.weight.dtype == mx.float32
        exact = mx.dequantize(qe.weight, qe.scales.astype(mx.float32), qe.biases.astype(mx.float32),
                              group_size=qe.group_size, bits=qe.bits)
        assert mx.array_equal(fe.weight, exact)
        assert "lm_head" not in dict(f.parameters())  # still tied: the output reuses the embedding
        assert not any(isinstance(m, nn.QuantizedLinear) for _, m in f.named_modules())
        manifest = json.loads((models.prepared_dir(name, "f32") / "prepared.json").read_text())
        assert manifest["source_fingerprint"] == real_variant(name, "quantized").fingerprint
        assert real_variant(name, "f32").fingerprint != real_variant(name, "quantized").fingerprint


def test_prepared_directories_are_complete_and_fingerprinted(smollm2, gemma3):
    for loaded, name in ((smollm2, "smollm2-135m"), (gemma3, "gemma3-270m")):
        d = Path(loaded.path)
        assert d == models.prepared_dir(name, loaded.variant)
        for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "prepared.json"):
            assert (d / f).is_file(), f
        manifest = json.loads((models.prepared_dir(name) / "prepared.json").read_text())
        assert manifest["gguf_sha256"] == models.REGISTRY[name].gguf_sha256
        assert loaded.fingerprint == models.fingerprint(d) and len(loaded.fingerprint) == 64
    assert smollm2.fingerprint != gemma3.fingerprint


def test_chat_templates_render_each_models_turn_format(smollm2, gemma3):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    smol = smollm2.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert smol.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    gem = gemma3.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert gem == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert {1, 106} <= set(gemma3.tokenizer.eos_token_ids)  # <eos>, <end_of_turn>


def test_plain_mlx_lm_load_works_in_a_fresh_process(smollm2):
    code = (
        "import mlx_lm, mlx.core as mx, sys\n"
        f"m, t = mlx_lm.load({smollm2.path!r})\n"
        "out = mlx_lm.generate(m, t, prompt=t.encode('The capital of France is'), max_tokens=2)\n"
        "print(repr(out))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Paris" in done.stdout
