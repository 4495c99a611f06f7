"""Cache files: one agent's blocks in a crash-safe, verified safetensors file.

The file holds our block layout, not mlx-lm's cache state, so it loads the
same under every mlx-lm version (and is readable by ``safetensors`` or
``mx.load`` without this module)::

    8 bytes     N, the header length (little-endian u64)
    N bytes     JSON: the tensor table, and __metadata__ with
                  "semantic_kv"          the document (JSON, below)
                  "semantic_kv_xxh3_128" the xxh3-128 of the document
    data        per layer, per part: one tensor holding every token the layer
                holds, in temporal order (1, heads, tokens, dim)

    "layer.1.keys"     a global layer: tokens 0..T
    "layer.0.values"   a sliding layer of window 512: tokens T-512..T (unrolled)
    "layer.3.keys.scales"   quantized layers: .packed, .scales, .biases

The document holds the format version, model fingerprint, cache spec, the
exact token ids, each layer's cache type and meta, an xxh3-128 per tensor,
and the mlx / mlx-lm versions that wrote it. A sliding layer's window is
stored in temporal order (see ``convert``), so a wrapped ring buffer is
stored unrolled and the ring index is simply the held count. Block
boundaries are not in the file: a file loads into a pool of any block size,
and each group's tensors become one segment (``blocks.Segment``) that the
loaded blocks are views of, so reconstruction hands it over without a copy.
One tensor per layer, like mlx-lm's own files, keeps allocations the size
mlx-lm's loads make (stacking layers measured slower: big buffers are
fresh memory, page-faulted on every load).

Writes go to a temporary file in the same directory, are fsynced, renamed
over the real name and the directory is fsynced: a crash leaves the old file
or the new one. Loads check the header against the layout the document
implies, the file size, and every tensor's checksum before any block reaches
the pool; anything wrong raises :class:`CacheCorruptError`. Nothing is ever
unpickled. A load goes through the pool's hash-chained lookup
(``blockplan``): full blocks the pool already holds are shared and their
tensors are not even read.

Checksums are xxh3-128 (python-xxhash, which releases the GIL): measured
here at 8.8 GB/s on a 64 MiB buffer and 26 GB/s on a cache-hot one, against
1.4 GB/s for sha256 and 0.5 GB/s for blake2b; xxh3-64 runs at the same speed,
so the wider digest is free. They detect damage, not forgery: anyone who can
rewrite a file can rewrite its checksums.
"""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import struct
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import mlx.core as mx
import numpy as np
import xxhash

from semantic import compat
from semantic.blockplan import BlockPlan, PlannedBlock, block_spans, chain_keys, commit, held_ranges, plan
from semantic.blocks import AgentBlocks, KVBlock, LayerKV, Segment
from semantic.errors import (
    CacheCorruptError,
    CacheError,
    CacheMismatchError,
    CacheShapeError,
    InvalidRequestError,
)
from semantic.pool import BlockPool
from semantic.spec import SLIDING, LayerSpec, ModelCacheSpec

FORMAT_VERSION = 1
DOC_KEY = "semantic_kv"
DOC_HASH_KEY = "semantic_kv_xxh3_128"
HASH = "xxh3_128"
SUFFIX = ".safetensors"
TMP_SUFFIX = ".tmp"
MAX_HEADER_BYTES = 100_000_000  # the limit the safetensors library itself enforces

_ST_DTYPES = {"float32": ("F32", 4), "float16": ("F16", 2), "bfloat16": ("BF16", 2), "uint32": ("U32", 4)}
_MX_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16, "uint32": mx.uint32}
_QPARTS = ("packed", "scales", "biases")


# ---------------------------------------------------------------- layout


@dataclass(frozen=True, slots=True)
class TensorSlot:
    """One tensor of a file: one part of one layer's held tokens."""

    name: str
    group: str
    layer: int
    side: str             # "keys" or "values"
    part: int | None      # index into (packed, scales, biases) for quantized layers
    dtype: str
    shape: tuple[int, ...]  # (1, heads, held tokens, dim)

    @property
    def nbytes(self) -> int:
        n = _ST_DTYPES[self.dtype][1]
        for d in self.shape:
            n *= d
        return n


def _parts(layer: LayerSpec, n: int) -> list[tuple[str, int | None, str, tuple[int, ...]]]:
    """(side, part, dtype, shape) of each array one layer holds for ``n`` tokens."""
    out = []
    for side, dim in (("keys", layer.head_dim), ("values", layer.v_head_dim)):
        if layer.kv_bits:
            g = dim // layer.kv_group_size
            out.append((side, 0, "uint32", (1, layer.n_kv_heads, n, dim * layer.kv_bits // 32)))
            out.append((side, 1, layer.dtype, (1, layer.n_kv_heads, n, g)))
            out.append((side, 2, layer.dtype, (1, layer.n_kv_heads, n, g)))
        else:
            out.append((side, None, layer.dtype, (1, layer.n_kv_heads, n, dim)))
    return out


def _held(layer: LayerSpec, total: int) -> int:
    """How many tokens a layer holds after ``total``."""
    return sum(b - a for a, b in held_ranges(layer, total))


def layout(spec: ModelCacheSpec, total: int) -> list[TensorSlot]:
    """Every tensor a file of ``total`` tokens holds, in file order (none when empty)."""
    slots = []
    for i, layer in enumerate(spec.layers):
        held = _held(layer, total)
        if not held:
            continue
        for side, part, dtype, shape in _parts(layer, held):
            suffix = side if part is None else f"{side}.{_QPARTS[part]}"
            slots.append(TensorSlot(f"layer.{i}.{suffix}", layer.group, i, side, part, dtype, shape))
    return slots


def _layer_meta(spec: ModelCacheSpec, total: int) -> list[dict]:
    """Per-layer cache type and meta, as mlx-lm would rebuild the cache."""
    out = []
    for l in spec.layers:
        held = _held(l, total)
        out.append(
            {
                "cache": l.cache_kind,
                "offset": total,
                "window": l.window,
                "keep": l.keep,
                # rebuilt rotating caches are unrolled: the write index is the held count
                "ring_idx": held if l.kind == SLIDING else None,
                "bits": l.kv_bits,
                "group_size": l.kv_group_size,
            }
        )
    return out


# ---------------------------------------------------------------- header


@dataclass(frozen=True, slots=True)
class CacheFileInfo:
    """What a cache file's header says, checked against its layout and size
    (everything but the tensor checksums, which :func:`load` verifies)."""

    path: str
    format_version: int
    model_fingerprint: str
    agent_id: str | None
    spec: ModelCacheSpec
    token_ids: tuple[int, ...]
    mlx_version: str
    mlx_lm_version: str
    nbytes: int                      # file size in bytes
    data_offset: int                 # where tensor data starts
    slots: tuple[TensorSlot, ...] = field(repr=False)
    digests: dict[str, str] = field(repr=False)
    inode: tuple[int, int] = field(repr=False)  # (st_dev, st_ino) of the file read

    @property
    def total_tokens(self) -> int:
        return len(self.token_ids)


def _canon(x: Any) -> str:
    """Canonical JSON, so that 1 != 1.0 != true when comparing header values."""
    return json.dumps(x, sort_keys=True, separators=(",", ":"))


def _header_bytes(doc: dict, slots: list[TensorSlot]) -> bytes:
    text = _canon(doc)
    meta = {"format": "semantic-kv", DOC_KEY: text, DOC_HASH_KEY: xxhash.xxh3_128(text.encode()).hexdigest()}
    table: dict[str, Any] = {"__metadata__": meta}
    offset = 0
    for s in slots:
        table[s.name] = _entry(s, offset)
        offset += s.nbytes
    raw = json.dumps(table, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)  # data starts 8-byte aligned, as safetensors pads
    return struct.pack("<Q", len(raw)) + raw


def _entry(s: TensorSlot, offset: int) -> dict:
    return {"dtype": _ST_DTYPES[s.dtype][0], "shape": list(s.shape), "data_offsets": [offset, offset + s.nbytes]}


def read_header(path: str | os.PathLike) -> CacheFileInfo:
    """Read and check a cache file's header without reading its tensors.

    Raises:
        CacheCorruptError: the header is damaged, edited, of an unknown
            format version, or does not match the file's size.
        OSError: the file cannot be opened (FileNotFoundError when absent).
    """
    path = str(path)
    with open(path, "rb", buffering=0) as f:
        st = os.fstat(f.fileno())
        head = f.read(8)
        if len(head) < 8:
            raise CacheCorruptError(path, f"truncated: {st.st_size} bytes, no header length")
        (n,) = struct.unpack("<Q", head)
        if not 2 <= n <= min(MAX_HEADER_BYTES, st.st_size - 8):
            raise CacheCorruptError(path, f"header length {n} does not fit a file of {st.st_size} bytes")
        raw = f.read(n)
    if len(raw) != n:
        raise CacheCorruptError(path, f"truncated header: {len(raw)} of {n} bytes")
    doc, table = _document(path, raw)
    return _check(path, doc, table, st, 8 + n)


def _document(path: str, raw: bytes) -> tuple[dict, dict]:
    try:
        table = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CacheCorruptError(path, f"header is not JSON ({type(exc).__name__}: {exc})") from None
    if not isinstance(table, dict):
        raise CacheCorruptError(path, "header is not a JSON object")
    meta = table.pop("__metadata__", None)
    if not isinstance(meta, dict) or not isinstance(meta.get(DOC_KEY), str):
        raise CacheCorruptError(path, f"no {DOC_KEY!r} document in the metadata: not a semantic-kv cache file")
    text = meta[DOC_KEY]
    try:
        digest = xxhash.xxh3_128(text.encode()).hexdigest()
    except UnicodeEncodeError:
        raise CacheCorruptError(path, "document is not valid UTF-8") from None
    if meta.get(DOC_HASH_KEY) != digest:
        raise CacheCorruptError(path, f"document checksum mismatch ({HASH} {digest} != {meta.get(DOC_HASH_KEY)!r})")
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):
        raise CacheCorruptError(path, "document is not JSON") from None
    if not isinstance(doc, dict):
        raise CacheCorruptError(path, "document is not a JSON object")
    version = doc.get("format_version")
    if version != FORMAT_VERSION or type(version) is not int:
        raise CacheCorruptError(
            path, f"unknown format version {version!r}; this build reads version {FORMAT_VERSION}"
        )
    return doc, table


def _check(path: str, doc: dict, table: dict, st: os.stat_result, data_offset: int) -> CacheFileInfo:
    try:
        spec = ModelCacheSpec.from_dict(doc["spec"])
        tokens = doc["token_ids"]
        fingerprint, agent_id = doc["model_fingerprint"], doc["agent_id"]
        digests = doc["tensors"]
        versions = (doc["mlx"], doc["mlx_lm"])
        layers = doc["layers"]
    except (KeyError, TypeError, ValueError, CacheError) as exc:
        raise CacheCorruptError(path, f"malformed document ({type(exc).__name__}: {exc})") from None
    if not (isinstance(tokens, list) and set(map(type, tokens)) <= {int} and min(tokens, default=0) >= 0):
        raise CacheCorruptError(path, "token_ids must be a list of non-negative integers")
    if not isinstance(fingerprint, str) or not (agent_id is None or isinstance(agent_id, str)):
        raise CacheCorruptError(path, "model_fingerprint and agent_id must be strings")
    if not all(isinstance(v, str) for v in versions):
        raise CacheCorruptError(path, "mlx and mlx_lm versions must be strings")
    if _canon(layers) != _canon(_layer_meta(spec, len(tokens))):
        raise CacheCorruptError(path, "per-layer cache meta does not match the spec and token count")
    slots = layout(spec, len(tokens))
    names = [s.name for s in slots]
    if not isinstance(digests, dict) or sorted(digests) != sorted(names):
        raise CacheCorruptError(path, "the document's checksums do not name the layout's tensors")
    if not all(isinstance(d, str) and len(d) == 32 for d in digests.values()):
        raise CacheCorruptError(path, f"checksums must be 32-digit {HASH} hex strings")
    expected, offset = {}, 0
    for s in slots:
        expected[s.name] = _entry(s, offset)
        offset += s.nbytes
    if _canon(table) != _canon(expected):  # one comparison; the loop below only names the difference
        for name, want in expected.items():
            if name not in table:
                raise CacheCorruptError(path, f"tensor {name} is missing")
            if _canon(table[name]) != _canon(want):
                raise CacheCorruptError(path, f"tensor {name}: header says {_canon(table[name])}, the layout needs {_canon(want)}")
        raise CacheCorruptError(path, f"unexpected tensors {sorted(set(table) - set(expected))[:3]}")
    if st.st_size != data_offset + offset:
        raise CacheCorruptError(
            path, f"file is {st.st_size} bytes but its header describes {data_offset + offset} (truncated or extended)"
        )
    return CacheFileInfo(
        path=path,
        format_version=FORMAT_VERSION,
        model_fingerprint=fingerprint,
        agent_id=agent_id,
        spec=spec,
        token_ids=tuple(tokens),
        mlx_version=versions[0],
        mlx_lm_version=versions[1],
        nbytes=st.st_size,
        data_offset=data_offset,
        slots=tuple(slots),
        digests=dict(digests),
        inode=(st.st_dev, st.st_ino),
    )


# ---------------------------------------------------------------- hashing

_executor: ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


def _hasher() -> ThreadPoolExecutor:
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


def _bytes(a: mx.array) -> memoryview:
    """The raw bytes of an evaluated, row-contiguous array, without a copy."""
    mv = memoryview(a)
    assert mv.c_contiguous, "only row-contiguous arrays have one byte view"
    return mv.cast("B") if mv.ndim != 1 or mv.format != "B" else mv


def _digest(views: Iterable[memoryview]) -> str:
    h = xxhash.xxh3_128()
    for v in views:
        h.update(v)
    return h.hexdigest()


# ---------------------------------------------------------------- save


def _sources(blocks: AgentBlocks, slots: list[TensorSlot]) -> list[list[mx.array]]:
    """Per slot, the arrays that hold its layer's tokens in order (bfloat16
    reinterpreted as uint16, for numpy).

    Blocks that are consecutive views of one segment (``blocks.Segment``)
    become one slice of it, so a fresh extraction is one array per layer.
    """
    spec, total, bt = blocks.spec, blocks.total_tokens, blocks.block_tokens
    for group, layers in spec.groups().items():
        want = [(a, b) for a, b, _ in block_spans(spec.layers[layers[0]], total, bt)]
        have = [(blk.start, blk.end) for blk in blocks.groups.get(group, [])]
        if have != want:
            raise CacheShapeError(f"group {group}: blocks hold {have[:4]}..., the layout of {total} tokens needs {want[:4]}...")
    out = []
    for s in slots:
        group = blocks.groups[s.group]
        for blk in group:
            _check_block(blk, s)
        out.append([a.view(mx.uint16) if a.dtype == mx.bfloat16 else a for a in _runs(group, s)])
    mx.eval(out)  # slices and reinterpretations: views, no copies
    return out


def _check_block(blk: KVBlock, s: TensorSlot) -> None:
    i = s.layer
    a = _part(blk.layer_data[i], s)
    shape = (1, s.shape[1], blk.n_tokens, s.shape[3])
    if tuple(a.shape) != shape or a.dtype != _MX_DTYPES[s.dtype]:
        raise CacheShapeError(
            f"layer {i} {s.side} [{blk.start}, {blk.end}): {tuple(a.shape)} {a.dtype}, the spec needs {shape} {s.dtype}"
        )


def _part(kv, s: TensorSlot):
    x = kv[0 if s.side == "keys" else 1]
    return x if s.part is None else x[s.part]


def _runs(group: list[KVBlock], s: TensorSlot) -> list[mx.array]:
    """The slot layer's arrays over the group's blocks, merging consecutive views of one segment."""
    i, out, run = s.layer, [], None  # run: [segment, first held index, end held index]

    def flush():
        if run is not None:
            out.append(_part(run[0].layer_data[i], s)[..., run[1] : run[2], :])

    for blk in group:
        where = getattr(blk, "segment", None)
        # the block's data must still be the views it was given into the segment
        ok = where is not None and where[2].get(i) is blk.layer_data.get(i)
        if ok and run is not None and run[0] is where[0] and run[2] == where[1]:
            run[2] += blk.n_tokens
            continue
        flush()
        if ok:
            run = [where[0], where[1], where[1] + blk.n_tokens]
        else:
            run = None
            out.append(_part(blk.layer_data[i], s))
    flush()
    return out


def _chunks(arrays: list[mx.array]) -> list[memoryview]:
    """The bytes of one (1, heads, tokens, dim) tensor in file order: one
    contiguous piece per head and array. Arrays may be strided views (slices
    of a segment), but each head's tokens are contiguous: no copy."""
    out = []
    nps = [np.asarray(memoryview(a)) for a in arrays]
    for h in range(nps[0].shape[1]):
        for x in nps:
            piece = x[0, h]
            if not piece.flags.c_contiguous:  # not a view we know: copy this piece
                piece = np.ascontiguousarray(piece)
            out.append(memoryview(piece).cast("B"))
    return out


class _Writer:
    """Writes pieces in order with writev, and (when durable) asks the kernel
    to start writing every few megabytes to disk, so that the final fsync
    waits only for the tail instead of the whole file."""

    WRITEBACK_BYTES = 8 << 20

    def __init__(self, fd: int, offset: int, durable: bool):
        self.fd, self.offset, self.durable = fd, offset, durable
        self.flushed = offset

    def write(self, views: list[memoryview]) -> None:
        batch, size = [], 0
        for v in views:
            batch.append(v)
            size += v.nbytes
            if len(batch) == _IOV_MAX or size >= self.WRITEBACK_BYTES:
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
        if self.durable and self.offset - self.flushed >= self.WRITEBACK_BYTES:
            _start_writeback(self.fd, self.flushed, self.offset - self.flushed)
            self.flushed = self.offset


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


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _keep_aside(path: str) -> str | None:
    """Hard-link the file about to be replaced under a temporary name.

    The rename then only drops a link; deleting the old data happens when
    that name is unlinked, later. A crash in between leaves a temporary
    file, which the store deletes on startup. None when there is no old
    file or the file system has no hard links.
    """
    aside = temp_name(path)
    try:
        os.link(path, aside)
    except OSError:
        return None
    return aside


_cleanups: list = []  # futures of old files being deleted after a save


def settle() -> None:
    """Wait until the old files that earlier saves replaced are deleted."""
    for f in list(_cleanups):
        f.result()


_sync_file_range = None


def _start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask Linux to start writing a range to disk now (sync_file_range), so the
    final fsync waits only for the tail; elsewhere this does nothing."""
    global _sync_file_range
    if _sync_file_range is None:
        _sync_file_range = False
        if sys.platform.startswith("linux"):
            try:
                fn = ctypes.CDLL(None, use_errno=True).sync_file_range
                fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
                _sync_file_range = fn
            except (OSError, AttributeError):
                pass
    if _sync_file_range:
        _sync_file_range(fd, offset, nbytes, 2)  # SYNC_FILE_RANGE_WRITE: start, do not wait


def temp_name(path: str | os.PathLike) -> str:
    """A fresh temporary name beside ``path``: ``.<name>.<pid>.<random>.tmp``."""
    p = Path(path)
    return str(p.with_name(f".{p.name}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}"))


@dataclass(frozen=True, slots=True)
class PreparedSave:
    """A cache's tensors as file-ordered byte views: all the MLX work of a save.

    The views keep their arrays alive; writing them needs no MLX call, so
    another thread can do it while MLX keeps computing.
    """

    spec: ModelCacheSpec
    token_ids: tuple[int, ...]
    slots: list[TensorSlot]
    chunks: list[list[memoryview]]


def prepare(blocks: AgentBlocks) -> PreparedSave:
    """The byte views :func:`save` writes for ``blocks`` (no copy of segment views)."""
    if blocks.released:
        raise CacheMismatchError("these AgentBlocks were released; their blocks may be reused")
    slots = layout(blocks.spec, blocks.total_tokens)
    chunks = [_chunks(arrays) for arrays in _sources(blocks, slots)]
    return PreparedSave(blocks.spec, blocks.token_ids, slots, chunks)


def save(
    path: str | os.PathLike,
    blocks: AgentBlocks,
    *,
    model_fingerprint: str,
    agent_id: str | None = None,
    durable: bool = True,
    prepared: PreparedSave | None = None,
) -> CacheFileInfo:
    """Write ``blocks`` to ``path`` atomically.

    The data goes to a temporary file in the same directory while a second
    thread checksums it; the header (with the checksums) is written last,
    then the file is fsynced, renamed over ``path``, and the directory is
    fsynced. A crash at any point leaves ``path`` absent, old, or new.

    Args:
        path: the file to write; its directory must exist.
        blocks: one agent's cache; it is only read.
        model_fingerprint: identifies the model weights; :func:`load` refuses
            the file for any other fingerprint.
        agent_id: recorded in the document (the store lists agents by it).
        durable: fsync file and directory. Without it a process crash is
            still safe, but a power loss may lose the newest file.
        prepared: ``prepare(blocks)``, made earlier on the thread that runs
            MLX, so this call does no MLX work (a write-behind thread).

    Returns:
        The written file's :class:`CacheFileInfo`.
    """
    if blocks.released:
        raise CacheMismatchError("these AgentBlocks were released; their blocks may be reused")
    if not isinstance(model_fingerprint, str) or not model_fingerprint:
        raise InvalidRequestError(f"model_fingerprint must be a non-empty string, got {model_fingerprint!r}")
    if agent_id is not None and not isinstance(agent_id, str):
        raise InvalidRequestError(f"agent_id must be a string or None, got {agent_id!r}")
    path = os.fspath(path)
    if prepared is None:
        prepared = prepare(blocks)
    elif prepared.token_ids != blocks.token_ids or prepared.spec != blocks.spec:
        raise InvalidRequestError("prepared bytes belong to another cache than these blocks")
    spec, total, slots, chunks = blocks.spec, blocks.total_tokens, prepared.slots, prepared.chunks
    doc = {
        "format_version": FORMAT_VERSION,
        "model_fingerprint": model_fingerprint,
        "agent_id": agent_id,
        "spec": spec.to_dict(),
        "token_ids": list(blocks.token_ids),
        "layers": _layer_meta(spec, total),
        "hash": HASH,
        "tensors": {s.name: "0" * 32 for s in slots},
        "mlx": compat.MLX_VERSION,
        "mlx_lm": compat.MLX_LM_VERSION,
    }
    placeholder = _header_bytes(doc, slots)
    tmp = temp_name(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        try:
            _write_all(fd, memoryview(placeholder))
            writer, pending = _Writer(fd, len(placeholder), durable), []
            for views in chunks:
                pending.append(_hasher().submit(_digest, views))  # checksummed while written
                writer.write(views)
            doc["tensors"] = {s.name: f.result() for s, f in zip(slots, pending)}
            header = _header_bytes(doc, slots)
            assert len(header) == len(placeholder), "checksums are fixed-width: the header cannot change length"
            os.pwrite(fd, header, 0)
            if durable:
                _fsync_file(fd)
        finally:
            os.close(fd)
        old = _keep_aside(path)
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    if durable:
        _fsync_dir(os.path.dirname(os.path.abspath(path)))
    if old is not None:
        # freeing the old file's blocks (a discard on some disks) is slow: not on the caller's time
        with _executor_lock:
            _cleanups[:] = [f for f in _cleanups if not f.done()]
        _cleanups.append(_hasher().submit(_unlink_quietly, old))
    st = os.stat(path)
    return CacheFileInfo(
        path=path,
        format_version=FORMAT_VERSION,
        model_fingerprint=model_fingerprint,
        agent_id=agent_id,
        spec=spec,
        token_ids=blocks.token_ids,
        mlx_version=compat.MLX_VERSION,
        mlx_lm_version=compat.MLX_LM_VERSION,
        nbytes=st.st_size,
        data_offset=len(header),
        slots=tuple(slots),
        digests=dict(doc["tensors"]),
        inode=(st.st_dev, st.st_ino),
    )


# ---------------------------------------------------------------- load


class _Replaced(Exception):
    """The file at the path changed between reading its header and its data."""


_READ_CHUNKS = 2  # hashing the first half overlaps reading the second where a core is free


def _read_tensors(info: CacheFileInfo, slots: list[TensorSlot]) -> dict[str, mx.array]:
    """The slots' tensors, evaluated and checked against their checksums.

    ``mx.load`` reads straight into the arrays' memory (in parallel under
    mlx 0.32), with no Python-side buffer and no copy; each ``mx.eval`` of a
    chunk reads its tensors and makes the per-layer views, then the hashing
    threads checksum them (xxhash releases the GIL) while the next chunk is
    read.
    """
    if not slots:
        return {}
    try:
        loaded = mx.load(info.path)
    except (RuntimeError, ValueError, OSError) as exc:
        raise CacheCorruptError(info.path, f"mx.load failed: {exc}") from None
    st = os.stat(info.path)
    if (st.st_dev, st.st_ino) != info.inode:
        raise _Replaced
    tensors = {}
    for s in slots:
        t = loaded.get(s.name)
        if t is None or tuple(t.shape) != s.shape or t.dtype != _MX_DTYPES[s.dtype]:
            raise CacheCorruptError(info.path, f"tensor {s.name} does not load as {s.shape} {s.dtype}")
        tensors[s.name] = t
    names = list(tensors)
    step = max(1, -(-len(names) // _READ_CHUNKS))
    workers = _hasher()._max_workers
    pending = []
    try:
        for i in range(0, len(names), step):
            part = names[i : i + step]
            mx.eval([tensors[n] for n in part])
            for w in range(workers):  # one task per thread, not per tensor
                mine = part[w::workers]
                if mine:
                    pending.append((mine, _hasher().submit(_digest_arrays, [tensors[n] for n in mine])))
    except (RuntimeError, ValueError) as exc:  # e.g. the file shrank under us
        raise CacheCorruptError(info.path, f"reading tensors failed: {exc}") from None
    for name, got in ((n, d) for mine, fut in pending for n, d in zip(mine, fut.result())):
        if got != info.digests[name]:
            raise CacheCorruptError(info.path, f"tensor {name}: checksum mismatch ({HASH} {got} != {info.digests[name]})")
    return tensors


def _digest_arrays(arrays: list[mx.array]) -> list[str]:
    return [xxhash.xxh3_128(_bytes(a)).hexdigest() for a in arrays]


class _FileBlocks:
    """A file's tensors, served as the pool's blocks of any size.

    Each group's per-layer arrays form one segment, and a missed block is a
    view of it. When some of a group's blocks hit the pool instead, each run
    of missed blocks is copied into a segment of its own, so the shared
    tokens' bytes are not kept alive twice.
    """

    def __init__(self, info: CacheFileInfo):
        self.info = info
        self.by_group: dict[str, list[TensorSlot]] = {}
        for s in info.slots:
            self.by_group.setdefault(s.group, []).append(s)
        self.arrays: dict[str, mx.array] = {}

    def needed(self, planned: Iterable[PlannedBlock]) -> list[TensorSlot]:
        """Unread tensors of every group with a block that missed the pool."""
        groups = {p.group for p in planned if p.hit is None}
        return [s for g, slots in self.by_group.items() if g in groups for s in slots if s.name not in self.arrays]

    def read(self, slots: list[TensorSlot]) -> None:
        self.arrays.update(_read_tensors(self.info, slots))

    def layer(self, group: str, i: int) -> LayerKV:
        """Layer ``i``'s (keys, values) over every token its group holds."""
        parts = {(s.side, s.part): self.arrays[s.name] for s in self.by_group[group] if s.layer == i}
        if ("keys", None) in parts:
            return parts[("keys", None)], parts[("values", None)]
        return tuple(tuple(parts[(side, k)] for k in range(3)) for side in ("keys", "values"))

    def block_data(self, planned: BlockPlan) -> dict[int, tuple[dict[int, LayerKV], tuple]]:
        """For each missed planned block (by index): its layer views and its segment."""
        out = {}
        entries = list(enumerate(planned.blocks))
        for group, layers in self.info.spec.groups().items():
            mine = [(idx, p) for idx, p in entries if p.group == group]
            runs: list[list[tuple[int, PlannedBlock]]] = []
            for idx, p in mine:
                if p.hit is not None:
                    continue
                if runs and runs[-1][-1][0] == idx - 1:
                    runs[-1].append((idx, p))
                else:
                    runs.append([(idx, p)])
            whole = len(runs) == 1 and len(runs[0]) == len(mine)
            for run in runs:
                lo = run[0][1].start - run[0][1].shift
                hi = run[-1][1].end - run[-1][1].shift
                seg = Segment({}, hi - lo)
                for i in layers:
                    kv = self.layer(group, i)
                    # all of the group: the file's arrays are the segment (no copy)
                    seg.layer_data[i] = kv if whole else _map(kv, lambda x: mx.contiguous(x[..., lo:hi, :]))
                starts = [p.start - p.shift - lo for _, p in run]
                per_block = [{} for _ in run]
                for i, kv in seg.layer_data.items():
                    # one split per array gives every block's view at once
                    for j, piece in enumerate(_split_kv(kv, starts[1:])):
                        per_block[j][i] = piece
                for (idx, _), s0, data in zip(run, starts, per_block):
                    out[idx] = (data, (seg, s0, dict(data)))
        mx.eval([d for d, _ in out.values()])  # views (and, after a partial hit, copies)
        return out


def _map(kv: LayerKV, fn) -> LayerKV:
    return tuple(tuple(fn(x) for x in side) if isinstance(side, tuple) else fn(side) for side in kv)


def _split_kv(kv: LayerKV, cuts: list[int]) -> list[LayerKV]:
    """``kv`` cut along the token axis at ``cuts``: one (keys, values) per piece."""
    if not cuts:
        return [kv]
    split = _map(kv, lambda x: mx.split(x, cuts, axis=2))
    return [_map(split, lambda pieces: pieces[j]) for j in range(len(cuts) + 1)]


def load(
    path: str | os.PathLike,
    pool: BlockPool,
    *,
    model_fingerprint: str | None = None,
    lock: AbstractContextManager | None = None,
) -> AgentBlocks:
    """Load a cache file into ``pool`` as one agent's blocks.

    Full blocks already in the pool (the same tokens under the same chained
    key) are shared, not read: only the tensors of blocks that miss are read
    and checksummed. The pool is changed only once every read tensor has
    been verified, and not at all when this raises.

    Args:
        path: a file written by :func:`save`.
        pool: the pool to load into; its spec must be the file's.
        model_fingerprint: when given, the file must have been written for it.
        lock: held around every use of ``pool`` (not around file reads),
            for callers that share the pool between threads.

    Raises:
        CacheCorruptError: the file is damaged in any way.
        CacheMismatchError: the file belongs to another model or cache spec.
        PoolExhaustedError: the pool cannot hold the blocks that missed.
        FileNotFoundError: there is no file at ``path``.
    """
    for _ in range(3):
        try:
            return _load_once(os.fspath(path), pool, model_fingerprint, lock or nullcontext())
        except _Replaced:
            continue  # a writer renamed a new file over it meanwhile: read the new one
    raise CacheCorruptError(path, "the file kept being replaced while it was loading")


def _load_once(path: str, pool: BlockPool, fingerprint: str | None, lock: AbstractContextManager) -> AgentBlocks:
    info = read_header(path)
    pool.spec.require_same(info.spec, f"cache file {path}")
    if fingerprint is not None and info.model_fingerprint != fingerprint:
        raise CacheMismatchError(
            f"cache file {path} was written for model {info.model_fingerprint!r}, not {fingerprint!r}"
        )
    source = _FileBlocks(info)
    chain = chain_keys(info.token_ids, pool.block_tokens)
    with lock:
        planned = plan(pool, info.spec, info.token_ids, chain)
    source.read(source.needed(planned.blocks))  # the slow part, outside the lock
    with lock:
        planned = plan(pool, info.spec, info.token_ids, chain)
        late = source.needed(planned.blocks)  # hits that were recycled meanwhile
        if late:
            source.read(late)
        data = source.block_data(planned)
        by_block = {id(p): data[idx] for idx, p in enumerate(planned.blocks) if idx in data}
        release = pool.release if isinstance(lock, nullcontext) else _locked(pool.release, lock)
        return commit(pool, info.spec, info.token_ids, planned, lambda p: by_block[id(p)], release=release)


def _locked(fn, lock: AbstractContextManager):
    def call(blocks: list[KVBlock]) -> None:
        with lock:
            fn(blocks)

    return call
