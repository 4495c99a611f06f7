"""semantic.blas points MLX at an optimized BLAS before MLX loads; harness.device keeps MLX off a wrong GPU.

The BLAS choice is per process (fixed when ``mlx.core`` loads), so each case
runs in a fresh interpreter with its own environment.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import mlx.core as mx
import pytest

from harness import device
from semantic import blas

pytestmark = pytest.mark.compat

linux_only = pytest.mark.skipif(platform.system() != "Linux", reason="the preload is Linux-only")
needs_openblas = pytest.mark.skipif(platform.system() != "Linux" or not blas._candidates(),
                                    reason="no system OpenBLAS here (make venv installs it where it can)")


def _python(code: str, **env) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k != blas.ENV}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**base, **env})


def _describe_after(prelude: str, **env) -> tuple[dict, str]:
    done = _python(prelude + "\nimport json, mlx.core, semantic.blas as b; print(json.dumps(b.describe()))", **env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_importing_semantic_loads_neither_mlx_nor_a_blas():
    done = _python("import sys, semantic, semantic.blas as b\n"
                   "print('mlx.core' in sys.modules, b.choice())")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "None"]


def test_importing_harness_loads_no_mlx_and_probes_no_device():
    done = _python("import sys, harness, harness.device as d\n"
                   "print('mlx.core' in sys.modules, d._probe)")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "None"]


@needs_openblas
def test_enable_before_mlx_makes_mlx_call_the_system_openblas():
    info, err = _describe_after("import semantic.blas as b; b.enable()")
    assert info["blas"] == "openblas" and info["status"] == "loaded"
    assert info["path"] in info["mapped"] and err == ""


@needs_openblas
def test_the_environment_variable_opts_a_library_user_in_and_children_inherit_the_choice():
    info, _ = _describe_after("import semantic", SEMANTIC_BLAS="auto")
    assert info["status"] == "loaded"
    # the harness's children: the parent's enable() leaves the path in the environment
    done = _python("import os, semantic.blas as b; b.enable(); print(os.environ['SEMANTIC_BLAS'])")
    child_env = done.stdout.strip()
    assert child_env.endswith(".so") or ".so." in child_env
    info, _ = _describe_after("import semantic", SEMANTIC_BLAS=child_env)
    assert info["status"] == "loaded" and info["path"] == child_env


@linux_only
def test_enabling_after_mlx_is_too_late_and_says_so_in_one_line():
    info, err = _describe_after("import mlx.core; import semantic.blas as b; b.enable()")
    assert info["status"] == "too-late" and info["blas"] == "bundled-reference"
    assert len(err.strip().splitlines()) == 1 and "imported before" in err


@linux_only
def test_a_library_that_cannot_be_loaded_keeps_the_bundled_blas_with_one_warning_line():
    info, err = _describe_after("import semantic", SEMANTIC_BLAS="/nonexistent/libopenblas.so.0")
    assert info["status"] == "bundled" and info["blas"] == "bundled-reference"
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "/nonexistent/libopenblas.so.0" in lines[0] and "4 GFLOP/s" in lines[0]


@linux_only
def test_off_keeps_the_bundled_blas_without_a_warning():
    info, err = _describe_after("import semantic.blas as b; b.enable()", SEMANTIC_BLAS="off")
    assert info["status"] == "bundled" and err == ""


def test_this_test_process_runs_on_the_fast_path_where_one_is_installed():
    # conftest imports harness first, which enables the BLAS before anything loads MLX
    info = blas.describe()
    if platform.system() == "Linux" and blas._candidates():
        assert info["blas"] == "openblas" and info["status"] == "loaded"


# --- the GPU probe. No GPU here: mlx.core's device functions are replaced to act one out.

@pytest.fixture
def fake_gpu(monkeypatch):
    chosen = []
    monkeypatch.setattr(device, "_probe", None)
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    monkeypatch.setattr(mx, "set_default_device", chosen.append)
    return chosen  # monkeypatch puts the real probe and device functions back afterwards


def test_a_gpu_whose_kernels_agree_with_the_cpu_stays_the_default(fake_gpu, monkeypatch):
    monkeypatch.setattr(device, "_max_kernel_error", lambda mx: 1e-6)
    p = device.ensure_working_device()
    assert (p.device, p.gpu_checked, p.gpu_ok) == ("gpu", True, True) and fake_gpu == []
    assert device.ensure_working_device() is p  # probed once per process


def test_a_gpu_returning_wrong_values_is_replaced_by_the_cpu(fake_gpu, monkeypatch):
    monkeypatch.setattr(device, "_max_kernel_error", lambda mx: 3.2)  # e.g. a kernel returning zeros
    p = device.ensure_working_device()
    assert (p.device, p.gpu_ok) == ("cpu", False) and fake_gpu == [mx.cpu] and "3.2" in p.reason


def test_a_gpu_whose_kernels_cannot_run_is_replaced_by_the_cpu(fake_gpu, monkeypatch):
    def broken(mx):
        raise RuntimeError("MPS is not supported on this device")

    monkeypatch.setattr(device, "_max_kernel_error", broken)
    p = device.ensure_working_device()
    assert p.device == "cpu" and fake_gpu == [mx.cpu] and "MPS is not supported" in p.reason


def test_without_a_gpu_nothing_is_probed():
    device._probe = None
    p = device.ensure_working_device()
    assert (p.device, p.gpu_checked) == ("cpu", False) if mx.default_device() == mx.cpu else p.gpu_checked
