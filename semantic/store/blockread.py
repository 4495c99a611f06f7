"""Reading block files straight into the arrays that keep their tensors, each tensor checked as it arrives.

A restore (``blockload``) allocates, per layer group, one array per layer and part for a whole run of
missed blocks (a ``blocks.Segment``), then reads each block file of the run into its rows of them::

    block file   | 8 | header | layer.0.keys: head 0 rows | head 1 rows | .. | layer.0.values | layer.1.keys ..
                                       │  readv: one piece per head (a head's rows lie together on both sides)
    segment      layer.0.keys (1, heads, run tokens, dim):   head 0 [ .. | file rows | .. ]   head 1 [ .. ] ..

The tensors arrive a batch of about a mebibyte at a time (one ``readv``) and each is hashed (xxh3-128)
right after, while its bytes are still in the core's cache: each byte is copied once, into its final
place, and hashed from cache, not from memory (the whole file into one buffer, then a hash and a copy
into place per tensor, measured 1.1-1.7x slower: ``harness.analysis.restore_speed``, into-copy).
Rows no array takes (a history that uses only a prefix of another agent's partial block) are read into
scratch space, to be hashed with the rest.

:func:`read_all` reads the files on the hashing threads and the caller together, in order, and tells
the kernel which files come next (``POSIX_FADV_WILLNEED``) so that the disk reads ahead while the
cores copy and hash.
"""

from __future__ import annotations

import os
import struct
import threading
from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx
import xxhash

from semantic.cachefile.atomic import hasher
from semantic.errors import CacheCorruptError
from semantic.store.blockformat import BlockInfo

BATCH_BYTES = 1 << 20     # read, then hash, this much at a time: it is still in a core's L2 cache when hashed
AHEAD_BYTES = 1 << 30     # files announced to the kernel before they are read: what a disk reads while the
AHEAD_FILES = 64          # arrays are made (:func:`zeros`), and at most this many files (small blocks)
_IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX")) if hasattr(os, "sysconf") else 1024


@dataclass(frozen=True, slots=True)
class Into:
    """Where one block file's tensors go.

    ``dests`` holds, per tensor name, the writable bytes of the array that receives it. Without
    ``rows`` each tensor fills its array whole. With ``rows``, ``(lo, hi, at)`` triples (sorted,
    disjoint), the tensors are ``(1, heads, n, ...)`` and their arrays ``(1, heads, N, ...)`` of the
    same row size: the file's rows ``[lo, hi)`` go to rows ``[at, at + hi - lo)`` of every head.
    """

    info: BlockInfo
    dests: dict[str, memoryview]
    rows: tuple[tuple[int, int, int], ...] | None = None


def zeros(shapes: Sequence[tuple[tuple[int, ...], mx.Dtype]]) -> list[mx.array]:
    """Evaluated arrays of zeros of ``shapes`` (shape, dtype), to be read into (:func:`writable`).

    MLX makes no array without writing it (but as a load: an ``mx.load`` of a Python file object whose
    data reads write nothing was measured, 32K tokens warm in 0.54x the time, and dropped, because its reads
    call back into Python from MLX's worker thread: a server restoring beside other turns hung in CI, SIGTERM
    ignored, as a GIL held by a thread waiting on that worker leaves it), so every page of one is first touched here, not by the
    read: a page fault and the kernel's zeroing per page (about 0.5 s a GB on this 2-core VM, as much
    as ``mx.load``'s reading into fresh memory) and one more pass over memory than a load of one file
    makes. The arrays are made on the hashing threads and this one together, on the CPU (no GPU work
    from other threads), each evaluated on the thread that made it (mlx 0.32 evaluates an array only
    there); once evaluated they serve any thread."""
    if not shapes:
        return []
    pool, n = hasher(), _shares(len(shapes))

    def make(k: int) -> list[mx.array]:
        out = [mx.zeros(shape, dtype=dtype, stream=mx.cpu) for shape, dtype in shapes[k::n]]
        mx.eval(out)
        return out

    helpers = [pool.submit(make, k) for k in range(1, n)]
    parts = [make(0)]
    for k, f in enumerate(helpers, 1):
        parts.append(make(k) if f.cancel() else f.result())  # a thread busy hashing a save: made here instead
    out: list[mx.array] = [None] * len(shapes)  # type: ignore[list-item]
    for k, part in enumerate(parts):
        out[k::n] = part
    return out


def _shares(jobs: int) -> int:
    """Threads to spread ``jobs`` over: one per core, the caller one of them, as the cache-file load hashes."""
    return max(1, min(jobs, 1 + min(hasher()._max_workers, max(1, (os.cpu_count() or 2) - 1))))


def writable(arr: mx.array) -> memoryview:
    """The bytes of an evaluated array that this process made and nothing else holds yet, to be
    written in place (MLX arrays export writable, row-contiguous memory)."""
    if arr.size == 0:
        return memoryview(bytearray(0))
    mv = memoryview(arr)
    assert mv.c_contiguous and not mv.readonly, "an evaluated array made here is contiguous and writable"
    flat = mv.cast("B") if mv.ndim != 1 or mv.format != "B" else mv
    assert flat.nbytes == arr.nbytes
    return flat


def announce(paths: Sequence[str]) -> None:
    """Ask the kernel to start reading ``paths`` into its page cache now (no-op where unsupported)."""
    if not hasattr(os, "posix_fadvise"):
        return
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            continue  # the read will say what is wrong with it
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass
        finally:
            os.close(fd)


def announce_ahead(infos: Sequence[BlockInfo]) -> None:
    """:func:`announce` the first of ``infos`` (in the order they will be read), as far as :func:`read_all`
    reads ahead: the disk starts on them while the caller prepares the arrays to read them into."""
    paths, nbytes = [], 0
    for info in infos[:AHEAD_FILES]:
        if nbytes >= AHEAD_BYTES:
            break
        paths.append(info.path)
        nbytes += info.nbytes
    announce(paths)


def read_file(into: Into) -> None:
    """Read ``into.info``'s tensors into ``into.dests``, checking each against its checksum.

    Raises:
        CacheCorruptError: the file is shorter or longer than its layout, or a tensor's bytes are not
            the ones its checksum names (the arrays then hold garbage).
        OSError: the file cannot be opened now (gone, permissions, too many open files).
    """
    info = into.info
    fd = os.open(info.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        try:
            _read_tensors(fd, into)
        except OSError as exc:  # opened, then failed to read: its bytes are not what the index says
            raise CacheCorruptError(info.path, f"reading tensors failed: {exc}") from None
    finally:
        os.close(fd)


def _read_tensors(fd: int, into: Into) -> None:
    info = into.info
    size = os.fstat(fd).st_size
    head = os.pread(fd, 8, 0)
    tensors = sum(s.nbytes for s in info.slots)
    # the header may differ from the one the scan read (the same block, rewritten by another build): its length
    # says where the tensors start; their layout is the name's (checked by the scan), their bytes the checksums'
    n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
    if n < 0 or 8 + n + tensors != size:
        raise CacheCorruptError(info.path, f"{size} bytes do not hold its header ({n}) and tensors ({tensors} bytes)")
    os.lseek(fd, 8 + n, os.SEEK_SET)
    batch: list[tuple[str, list[memoryview]]] = []
    views: list[memoryview] = []
    nbytes = 0
    for s in info.slots:
        mine = _pieces(into, s)
        if batch and (nbytes + s.nbytes > BATCH_BYTES or len(views) + len(mine) > _IOV_MAX):
            _read_batch(fd, info, batch, views, nbytes)
            batch, views, nbytes = [], [], 0
        batch.append((s.name, mine))
        views.extend(mine)
        nbytes += s.nbytes
    if batch:
        _read_batch(fd, info, batch, views, nbytes)


def _read_batch(fd: int, info: BlockInfo, batch, views: list[memoryview], nbytes: int) -> None:
    got = _readv_all(fd, views, nbytes) if len(views) <= _IOV_MAX else sum(_readv_all(fd, [v], v.nbytes) for v in views)
    if got != nbytes:
        raise CacheCorruptError(info.path, f"reading tensors failed: {got} of {nbytes} bytes (the file shrank)")
    for name, pieces in batch:
        h = xxhash.xxh3_128()
        for v in pieces:
            h.update(v)
        if h.hexdigest() != info.digests[name]:
            raise CacheCorruptError(info.path, f"tensor {name}: checksum mismatch")


def _readv_all(fd: int, views: list[memoryview], nbytes: int) -> int:
    """Fill ``views`` in order from ``fd``; the bytes read (fewer only at the end of the file)."""
    done, first = 0, 0
    while done < nbytes:
        k = os.readv(fd, views[first:] if first else views)
        if k == 0:
            break
        done += k
        while k and k >= views[first].nbytes:  # skip the filled ones; a partly filled one continues
            k -= views[first].nbytes
            first += 1
        if k:
            views[first] = views[first][k:]
    return done


def _pieces(into: Into, s) -> list[memoryview]:
    """Where tensor ``s``'s bytes go, in file order: its array's rows, or scratch space to be only hashed."""
    dest = into.dests.get(s.name)
    if s.nbytes == 0:
        return []
    if dest is None:
        return [memoryview(bytearray(s.nbytes))]  # a tensor nothing takes: hashed all the same
    if into.rows is None:
        assert dest.nbytes == s.nbytes, (s.name, dest.nbytes, s.nbytes)
        return [dest]
    heads, n = s.shape[1], s.shape[2]
    row = s.nbytes // (heads * n)
    per_head = dest.nbytes // heads  # the array's rows of one head
    assert dest.nbytes % (heads * row) == 0, (s.name, dest.nbytes, heads, row)
    skipped = n - sum(hi - lo for lo, hi, _ in into.rows)
    spare = memoryview(bytearray(skipped * row * heads)) if skipped else None
    out, used = [], 0
    for h in range(heads):
        cur, base = 0, h * per_head
        for lo, hi, at in into.rows:
            if lo > cur:
                out.append(spare[used : used + (lo - cur) * row])
                used += (lo - cur) * row
            a = base + at * row
            assert base <= a and a + (hi - lo) * row <= base + per_head, (s.name, lo, hi, at)
            out.append(dest[a : a + (hi - lo) * row])
            cur = hi
        if cur < n:
            out.append(spare[used : used + (n - cur) * row])
            used += (n - cur) * row
    return out


class _Queue:
    """The files to read, in order, handed to whichever thread asks next; the first failure stops it.
    Taking one announces the files after it, up to :data:`AHEAD_BYTES` not yet taken."""

    def __init__(self, jobs: Sequence[Into]):
        self.jobs = list(jobs)
        self.taken = self.announced = self.ahead = 0  # ahead: bytes announced and not yet taken
        self.error: BaseException | None = None
        self.lock = threading.Lock()

    def take(self) -> Into | None:
        with self.lock:
            if self.error is not None or self.taken >= len(self.jobs):
                return None
            job = self.jobs[self.taken]
            self.taken += 1
            if self.announced >= self.taken:
                self.ahead -= job.info.nbytes
            self.announced = max(self.announced, self.taken)  # this one is read now: the read starts it
            paths = []
            while (self.announced < len(self.jobs) and self.ahead < AHEAD_BYTES
                   and self.announced - self.taken < AHEAD_FILES):
                info = self.jobs[self.announced].info
                paths.append(info.path)
                self.ahead += info.nbytes
                self.announced += 1
        announce(paths)
        return job

    def fail(self, exc: BaseException) -> None:
        with self.lock:
            if self.error is None:
                self.error = exc


def _drain(queue: _Queue) -> None:
    while (job := queue.take()) is not None:
        try:
            read_file(job)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, which raises it
            queue.fail(exc)
            return


def read_all(jobs: Sequence[Into]) -> None:
    """Read every job's file (:func:`read_file`), on the hashing threads and this one, in order.

    Returns only once no thread writes into the jobs' arrays any more, also when it raises.

    Raises:
        CacheCorruptError: a file failed its checks (``path`` names it; the others may be unread).
        OSError: a file could not be opened now.
    """
    if not jobs:
        return
    queue = _Queue(jobs)
    # readv and xxhash release the GIL: the threads copy and hash in parallel
    helpers = [hasher().submit(_drain, queue) for _ in range(_shares(len(jobs)) - 1)]
    try:
        _drain(queue)
    finally:
        for f in helpers:
            if not f.cancel():  # one that never started (the threads busy hashing a save) is not waited for
                f.result()
    if queue.error is not None:
        raise queue.error
