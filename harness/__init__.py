"""The experiment harness: configs -> runner -> engine -> results.

Importing it points MLX at an optimized BLAS on Linux (``semantic.blas``): the
library is chosen when ``mlx.core`` loads, so this must run before anything
imports MLX. Subprocesses the harness starts inherit the choice through
``SEMANTIC_BLAS``. Whether the GPU computes correctly is checked where a run
starts (``harness.device``), not on import.
"""

from semantic import blas as _blas

_blas.enable()
