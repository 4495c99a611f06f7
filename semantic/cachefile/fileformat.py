"""The cache file format: tensor layout, header document, and the checks a header must pass.

The file holds our block layout, not mlx-lm's cache state, so it loads the
same under every mlx-lm version (and is readable by ``safetensors`` or
``mx.load`` without this package)::

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
and the mlx / mlx-lm versions that wrote it. Version 2 adds ``stored_from``:
per sliding group whose cache referenced a pooled full block at its window
edge (``blockclaim``), the position its tensors start at, before the
window, so that agents reloaded from disk share that block again::

    window 512 at T = 900     held  [388 ................ 900)
    version 1 tensor                [388 ................ 900)
    version 2, stored_from 256   [256 ................... 900)   loads as the full block [256, 512)

Version 1 files (no ``stored_from``) still load. A sliding layer's window is
stored in temporal order (see ``convert``), so a wrapped ring buffer is
stored unrolled and the ring index is simply the held count. Block
boundaries are not in the file: a file loads into a pool of any block size.
One tensor per layer, like mlx-lm's own files, keeps allocations the size
mlx-lm's loads make (stacking layers measured slower: big buffers are
fresh memory, page-faulted on every load).

A window shorter than a pool's block resumes only from a snapshot
(``LayerSpec.snapshot_only``): its tensors, minus any ``stored_from`` part,
are that snapshot, so such files load as before (``loading``). Recurrent
layers have no positions: :func:`layout` gives their state tensors
(``layer.<i>.state.<j>``) for the block layout's snapshot files, but this
layout refuses to write them (:func:`refuse_recurrent`) or read them.

Checksums are xxh3-128 (python-xxhash, which releases the GIL): measured
here at 8.8 GB/s on a 64 MiB buffer and 26 GB/s on a cache-hot one, against
1.4 GB/s for sha256 and 0.5 GB/s for blake2b; xxh3-64 runs at the same speed,
so the wider digest is free. They detect damage, not forgery: anyone who can
rewrite a file can rewrite its checksums.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import xxhash

from semantic import compat
from semantic.cache.blockclaim import stored_ranges
from semantic.errors import CacheCorruptError, CacheError, UnsupportedCacheError
from semantic.cache.spec import RECURRENT, LayerSpec, ModelCacheSpec

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)  # 1: no stored_from (every tensor starts at the held window)
DOC_KEY = "semantic_kv"
DOC_HASH_KEY = "semantic_kv_xxh3_128"
HASH = "xxh3_128"
SUFFIX = ".safetensors"
MAX_HEADER_BYTES = 100_000_000  # the limit the safetensors library itself enforces

ST_DTYPES = {"float32": ("F32", 4), "float16": ("F16", 2), "bfloat16": ("BF16", 2), "uint32": ("U32", 4)}
MX_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16, "uint32": mx.uint32}
QPARTS = ("packed", "scales", "biases")


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
        n = ST_DTYPES[self.dtype][1]
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


def state_slots(layer: LayerSpec, i: int) -> list[TensorSlot]:
    """A recurrent layer's arrays as tensors ``layer.<i>.state.<j>``, each ``(1, *shape)`` in the spec's
    dtype (its snapshot: block files of the block layout; the single-file layout refuses them)."""
    return [TensorSlot(f"layer.{i}.state.{j}", layer.group, i, "state", j, dtype, (1, *shape))
            for j, (shape, dtype) in enumerate(layer.arrays)]


def refuse_recurrent(spec: ModelCacheSpec) -> None:
    """Raise :class:`UnsupportedCacheError` when ``spec`` has a recurrent layer: the single-file layout
    holds positions, and a recurrent layer's state has none."""
    kinds = [i for i, l in enumerate(spec.layers) if l.kind == RECURRENT]
    if kinds:
        raise UnsupportedCacheError(
            f"the single-file cache layout (layout='file') cannot hold recurrent layers (layers {kinds[:8]} are "
            f"{RECURRENT!r}, mlx-lm ArraysCache): use the blocks layout (layout='blocks'), which keeps their snapshots")


def stored_tokens(layer: LayerSpec, total: int, stored_from: int | None = None) -> int:
    """Tokens a file holds for ``layer``: what it holds after ``total``, plus the
    positions from ``stored_from`` up to its window (see ``stored_from``)."""
    return sum(b - a for a, b in stored_ranges(layer, total, stored_from))


def layout(spec: ModelCacheSpec, total: int, stored_from: dict[str, int] | None = None) -> list[TensorSlot]:
    """Every tensor a file of ``total`` tokens holds, in file order (none when empty)."""
    slots = []
    stored_from = stored_from or {}
    per_group: dict[str, int] = {}  # every layer of a group holds the same tokens: count them once
    for i, layer in enumerate(spec.layers):
        if layer.kind == RECURRENT:  # its state after ``total`` tokens (prepare_save for the block layout)
            slots.extend(state_slots(layer, i) if total else [])
            continue
        held = per_group.get(layer.group)
        if held is None:
            held = per_group[layer.group] = stored_tokens(layer, total, stored_from.get(layer.group))
        if not held:
            continue
        for side, part, dtype, shape in _parts(layer, held):
            suffix = side if part is None else f"{side}.{QPARTS[part]}"
            slots.append(TensorSlot(f"layer.{i}.{suffix}", layer.group, i, side, part, dtype, shape))
    return slots


def _layer_meta(spec: ModelCacheSpec, total: int) -> list[dict]:
    """Per-layer cache type and meta, as mlx-lm would rebuild the cache."""
    out = []
    for l in spec.layers:
        held = l.tokens_held(total)
        out.append(
            {
                "cache": l.cache_kind,
                "offset": total,
                "window": l.window,
                "keep": l.keep,
                # rebuilt rotating caches are unrolled: the write index is the held count
                "ring_idx": l.ring_index(held),
                "bits": l.kv_bits,
                "group_size": l.kv_group_size,
            }
        )
    return out


# ---------------------------------------------------------------- header


@dataclass(frozen=True, slots=True)
class CacheFileInfo:
    """What a cache file's header says, checked against its layout and size
    (everything but the tensor checksums, which ``load`` verifies)."""

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
    hash_root: int | None = None     # the block-hash salt the cache was keyed with (absent: unsalted)
    stored_from: dict[str, int] = field(default_factory=dict)  # per sliding group: first stored position (v2)

    @property
    def total_tokens(self) -> int:
        return len(self.token_ids)


def canon(x: Any) -> str:
    """Canonical JSON, so that 1 != 1.0 != true when comparing header values."""
    return json.dumps(x, sort_keys=True, separators=(",", ":"))


def same_json(a: Any, b: Any) -> bool:
    """Whether two parsed JSON values are equal with 1, 1.0 and true all different
    (``canon(a) == canon(b)`` without serializing either: a third of the header's cost)."""
    if type(a) is not type(b):
        return False
    if type(a) is dict:
        return a.keys() == b.keys() and all(same_json(v, b[k]) for k, v in a.items())
    if type(a) is list:
        return len(a) == len(b) and all(map(same_json, a, b))
    return a == b


def header_bytes(doc: dict, slots: list[TensorSlot]) -> bytes:
    text = canon(doc)
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
    return {"dtype": ST_DTYPES[s.dtype][0], "shape": list(s.shape), "data_offsets": [offset, offset + s.nbytes]}


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
    doc, table = _parse_document(path, raw)
    return _verify_layout(path, doc, table, st, 8 + n)


def _parse_document(path: str, raw: bytes) -> tuple[dict, dict]:
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
    if version not in READABLE_VERSIONS or type(version) is not int:
        raise CacheCorruptError(
            path, f"unknown format version {version!r}; this build reads versions {list(READABLE_VERSIONS)}"
        )
    return doc, table


def _verify_layout(path: str, doc: dict, table: dict, st: os.stat_result, data_offset: int) -> CacheFileInfo:
    """The document's values, then the tensor table and file size against the layout they imply."""
    try:
        spec = ModelCacheSpec.from_dict(doc["spec"])
        tokens = doc["token_ids"]
        fingerprint, agent_id = doc["model_fingerprint"], doc["agent_id"]
        digests = doc["tensors"]
        versions = (doc["mlx"], doc["mlx_lm"])
        layers = doc["layers"]
    except (KeyError, TypeError, ValueError, CacheError) as exc:
        raise CacheCorruptError(path, f"malformed document ({type(exc).__name__}: {exc})") from None
    if spec.recurrent:  # never written: save refuses them (refuse_recurrent)
        raise CacheCorruptError(path, "a cache file of recurrent layers: the single-file layout never holds one")
    if not (isinstance(tokens, list) and set(map(type, tokens)) <= {int} and min(tokens, default=0) >= 0):
        raise CacheCorruptError(path, "token_ids must be a list of non-negative integers")
    if not isinstance(fingerprint, str) or not (agent_id is None or isinstance(agent_id, str)):
        raise CacheCorruptError(path, "model_fingerprint and agent_id must be strings")
    if not all(isinstance(v, str) for v in versions):
        raise CacheCorruptError(path, "mlx and mlx_lm versions must be strings")
    root = doc.get("hash_root")
    if root is not None and (type(root) is not int or not -(1 << 63) <= root < (1 << 63)):
        raise CacheCorruptError(path, "hash_root must be a signed 64-bit integer")
    if not same_json(layers, _layer_meta(spec, len(tokens))):
        raise CacheCorruptError(path, "per-layer cache meta does not match the spec and token count")
    stored_from = _check_stored_from(path, doc, spec, len(tokens))
    slots = layout(spec, len(tokens), stored_from)
    names = [s.name for s in slots]
    if not isinstance(digests, dict) or sorted(digests) != sorted(names):
        raise CacheCorruptError(path, "the document's checksums do not name the layout's tensors")
    if not all(isinstance(d, str) and len(d) == 32 for d in digests.values()):
        raise CacheCorruptError(path, f"checksums must be 32-digit {HASH} hex strings")
    expected, offset = {}, 0
    for s in slots:
        expected[s.name] = _entry(s, offset)
        offset += s.nbytes
    if not same_json(table, expected):  # one comparison; the loop below only names the difference
        for name, want in expected.items():
            if name not in table:
                raise CacheCorruptError(path, f"tensor {name} is missing")
            if canon(table[name]) != canon(want):
                raise CacheCorruptError(path, f"tensor {name}: header says {canon(table[name])}, the layout needs {canon(want)}")
        raise CacheCorruptError(path, f"unexpected tensors {sorted(set(table) - set(expected))[:3]}")
    if st.st_size != data_offset + offset:
        raise CacheCorruptError(
            path, f"file is {st.st_size} bytes but its header describes {data_offset + offset} (truncated or extended)"
        )
    return file_info(path, doc, spec, slots, st, data_offset)


def _check_stored_from(path: str, doc: dict, spec: ModelCacheSpec, total: int) -> dict[str, int]:
    """The document's ``stored_from`` (absent in version 1): sliding groups whose window
    is stored from an earlier position, each between the end of its kept tokens and its window."""
    raw = doc.get("stored_from")
    if raw is None:
        return {}
    if doc["format_version"] < 2 or not isinstance(raw, dict):
        raise CacheCorruptError(path, "stored_from must be an object, and only in format version 2")
    groups = spec.groups()
    for group, pos in raw.items():
        layer = spec.layers[groups[group][0]] if group in groups else None
        ranges = layer.held_ranges(total) if layer is not None and layer.windowed else []
        floor = ranges[0][1] if len(ranges) > 1 else 0
        if not ranges or type(pos) is not int or not floor <= pos < ranges[-1][0]:
            raise CacheCorruptError(path, f"stored_from {group!r}: {pos!r} is not a position before its window")
    return dict(raw)


def document(
    spec: ModelCacheSpec, token_ids, model_fingerprint: str, agent_id: str | None, digests: dict,
    hash_root: int | None = None, stored_from: dict[str, int] | None = None,
) -> dict:
    """The document a file of ``token_ids`` holds (``digests``: tensor name -> xxh3-128 hex).

    ``hash_root`` and ``stored_from`` are written only when set.
    """
    doc = {
        "format_version": FORMAT_VERSION,
        "model_fingerprint": model_fingerprint,
        "agent_id": agent_id,
        "spec": spec.to_dict(),
        "token_ids": list(token_ids),
        "layers": _layer_meta(spec, len(token_ids)),
        "hash": HASH,
        "tensors": digests,
        "mlx": compat.MLX_VERSION,
        "mlx_lm": compat.MLX_LM_VERSION,
    }
    if hash_root is not None:
        doc["hash_root"] = hash_root
    if stored_from:
        doc["stored_from"] = dict(stored_from)
    return doc


def file_info(
    path: str, doc: dict, spec: ModelCacheSpec, slots: list[TensorSlot], st: os.stat_result, data_offset: int
) -> CacheFileInfo:
    """The one place a :class:`CacheFileInfo` is made: from a checked (or just written) document."""
    return CacheFileInfo(
        path=path,
        format_version=doc["format_version"],
        model_fingerprint=doc["model_fingerprint"],
        agent_id=doc["agent_id"],
        spec=spec,
        token_ids=tuple(doc["token_ids"]),
        mlx_version=doc["mlx"],
        mlx_lm_version=doc["mlx_lm"],
        nbytes=st.st_size,
        data_offset=data_offset,
        slots=tuple(slots),
        digests=dict(doc["tensors"]),
        inode=(st.st_dev, st.st_ino),
        hash_root=doc.get("hash_root"),
        stored_from=dict(doc.get("stored_from", {})),
    )
