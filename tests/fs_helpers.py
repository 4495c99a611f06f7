"""A size-limited tmpfs for tests of a disk that fills or turns read-only (root only, else skipped).

A chmod does not stop root from writing, and only the kernel gives a real
ENOSPC in the middle of a write: so these tests mount a filesystem of their
own, with the chaos soak's helpers (``harness.trials.chaos.fs``).
"""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path

import pytest

from harness.trials.chaos import fs


@contextlib.contextmanager
def tmpfs(size_mb: int):
    """A tmpfs of ``size_mb`` MiB mounted on a fresh directory, unmounted after."""
    where = Path(tempfile.mkdtemp(prefix="semantic-tmpfs-"))
    why = fs.mount_tmpfs(where, size_mb)
    if why:
        where.rmdir()
        pytest.skip(why)
    try:
        yield where
    finally:
        fs.unmount(where)
        where.rmdir()


def remount(where: Path, mode: str) -> None:
    """Make the tmpfs at ``where`` read-only ("ro") or writable ("rw") again."""
    done, _, msg = fs.remount(where, mode)
    assert done, msg


def fill(where: Path) -> Path:
    """Write a file under ``where`` until its filesystem is full; the file (delete it to free the space)."""
    fs.fill(where)
    return where / fs.FILLER
