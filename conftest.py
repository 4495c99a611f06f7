"""Shared pytest fixtures: tiny random-weight models and the real prepared models."""

from __future__ import annotations

import pytest

from tests.tiny_models import tiny_gemma3, tiny_llama


@pytest.fixture(scope="session")
def llama_tiny():
    return tiny_llama()


@pytest.fixture(scope="session")
def gemma_tiny():
    return tiny_gemma3()


def _real(name: str):
    from harness import models

    if not models.is_prepared(name):
        pytest.fail(f"{name} is not prepared: run `make models` (or python -m harness models prepare {name})")
    return models.load(name)


@pytest.fixture(scope="session")
def smollm2():
    """Real SmolLM2-135M-Instruct (Q4_1 GGUF converted to MLX)."""
    return _real("smollm2-135m")


@pytest.fixture(scope="session")
def gemma3():
    """Real Gemma 3 270M (Q4_K_M GGUF converted to MLX)."""
    return _real("gemma3-270m")
