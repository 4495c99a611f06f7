"""Point MLX at an optimized BLAS on Linux, before MLX is first imported.

The Linux ``mlx[cpu]`` wheel links the netlib *reference* BLAS it bundles
(``mlx_cpu.libs/libblas-*.so``): a float32 ``mx.matmul`` runs at about
4 GFLOP/s on a 2-core x86 machine. ``libmlx.so`` binds its ``cblas_*`` and
LAPACK symbols when Python loads it, searching the global symbol scope first,
so a system OpenBLAS loaded into that scope beforehand (``RTLD_GLOBAL``) is
what MLX calls: about 100-150 GFLOP/s on the same machine. Once ``mlx.core``
is imported it is too late for this process.

On macOS this does nothing: MLX uses Accelerate and Metal there.

Opt in, before anything imports ``mlx``::

    import semantic.blas; semantic.blas.enable()   # or SEMANTIC_BLAS=auto in the environment

``python -m harness``, the test suite and ``semantic serve`` do it for you.
``SEMANTIC_BLAS`` chooses: ``auto`` (find OpenBLAS), ``off`` (keep the
bundled BLAS), or the path of a shared library exporting ``cblas_sgemm``.

This module imports nothing from MLX, so importing it never loads MLX.
"""

from __future__ import annotations

import ctypes
import logging
import ctypes.util
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)
ENV = "SEMANTIC_BLAS"
INSTALL_HINT = (
    "install OpenBLAS (Debian/Ubuntu: apt-get install libopenblas0-pthread; "
    "Fedora: dnf install openblas) or set SEMANTIC_BLAS=/path/to/libopenblas.so"
)
# Where distributions put the threaded OpenBLAS; find_library covers the ldconfig cache.
_KNOWN = (
    "/usr/lib/{arch}-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/{arch}-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib64/libopenblasp.so.0",
    "/usr/lib/libopenblas.so.0",
)


@dataclass(frozen=True, slots=True)
class BlasChoice:
    """What :func:`enable` did in this process.

    ``status`` is one of ``loaded`` (the library is in the global scope before
    MLX), ``too-late`` (MLX was imported first: it keeps the bundled BLAS),
    ``bundled`` (none found, or ``SEMANTIC_BLAS=off``), ``not-linux``.
    """

    status: str
    path: str | None = None
    reason: str = ""

    def __post_init__(self):
        if self.status not in ("loaded", "too-late", "bundled", "not-linux"):
            raise ValueError(f"unknown BLAS status {self.status!r}")


_choice: BlasChoice | None = None


def enable(*, warn: bool = True) -> BlasChoice:
    """Load an optimized BLAS into the global symbol scope, once per process.

    Args:
        warn: log one warning line (logger ``semantic.blas``) when none can be used.

    Returns:
        The :class:`BlasChoice`; calling again returns the first one.
    """
    global _choice
    if _choice is not None:
        return _choice
    _choice = _choose()
    # Subprocesses we start (harness children, test helpers) inherit the choice.
    os.environ.setdefault(ENV, _choice.path if _choice.status == "loaded" else "off")
    if warn and _choice.status in ("bundled", "too-late") and _choice.reason:
        log.warning("semantic.blas: %s", _choice.reason)  # one line on stderr, logging configured or not
    return _choice


def enable_from_env() -> BlasChoice | None:
    """:func:`enable` when ``SEMANTIC_BLAS`` is set to anything but ``off`` (library opt-in)."""
    value = os.environ.get(ENV, "")
    if not value or value == "off":
        return None
    return enable()


def choice() -> BlasChoice | None:
    """What :func:`enable` chose in this process, or ``None`` if it was never called."""
    return _choice


def _choose() -> BlasChoice:
    if platform.system() != "Linux":
        return BlasChoice("not-linux", reason="MLX uses Accelerate and Metal here")
    wanted = os.environ.get(ENV, "auto") or "auto"
    if wanted == "off":
        return BlasChoice("bundled", reason="")  # asked for: no warning
    if "mlx.core" in sys.modules:
        return BlasChoice("too-late", reason=f"mlx.core was imported before semantic.blas.enable(); "
                                             f"MLX keeps its bundled reference BLAS in this process")
    candidates = [wanted] if wanted != "auto" else _candidates()
    tried = []
    for path in candidates:
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOW | os.RTLD_GLOBAL)
            lib.cblas_sgemm  # noqa: B018  a library without it cannot stand in for the bundled BLAS
        except (OSError, AttributeError) as exc:
            tried.append(f"{path}: {exc}")
            continue
        return BlasChoice("loaded", path=_real_path(lib))
    if wanted != "auto":
        return BlasChoice("bundled", reason=f"SEMANTIC_BLAS={wanted} could not be loaded ({'; '.join(tried)}); "
                                            f"MLX matmul runs on the bundled reference BLAS (about 4 GFLOP/s)")
    return BlasChoice("bundled", reason=f"no optimized BLAS found; MLX matmul runs on the bundled reference BLAS "
                                        f"(about 4 GFLOP/s): {INSTALL_HINT}")


def _candidates() -> list[str]:
    arch = platform.machine()
    found = [p.format(arch=arch) for p in _KNOWN if Path(p.format(arch=arch)).is_file()]
    name = ctypes.util.find_library("openblas")
    if name:
        found.append(name)
    return list(dict.fromkeys(found))


def _real_path(lib: ctypes.CDLL) -> str:
    """The file that provides ``lib``'s ``cblas_sgemm`` (``libopenblas.so.0`` -> its real path)."""
    info = _DlInfo()
    addr = ctypes.cast(lib.cblas_sgemm, ctypes.c_void_p)
    if ctypes.CDLL(None).dladdr(addr, ctypes.byref(info)) and info.dli_fname:
        return os.path.realpath(info.dli_fname.decode())
    return lib._name


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def describe() -> dict:
    """Which BLAS MLX's matmul uses in this process, for a results file's machine info.

    A library :func:`enable` loaded before MLX is the one MLX calls; otherwise
    the bundled ``libblas`` of ``mlx_cpu.libs`` is. ``mapped`` lists the BLAS
    libraries ``/proc/self/maps`` shows, so a surprise is visible.
    """
    c = _choice
    if platform.system() != "Linux":
        return {"blas": "accelerate" if platform.system() == "Darwin" else "platform", "status": "not-linux"}
    loaded = _mapped_blas_libraries()
    if c is not None and c.status == "loaded":
        name = "openblas" if "openblas" in c.path else Path(c.path).name
        return {"blas": name, "path": c.path, "status": c.status, "mapped": loaded}
    return {"blas": "bundled-reference", "status": c.status if c else "not-enabled", "mapped": loaded}


def _mapped_blas_libraries() -> list[str]:
    try:
        text = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    names = {line.rsplit(" ", 1)[-1] for line in text.splitlines() if "blas" in line.rsplit("/", 1)[-1]}
    return sorted(n for n in names if n.startswith("/"))


def main() -> int:
    """Say which BLAS would be loaded; exit 1 when none is found (``make venv`` calls it)."""
    c = _choose()
    if c.status == "loaded":
        print(f"optimized BLAS: {c.path}")
    elif c.status == "not-linux":
        print("not Linux: MLX uses Accelerate and Metal")
    else:
        print(f"no optimized BLAS: {INSTALL_HINT}")
    return 0 if c.status in ("loaded", "not-linux") else 1
