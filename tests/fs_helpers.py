"""A size-limited tmpfs for tests of a disk that fills or turns read-only (root only, else skipped).

A chmod does not stop root from writing, and only the kernel gives a real
ENOSPC in the middle of a write: so these tests mount a filesystem of their own.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from pathlib import Path

import pytest


@contextlib.contextmanager
def tmpfs(size: str):
    """A tmpfs of ``size`` (mount's syntax: "2m") mounted on a fresh directory, unmounted after."""
    if os.geteuid() != 0:
        pytest.skip("mounting a size-limited tmpfs needs root")
    where = Path(tempfile.mkdtemp(prefix="semantic-tmpfs-"))
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
    if done.returncode != 0:
        where.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)
        where.rmdir()


def remount(where: Path, mode: str) -> None:
    """Make the tmpfs at ``where`` read-only ("ro") or writable ("rw") again."""
    subprocess.run(["mount", "-o", f"remount,{mode}", str(where)], check=True)


def fill(where: Path) -> Path:
    """Write a file under ``where`` until its filesystem is full; the file (delete it to free the space)."""
    filler = where / "filler"
    with open(filler, "wb") as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 65536)
    return filler
