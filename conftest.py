"""Shared pytest fixtures: tiny random-weight models and the real prepared models."""

from __future__ import annotations

import pytest

from tests.tiny_models import tiny_gemma3, tiny_llama

REAL_MODEL_FIXTURES = {"smollm2", "gemma3"}


def pytest_collection_modifyitems(config, items):
    """Mark tests by what they need, so ``-m "not real_model"`` or ``-m benchmark`` select them."""
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        if names & REAL_MODEL_FIXTURES:
            item.add_marker(pytest.mark.real_model)
        if "benchmark" in names:
            item.add_marker(pytest.mark.benchmark)


def pytest_benchmark_update_machine_info(config, machine_info):
    """Record the MLX stack beside pytest-benchmark's own machine info."""
    from harness import environment

    machine_info["mlx_packages"] = environment.packages()
    machine_info["mlx_device"] = environment.machine_info()["mlx_device"]


def pytest_benchmark_update_json(config, benchmarks, output_json):
    """pytest-benchmark has no percentiles: add p95/p99 of each benchmark's raw rounds."""
    import numpy as np

    raw = {b.fullname: b.stats.data for b in benchmarks if getattr(b, "stats", None)}
    for bench in output_json["benchmarks"]:
        data = raw.get(bench["fullname"])
        if data:
            bench["extra_info"]["p95_s"] = float(np.percentile(data, 95))
            bench["extra_info"]["p99_s"] = float(np.percentile(data, 99))


@pytest.fixture
def cache_dir(tmp_path):
    """A fresh, empty directory for cache files."""
    d = tmp_path / "cache"
    d.mkdir()
    return d


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
