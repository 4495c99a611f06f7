"""What would make a model's load fail is found before room is made for it (no weights are read); a model
loaded again reuses its tokenizer and reads only its weights. Both through mlx-lm's own loaders (compat)."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

from harness.models.tiny import write_tiny_llama
from semantic import compat
from semantic.serve.config import ServeConfig
from semantic.serve.opening import precheck
from semantic.serve.fleet.registry import ModelEntry


pytestmark = pytest.mark.compat


def _check(path, several=True):
    return precheck(ModelEntry("m", str(path)), ServeConfig(model="x", cache_dir="/tmp/unused-cache-root"), several)


def test_a_loadable_directory_passes_and_names_its_cache_directory(tmp_path):
    d = write_tiny_llama(tmp_path / "m")
    assert _check(d).startswith("/tmp/unused-cache-root/") and _check(d, several=False) is None


@pytest.mark.parametrize("damage, said", [
    (lambda d: (d / "config.json").unlink(), "no readable config.json"),
    (lambda d: (d / "config.json").write_text("{oops"), "is not JSON"),
    (lambda d: (d / "config.json").write_text(json.dumps({"hidden_size": 8})), "names no model_type"),
    (lambda d: (d / "config.json").write_text(json.dumps({"model_type": "no_such_arch"})), "not supported"),
    (lambda d: (d / "model.safetensors").unlink(), "no .safetensors weights"),
    (lambda d: _truncate(d / "model.safetensors"), "cut short"),
    (lambda d: (d / "model.safetensors").write_bytes(b"\x10"), "not a readable safetensors"),
])
def test_a_directory_mlx_lm_cannot_load_is_refused_with_the_reason(tmp_path, damage, said):
    d = write_tiny_llama(tmp_path / "m")
    damage(d)
    with pytest.raises(ValueError, match=said):
        _check(d)


def _truncate(file):
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 100])


def test_a_missing_path_is_refused_without_asking_the_hub(tmp_path):
    with pytest.raises(FileNotFoundError, match="no model directory"):
        _check(tmp_path / "gone")


def test_a_model_loaded_again_with_its_tokenizer_reads_only_its_weights_and_answers_the_same(tmp_path):
    d = write_tiny_llama(tmp_path / "m")
    first, tokenizer = compat.load(d)
    again, same = compat.load(d, tokenizer)
    assert same is tokenizer
    ids = mx.array([tokenizer.encode("hello there")])
    assert mx.array_equal(first(ids), again(ids))
