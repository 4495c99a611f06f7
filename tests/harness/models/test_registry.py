"""Model names resolve the same way everywhere; fingerprints name the exact weights."""

from __future__ import annotations

import json

import pytest

from harness import models


@pytest.fixture
def model_home(tmp_path, monkeypatch):
    monkeypatch.setenv("SEMANTIC_MODELS_DIR", str(tmp_path / "home"))
    monkeypatch.delenv("SEMANTIC_MODEL_SOURCE", raising=False)
    return tmp_path / "home"


def _fake_model_dir(path, payload=b"weights"):
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(payload)
    return path


def test_a_local_model_directory_resolves_to_itself(tmp_path):
    d = _fake_model_dir(tmp_path / "m")
    assert models.resolve(str(d)) == str(d)


def test_a_directory_without_weights_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(models.ModelNotFoundError, match="config.json"):
        models.resolve(str(tmp_path / "empty"))


def test_unknown_names_list_the_known_ones(model_home):
    with pytest.raises(models.ModelNotFoundError, match="smollm2-135m"):
        models.resolve("no-such-model")


def test_hub_mode_gives_the_hugging_face_id_when_nothing_is_prepared(model_home, monkeypatch):
    monkeypatch.setenv("SEMANTIC_MODEL_SOURCE", "hub")
    assert models.resolve("smollm2-135m") == "mlx-community/SmolLM2-135M-Instruct"
    assert models.resolve("gemma3-270m") == "mlx-community/gemma-3-270m-4bit"
    assert models.resolve("mlx-community/Other-Model") == "mlx-community/Other-Model"


def test_a_prepared_model_wins_over_the_hub(model_home, monkeypatch):
    monkeypatch.setenv("SEMANTIC_MODEL_SOURCE", "hub")
    d = _fake_model_dir(models.prepared_dir("smollm2-135m"))
    (d / "prepared.json").write_text(json.dumps({"converter_version": models.CONVERTER_VERSION}))
    assert models.resolve("smollm2-135m") == str(d)


def test_a_prepared_dir_from_an_older_converter_is_not_reused(model_home):
    d = _fake_model_dir(models.prepared_dir("smollm2-135m"))
    (d / "prepared.json").write_text(json.dumps({"converter_version": models.CONVERTER_VERSION - 1}))
    assert not models.is_prepared("smollm2-135m")
    (d / "prepared.json").write_text("{not json")
    assert not models.is_prepared("smollm2-135m")


def test_fingerprint_is_stable_and_changes_with_the_weights(tmp_path):
    d = _fake_model_dir(tmp_path / "m", b"aaaa")
    first = models.fingerprint(d)
    assert first == models.fingerprint(d) and len(first) == 64
    assert (d / ".fingerprint.json").exists()
    (d / "model.safetensors").write_bytes(b"aaab")
    assert models.fingerprint(d) != first


def test_registry_entries_validate_themselves():
    with pytest.raises(ValueError, match="sha256"):
        models.ModelSource("x", "a/b", ("p",), ("f",), "abc")
    with pytest.raises(ValueError, match="one package per GGUF part"):
        models.ModelSource("x", "a/b", ("p", "q"), ("f",), "0" * 64)
    for src in models.REGISTRY.values():
        assert len(src.packages) == len(src.gguf_parts)
