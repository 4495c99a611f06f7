"""Shared pytest fixtures: tiny random-weight models and the real prepared models."""

from __future__ import annotations

import harness  # noqa: F401  first: points MLX at an optimized BLAS before mlx.core loads (semantic.blas)
import pytest
from hypothesis import HealthCheck, settings

# a busy machine makes examples slower, never a test red: no per-example deadline, no "too slow" check
settings.register_profile("suite", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("suite")

from tests.tiny_models import tiny_gemma3, tiny_llama

REAL_MODEL_FIXTURES = {"smollm2", "smollm2_dir", "gemma3", "real_variant"}


def pytest_configure(config):
    """The tests compute on MLX's default device: a GPU that computes wrongly leaves it before any test runs."""
    from harness import device

    device.ensure_working_device()


def pytest_report_header(config):
    """Say which BLAS and device MLX runs on, so a slow run explains itself."""
    from harness import environment

    info = environment.machine_info()
    return (f"mlx: {info['mlx_device']} (probe: {info['device_probe']['reason']}), "
            f"BLAS {info['blas']['blas']} ({info['blas']['status']}), "
            f"f32 matmul {info['matmul_gflops_f32']} GFLOP/s")


def pytest_collection_modifyitems(config, items):
    """Mark tests by what they need, so ``-m "not real_model"`` or ``-m benchmark`` select them; then put the
    files that use the real models first."""
    real = set()
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        if names & REAL_MODEL_FIXTURES:
            item.add_marker(pytest.mark.real_model)
            real.add(item.path)
        if "benchmark" in names:
            item.add_marker(pytest.mark.benchmark)
    # xdist hands out whole files in this order: the longest ones first, so that no long file is left
    # for the end while the other workers idle (a stable sort: each file's tests keep their order)
    items.sort(key=lambda item: item.path not in real)


def pytest_benchmark_update_machine_info(config, machine_info):
    """Record the MLX stack beside pytest-benchmark's own machine info."""
    from harness import environment

    info = environment.machine_info()
    machine_info["mlx_packages"] = environment.packages()
    for key in ("mlx_device", "device_probe", "blas", "matmul_gflops_f32"):  # what the timings ran on
        machine_info[key] = info[key]


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


def _real(name: str, variant: str | None = None):
    from harness import models

    variant = models.default_variant(variant)
    if not models.variant_prepared(name, variant):
        pytest.fail(f"{name} ({variant}) is not prepared: run `make models` "
                    f"(or python -m harness models prepare {name} --variant {variant})")
    return models.load(name, variant)


@pytest.fixture(scope="session")
def smollm2():
    """Real SmolLM2-135M-Instruct (Q4_1 GGUF converted to MLX), in this device's variant (f32 on a CPU)."""
    return _real("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_dir():
    """The directory of real SmolLM2 in this device's variant, for a server to load."""
    from harness import models

    variant = models.default_variant(None)
    if not models.variant_prepared("smollm2-135m", variant):
        pytest.fail(f"smollm2-135m ({variant}) is not prepared: run `make models`")
    return models.prepared_dir("smollm2-135m", variant)


@pytest.fixture(scope="session")
def gemma3():
    """Real Gemma 3 270M (Q4_K_M GGUF converted to MLX), in this device's variant (f32 on a CPU)."""
    return _real("gemma3-270m")


@pytest.fixture(scope="session")
def real_variant():
    """``real_variant(name, variant)``: a real model in a given compute variant, loaded once per session."""
    loaded = {}

    def get(name: str, variant: str):
        if (name, variant) not in loaded:
            loaded[name, variant] = _real(name, variant)
        return loaded[name, variant]

    return get
