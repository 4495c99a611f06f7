"""Crash-safe file writes, and the startup recovery they need.

A file is written under a temporary name in its own directory, checksummed
while it is written, fsynced, renamed over the real name, and the directory
is fsynced: a crash at any point leaves the old file or the new one, never
a mix. A crash can leave a temporary file behind; :func:`remove_abandoned`
deletes those whose writer is gone, and :func:`quarantine` moves a file
that fails its checks aside instead of deleting evidence::

    .<name>.<pid>.<8 hex>.tmp   a writer's temporary (or kept-aside old) file
    quarantine/<name>.<ns>      a file moved aside because it failed its checks

Nothing here knows the cache format: :func:`write` takes the header as a
function of the data's checksums.
"""

from __future__ import annotations

import os
import re
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable

import xxhash

TMP_SUFFIX = ".tmp"
_TMP = re.compile(r"^\..+\.(\d+)\.[0-9a-f]{8}" + re.escape(TMP_SUFFIX) + "$")


def temp_name(path: str | os.PathLike) -> str:
    """A fresh temporary name beside ``path``: ``.<name>.<pid>.<random>.tmp``."""
    p = Path(path)
    return str(p.with_name(f".{p.name}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}"))


def temp_writer(name: str) -> int | None:
    """The pid in a name :func:`temp_name` made, or None for any other name."""
    m = _TMP.match(name)
    return int(m.group(1)) if m else None


# ---------------------------------------------------------------- hashing

_executor: ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


def hasher() -> ThreadPoolExecutor:
    """Hashing threads, up to four: xxhash releases the GIL on buffers over
    64 KiB, so hashing overlaps writing (save) and spreads over the cores (load)."""
    global _executor
    with _executor_lock:
        if _executor is None:
            workers = max(2, min(4, os.cpu_count() or 2))
            _executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="semantic-kv-hash")
        return _executor


def _forget_hasher() -> None:
    # a forked child inherits the executor object but none of its threads
    global _executor, _executor_lock
    _executor, _executor_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_hasher)


def digest(views: Iterable[memoryview]) -> str:
    """xxh3-128 (hex) of the views' bytes, in order."""
    h = xxhash.xxh3_128()
    for v in views:
        h.update(v)
    return h.hexdigest()


# ---------------------------------------------------------------- writing


def write(
    path: str,
    placeholder: bytes,
    chunks: list[list[memoryview]],
    header: Callable[[list[str]], bytes],
    durable: bool,
    sync_dir: bool = True,
) -> tuple[os.stat_result, int]:
    """Write ``placeholder`` then ``chunks`` to ``path`` atomically.

    Each chunk is checksummed (:func:`digest`) on the hashing threads while
    it is written; ``header(digests)`` then replaces the placeholder, which
    it must match in length. Returns the new file's stat and header length.
    ``sync_dir=False`` leaves the directory's fsync to a caller that writes several files.
    """
    tmp = temp_name(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        try:
            _write_all(fd, memoryview(placeholder))
            writer, pending = _Writer(fd, len(placeholder)), []
            for views in chunks:
                pending.append(hasher().submit(digest, views))  # checksummed while written
                writer.write(views)
            final = header([f.result() for f in pending])
            assert len(final) == len(placeholder), "checksums are fixed-width: the header cannot change length"
            os.pwrite(fd, final, 0)
            if durable:
                _fsync_file(fd)
        finally:
            os.close(fd)
        old = _keep_aside(path)
        os.replace(tmp, path)
    except BaseException:
        unlink_quietly(tmp)
        raise
    if durable and sync_dir:
        fsync_path(os.path.dirname(os.path.abspath(path)))
    if old is not None:
        # freeing the old file's blocks (a discard on some disks) is slow: not on the caller's time
        with _executor_lock:
            _cleanups[:] = [f for f in _cleanups if not f.done()]
        _cleanups.append(hasher().submit(unlink_quietly, old))
    return os.stat(path), len(final)


class _Writer:
    """Writes pieces in order with writev, a few megabytes per call.

    Nothing is flushed before the one fsync at the end: asking Linux to start
    writeback every 8 MiB (sync_file_range) made a durable 870 MB save 2.5x
    slower on this machine's disk, and no faster at 190 MB (EXP-005 README)."""

    BATCH_BYTES = 8 << 20

    def __init__(self, fd: int, offset: int):
        self.fd, self.offset = fd, offset

    def write(self, views: list[memoryview]) -> None:
        batch, size = [], 0
        for v in views:
            batch.append(v)
            size += v.nbytes
            if len(batch) == _IOV_MAX or size >= self.BATCH_BYTES:
                self._writev(batch, size)
                batch, size = [], 0
        if batch:
            self._writev(batch, size)

    def _writev(self, batch: list[memoryview], size: int) -> None:
        n = os.writev(self.fd, batch)
        if n < size:  # rare: a short write; finish it piece by piece
            for v in batch:
                if n >= v.nbytes:
                    n -= v.nbytes
                    continue
                _write_all(self.fd, v[n:])
                n = 0
        self.offset += size


_IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX")) if hasattr(os, "sysconf") else 1024


def _write_all(fd: int, view: memoryview) -> None:
    while view.nbytes:
        n = os.write(fd, view)
        view = view[n:]


def _fsync_file(fd: int) -> None:
    # macOS fsync does not flush the drive's cache; F_FULLFSYNC does
    import fcntl

    if hasattr(fcntl, "F_FULLFSYNC"):
        fcntl.fcntl(fd, fcntl.F_FULLFSYNC)
    else:
        os.fsync(fd)


def fsync_file(path: str) -> None:
    """fsync a file written without it (``write(durable=False)``), by name."""
    _by_name(path, _fsync_file)


def fsync_path(path: str) -> None:
    """fsync a file or directory by name (a directory: so a rename in it is durable)."""
    _by_name(path, os.fsync)


def _by_name(path: str, sync: Callable[[int], None]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        sync(fd)
    finally:
        os.close(fd)


def unlink_quietly(path: str | os.PathLike) -> None:
    """Delete ``path`` if it is there."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _keep_aside(path: str) -> str | None:
    """Hard-link the file about to be replaced under a temporary name.

    The rename then only drops a link; deleting the old data happens when
    that name is unlinked, later. A crash in between leaves a temporary
    file, which :func:`remove_abandoned` deletes on the next start. None
    when there is no old file or the file system has no hard links.
    """
    aside = temp_name(path)
    try:
        os.link(path, aside)
    except OSError:
        return None
    return aside


_cleanups: list = []  # futures of old files being deleted after a write


def settle() -> None:
    """Wait until the old files that earlier writes replaced are deleted."""
    for f in list(_cleanups):
        f.result()


# ---------------------------------------------------------------- recovery

_STARTED_NS = time.time_ns()


def remove_abandoned(directory: Path) -> list[str]:
    """Delete the temporary files in ``directory`` whose writer is gone; their paths, sorted.

    A temporary named with our pid is in flight unless it predates this
    process (a container restart can hand a new process its predecessor's pid).
    """
    removed = []
    for path in sorted(directory.iterdir()):
        pid = temp_writer(path.name)
        if pid is None or not path.is_file():
            continue
        gone = path.stat().st_mtime_ns < _STARTED_NS if pid == os.getpid() else not _alive(pid)
        if gone:
            try:
                unlink_quietly(path)
            except OSError:  # a read-only directory: a later scan deletes it
                continue
            removed.append(str(path))
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def quarantine(path: Path, qdir: Path) -> Path | None:
    """Move ``path`` into ``qdir`` under a fresh name; None if it was already gone."""
    qdir.mkdir(exist_ok=True)
    dest = qdir / f"{path.name}.{time.time_ns()}"
    try:
        os.replace(path, dest)
    except FileNotFoundError:
        return None
    return dest
