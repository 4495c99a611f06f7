"""The OpenBLAS kernels and thread counts ``make test-numerics`` runs the numerically sensitive tests under.

OpenBLAS picks its kernels by CPU; ``OPENBLAS_CORETYPE`` forces a core type's, and the thread count
changes how a product is split. The tests' tolerances are measured where they run (``harness.noise``),
so they must hold under any of them. A core type whose instructions this CPU lacks dies with "Illegal
instruction" (SkylakeX's AVX-512 on a CPU without it): each is first tried on a small matmul in a
child process, and one that dies, or that is the kernels OpenBLAS picks here anyway (``make test``
runs those), is skipped with a NOTE on stderr.

``python -m harness.blaskernels`` prints one configuration a line, its variables joined by commas.
"""

from __future__ import annotations

import os
import subprocess
import sys

CORETYPES = ("Haswell", "Sandybridge", "SkylakeX", "Zen")
PROBE = "import harness, mlx.core as mx; mx.eval(mx.ones((64, 64)) @ mx.ones((64, 64)))"
CORENAME = """
import ctypes, harness, semantic.blas as b
lib = ctypes.CDLL(b.choice().path)
lib.openblas_get_corename.restype = ctypes.c_char_p
print(lib.openblas_get_corename().decode())
"""


def _run(env: dict, code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=120)


def corename(env: dict | None = None) -> str | None:
    """The core type OpenBLAS computes with under ``env`` (None: not OpenBLAS)."""
    out = _run({"OPENBLAS_NUM_THREADS": "1", **(env or {})}, CORENAME)
    return out.stdout.strip() or None if out.returncode == 0 else None


def configs() -> list[dict]:
    """The configurations to run here: each core type that runs and differs from the default, the first of
    them on 2 threads and the others on 1 (make test runs the default kernels on 1), or the default kernels
    on 2 threads where no other core type runs: every kernel and both thread counts, each suite run once."""
    default = corename()
    out = []
    for core in CORETYPES:
        env = {"OPENBLAS_CORETYPE": core, "OPENBLAS_NUM_THREADS": "2" if not out else "1"}
        probe = _run({**env, "OPENBLAS_NUM_THREADS": "1"}, PROBE)
        if probe.returncode != 0:
            why = "Illegal instruction" if probe.returncode == -4 else f"exit {probe.returncode}"
            print(f"NOTE: OPENBLAS_CORETYPE={core} does not run on this CPU ({why}): skipped", file=sys.stderr)
        elif default is not None and corename({**env, "OPENBLAS_NUM_THREADS": "1"}) == default:
            print(f"NOTE: OPENBLAS_CORETYPE={core} is this CPU's default kernels (make test runs them): skipped",
                  file=sys.stderr)
        else:
            out.append(env)
    return out or [{"OPENBLAS_NUM_THREADS": "2"}]


if __name__ == "__main__":
    for env in configs():
        print(",".join(f"{k}={v}" for k, v in env.items()))
