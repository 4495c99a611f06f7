"""Several models' executors in one process share OpenBLAS: while two step at once, each calls it single-threaded.

OpenBLAS's threaded GEMM holds one process-wide lock, so a second model's step
waits for the first one's whole matmul (measured on 2 cores: a 64-token
matmul 1.0 ms alone, 21 ms beside another thread's 512-token matmuls, 2.7 ms
when both call it with one thread). Two processes never share that lock,
which is what a server of several models is measured against::

    executors stepping OpenBLAS threads per call
    1                  all of them (as a server of one model)
    2 or more          1 each: the calls run side by side on the cores

Without OpenBLAS in the process (macOS, the bundled reference BLAS) this does nothing.
"""

from __future__ import annotations

import ctypes
import threading
from contextlib import contextmanager


class BlasShare:
    """Counts the executors inside a step and sets OpenBLAS's threads when that count crosses 1."""

    def __init__(self, setter=None, getter=None):
        self._lock = threading.Lock()
        self._active = 0
        self._given = (setter, getter) if setter is not None else None
        self._set = self._full = None
        self._found = False

    def _find(self) -> None:
        """Looked up at the first step, not at import: ``semantic.blas`` may load OpenBLAS after this module."""
        self._found = True
        self._set, get = self._given or _openblas()
        self._full = get() if get is not None else None

    @contextmanager
    def stepping(self):
        self._enter()
        try:
            yield
        finally:
            self._leave()

    def _enter(self) -> None:
        with self._lock:
            if not self._found:
                self._find()
            self._active += 1
            if self._active == 2 and self._set is not None:
                self._set(1)

    def _leave(self) -> None:
        with self._lock:
            self._active -= 1
            if self._active == 1 and self._set is not None:
                self._set(self._full)


def _openblas():
    """OpenBLAS's thread setter and getter in this process's global scope (``semantic.blas`` loads it
    there), or (None, None)."""
    try:
        scope = ctypes.CDLL(None)
        setter, getter = scope.openblas_set_num_threads, scope.openblas_get_num_threads
    except (OSError, AttributeError):
        return None, None
    setter.argtypes, getter.restype = [ctypes.c_int], ctypes.c_int
    return setter, getter


SHARE = BlasShare()  # one per process: every executor's worker steps through it
