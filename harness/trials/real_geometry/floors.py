"""What the hardware does with the same bytes, measured in this process right beside each measurement: a
sequential read of the agent's files (page cache dropped, or warm), an fsync'd sequential write of as many
bytes, and a memcpy of as many bytes.

One thread each, plain ``readinto`` / ``write`` of 64 MiB chunks: the floor a restore or a save can be held to.
The page cache is dropped per file with ``fdatasync`` then ``posix_fadvise(POSIX_FADV_DONTNEED)`` (no root
needed; this directory's pages only)."""

from __future__ import annotations

import os
import time
from pathlib import Path

CHUNK = 64 << 20


def evict(paths) -> int:
    """Drop ``paths`` (files, or directories walked) from the page cache; returns the files advised."""
    from harness.trials.block_store.servers import evict_page_cache

    n = 0
    for p in paths:
        p = Path(p)
        if p.is_dir():
            n += evict_page_cache(p)
        elif p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                n += 1
            finally:
                os.close(fd)
    return n


class Buffers:
    """Two touched buffers of ``CHUNK`` bytes (a source and a destination), reused by every floor."""

    def __init__(self, chunk: int = CHUNK):
        import numpy as np

        self.src = np.random.default_rng(0).integers(0, 256, size=chunk, dtype=np.uint8)
        self.dst = np.ones(chunk, dtype=np.uint8)
        self.chunk = chunk


def read_files(files, bufs: Buffers) -> dict:
    """Read ``files`` one after the other into ``bufs.dst``, chunk by chunk; seconds and bytes."""
    view, total = memoryview(bufs.dst), 0
    t0 = time.perf_counter()
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while True:
                n = fh.readinto(view)
                if not n:
                    break
                total += n
    return {"s": time.perf_counter() - t0, "bytes": total}


def cold_read(files, bufs: Buffers) -> dict:
    evict(files)
    return read_files(files, bufs)


def write_fsync(path: Path, nbytes: int, bufs: Buffers) -> dict:
    """Write ``nbytes`` to a new file at ``path`` from ``bufs.src``, fsync it; seconds. The file is removed
    (after its time is taken)."""
    view = memoryview(bufs.src)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, view[: min(left, bufs.chunk)])
        os.fsync(fd)
    finally:
        os.close(fd)
    s = time.perf_counter() - t0
    os.unlink(path)
    return {"s": s, "bytes": nbytes}


def memcpy(nbytes: int, bufs: Buffers) -> dict:
    """Copy ``nbytes`` from ``bufs.src`` to ``bufs.dst`` (both touched, chunk by chunk); seconds."""
    import numpy as np

    t0 = time.perf_counter()
    left = nbytes
    while left > 0:
        n = min(left, bufs.chunk)
        np.copyto(bufs.dst[:n], bufs.src[:n])
        left -= n
    return {"s": time.perf_counter() - t0, "bytes": nbytes}


def memcpy_fresh(nbytes: int, bufs: Buffers) -> dict:
    """Copy ``nbytes`` into freshly allocated memory, chunk by chunk (each page faulted in, as a restore's
    new arrays are); seconds."""
    import numpy as np

    t0 = time.perf_counter()
    left = nbytes
    while left > 0:
        n = min(left, bufs.chunk)
        dst = np.empty(n, dtype=np.uint8)
        np.copyto(dst, bufs.src[:n])
        del dst
        left -= n
    return {"s": time.perf_counter() - t0, "bytes": nbytes}


def machine(bufs: Buffers, nbytes: int = 1 << 30) -> dict:
    """This machine's memcpy speed (touched and fresh destination), GB/s, best of three of ``nbytes``."""
    warm = min(memcpy(nbytes, bufs)["s"] for _ in range(3))
    fresh = min(memcpy_fresh(nbytes, bufs)["s"] for _ in range(3))
    return {"memcpy_gb_s": nbytes / warm / 1e9, "memcpy_fresh_gb_s": nbytes / fresh / 1e9, "bytes": nbytes}
