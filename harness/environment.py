"""What a result was measured on: machine, packages, git state."""

from __future__ import annotations

import importlib.metadata as md
import os
import platform
import subprocess
import time
from pathlib import Path

import mlx.core as mx

from harness import device
from semantic import blas

PACKAGES = ("mlx", "mlx-metal", "mlx-cpu", "mlx-lm", "numpy", "scipy", "pandas", "safetensors", "semantic-kv")


def machine_info() -> dict:
    probe = device.describe()  # first: a GPU that computes wrongly has left the default device before it is recorded
    info = {
        "system": platform.system(),
        "release": platform.release(),
        "machine": platform.machine(),
        "processor": platform.processor() or _cpu_name(),
        "cpu_count": os.cpu_count(),
        "ram_gb": _ram_gb(),
        "python": platform.python_version(),
        "mlx_device": str(mx.default_device()),
        "device_probe": probe,
        "blas": blas.describe(),
        "matmul_gflops_f32": matmul_gflops(),
    }
    device_info = getattr(mx, "device_info", None)  # absent before mlx 0.31
    if device_info is not None:
        try:
            info["mlx_device_info"] = {k: (v if isinstance(v, (int, float, str)) else str(v)) for k, v in device_info().items()}
        except RuntimeError:
            pass
    return info


_gflops: float | None = None


def matmul_gflops(n: int = 512, reps: int = 5) -> float:
    """GFLOP/s of an ``n``x``n`` float32 ``mx.matmul`` on the default device (best of ``reps``).

    A slow run explains itself with it: about 4 on the bundled reference BLAS
    of the Linux wheel, 100+ with OpenBLAS on two cores. Measured once per process.
    """
    global _gflops
    if _gflops is None:
        a, b = mx.random.normal((n, n)), mx.random.normal((n, n))
        mx.eval(a, b, a @ b)
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            mx.eval(a @ b)
            best = min(best, time.perf_counter() - t)
        _gflops = round(2 * n**3 / best / 1e9, 1)
    return _gflops


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _ram_gb() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def packages(names=PACKAGES, missing: bool = False) -> dict[str, str | None]:
    """The installed version of each of ``names``; one not installed is left out (``missing``: None)."""
    out = {}
    for name in names:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            if missing:
                out[name] = None
    return out


def git_info(root: Path | None = None) -> dict:
    root = root or Path(__file__).resolve().parents[1]

    def git(*args: str) -> str | None:
        try:
            return subprocess.run(
                ["git", *args], cwd=root, capture_output=True, text=True, check=True, timeout=10
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(status) if status is not None else None}
