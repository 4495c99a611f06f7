"""The experiment harness: configs -> runner -> engine -> results.

Importing it first points MLX at an optimized BLAS on Linux (``semantic.blas``:
it must happen before ``mlx.core`` is imported) and, where a GPU is present,
checks that it computes correctly before using it (``harness.device``).
Subprocesses the harness starts inherit the BLAS choice through ``SEMANTIC_BLAS``.
"""

from semantic import blas as _blas

_blas.enable()

from harness import device as _device  # noqa: E402  (after the BLAS: this imports mlx)

_device.ensure_working_device()
