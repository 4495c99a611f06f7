"""The same BLAS for every server, so that a comparison measures servers and not BLAS libraries.

MLX on Linux computes on whatever ``cblas_sgemm`` is first in the global
symbol scope. Ours loads the system OpenBLAS itself (``semantic.blas``,
``SEMANTIC_BLAS=auto``); every peer gets the same file as ``LD_PRELOAD``, and
:func:`blas_of` reads a live process's maps to show it.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from harness.servers.targets import ROOT, Launch, ServerTarget, ServingError


@cache
def blas_library() -> str | None:
    """The OpenBLAS file ours loads (``semantic.blas`` with ``SEMANTIC_BLAS=auto``), or None.

    Asked of a fresh interpreter, so that this process (which may already have
    imported MLX, or chosen otherwise) changes nothing.
    """
    if platform.system() != "Linux":
        return None
    env = {**os.environ, "SEMANTIC_BLAS": "auto"}
    code = "import semantic.blas as b; c = b.enable(warn=False); print(c.path if c.status == 'loaded' else '')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60,
                          cwd=ROOT)
    if done.returncode != 0:
        raise ServingError(f"could not ask semantic.blas for its library: {done.stderr[-1000:]}")
    return done.stdout.strip() or None


def server_env(target: ServerTarget, launch: Launch, blas: str | None,
               base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The whole environment a target's process starts with.

    Args:
        blas: the OpenBLAS file every server must use (:func:`blas_library`), or
            None for MLX's bundled BLAS everywhere.
        base: the environment to start from (default ``os.environ``).
    """
    env = dict(os.environ if base is None else base)
    for var in ("VIRTUAL_ENV", "PYTHONHOME", "SEMANTIC_BLAS"):
        env.pop(var, None)
    env["PATH"] = os.pathsep.join([str(launch.bin), env.get("PATH", "")])
    env["PYTHONUNBUFFERED"] = "1"
    env["HF_HUB_OFFLINE"] = "1"   # local model folders only: no hub look-ups at start
    if target.loads_blas_itself:
        env["SEMANTIC_BLAS"] = "auto" if blas else "off"
    elif blas:
        # NOTE: preloaded, so first in the global scope: libmlx's cblas_* bind to it, although the
        # bundled reference libblas is still mapped (libmlx needs it by name).
        env["LD_PRELOAD"] = ":".join(filter(None, [blas, env.get("LD_PRELOAD")]))
    env.update(target.env(launch))
    return env


@dataclass(frozen=True, slots=True)
class BlasMapping:
    """Which BLAS libraries a live process has mapped (``/proc/PID/maps``)."""

    pid: int
    mapped: tuple[str, ...]      # every mapped file whose name contains "blas", sorted
    openblas: str | None         # the system libopenblas among them (numpy's private scipy_openblas is not)
    preload: str | None          # LD_PRELOAD in its environment, when readable

    def uses(self, path: str | None) -> bool:
        """Whether ``path`` (a :func:`blas_library` result) is the OpenBLAS it has mapped."""
        return path is not None and self.openblas is not None and os.path.realpath(path) == self.openblas


def blas_of(pid: int) -> BlasMapping:
    """The BLAS libraries process ``pid`` has mapped, so results can say which one each server ran on."""
    try:
        text = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return BlasMapping(pid, (), None, None)
    paths = {line.split(None, 5)[5] for line in text.splitlines() if len(line.split(None, 5)) == 6}
    mapped = tuple(sorted(p for p in paths if p.startswith("/") and "blas" in p.rsplit("/", 1)[-1]))
    openblas = next((os.path.realpath(p) for p in mapped if p.rsplit("/", 1)[-1].startswith("libopenblas")), None)
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        preload = next((e[len(b"LD_PRELOAD="):].decode() for e in environ if e.startswith(b"LD_PRELOAD=")), None)
    except OSError:
        preload = None
    return BlasMapping(pid, mapped, openblas, preload)
