"""Block files: tokens ``[start, end)`` of one 256-token block of one layer group, written once.

A block file is named by what it holds, so any agent whose history holds the
same tokens before ``end`` (under the same tenant salt) can use it::

    blocks-<model digest>/<key>.kvb     key = hash(link, start - block start, group)
                                        link = hash(parent, tokens[block start : end])
                                        parent = the chain key of the block before (or the salt root)

Most block files hold a whole block. A turn that ends mid-block writes the
part it added (``start`` after the block start); the next turn adds the
next part, so no byte is ever written twice::

    block 13          [3328 ............................................ 3584)
    turn 1 writes     [3328 ..... 3410)
    turn 2 writes                      [3410 ......... 3533)
    turn 3 writes                                        [3533 ........... 3584)  then block 14 ...

A history may use any prefix of a block file's tokens: the K/V at a position
depend only on the tokens before it, which ``parent`` and the file's
``token_ids`` (from the block start) pin down. Layout, as a cache file
(``cachefile.fileformat``: safetensors, readable without this package)::

    8 bytes | header JSON (tensor table, __metadata__: the document and its xxh3-128) | tensors
    "layer.<i>.keys" / "layer.<i>.values" (quantized: .packed .scales .biases): (1, heads, end - start, dim)

The document holds the format, model fingerprint, the group's layer specs,
``parent``, the block start, ``start``, ``end``, the token ids from the
block start to ``end``, and an xxh3-128 per tensor. Reading checks all of
it; a file that fails is :class:`CacheCorruptError`.

A *snapshot* file (format version 2, ``"snapshot": true``) holds a group that
resumes only from a snapshot (``LayerSpec.snapshot_only``: a recurrent group,
a window shorter than a block) as its whole cache after ``end`` tokens, not
positions: ``start`` is the block start (``blockclaim.snapshot_span``) and its
tokens run from there to ``end``, but only a history whose tokens match all
of them serves from it (never a prefix)::

    key = hash(hash(parent, tokens[block start : end]), (), "snapshot:" + group)
    "layer.<i>.state.<j>"                 a recurrent layer's arrays: (1, *shape), the spec's dtypes
    "layer.<i>.keys" / "layer.<i>.values" a short window: (1, heads, tokens_held(end), dim), temporal order

Positional files are still written as version 1, so builds from before
snapshots read them; those builds leave snapshot files alone (a newer format).
"""

from __future__ import annotations

import functools
import json
import os
import struct
from dataclasses import dataclass, field

import xxhash

from semantic import compat
from semantic.cachefile import atomic
from semantic.cachefile.fileformat import (
    DOC_HASH_KEY,
    DOC_KEY,
    MAX_HEADER_BYTES,
    TensorSlot,
    _entry,
    _parts,
    QPARTS,
    canon,
    header_bytes,
    state_slots,
)
from semantic.errors import CacheCorruptError, CacheFormatError
from semantic.cache.pool import chain_hash
from semantic.cache.spec import RECURRENT, ModelCacheSpec

BLOCK_FORMAT = "semantic-kv-block"
BLOCK_VERSION = 2        # the newest format this build reads: 2 is a snapshot file
POSITIONAL_VERSION = 1   # what a positional block file is written as (readable by builds before snapshots)
SNAPSHOT_VERSION = 2
DIR_VERSION = 1          # the block folder's name: snapshot files live beside the positional files of version 1
BLOCK_SUFFIX = ".kvb"


def block_key(parent: int | None, block_tokens_to_end, offset: int, group: str) -> int:
    """The content key of a block file: tokens from its block's start to its end under ``parent``,
    its first position's offset in the block, and the group."""
    return chain_hash(chain_hash(parent, block_tokens_to_end), (offset,), group)


def snapshot_key(parent: int | None, block_tokens_to_end, group: str) -> int:
    """The content key of a snapshot file: the group's cache after the tokens from its block's start to
    its end under ``parent`` (never the key of a positional file of the same tokens)."""
    return chain_hash(chain_hash(parent, block_tokens_to_end), (), "snapshot:" + group)


def key_name(key: int) -> str:
    """A block file's name for ``key``: 16 hex digits."""
    return f"{key & 0xFFFFFFFFFFFFFFFF:016x}{BLOCK_SUFFIX}"


def key_of_name(name: str) -> int | None:
    """The key a block file's name spells, or None for any other name."""
    if not name.endswith(BLOCK_SUFFIX) or len(name) != 16 + len(BLOCK_SUFFIX):
        return None
    try:
        u = int(name[:16], 16)
    except ValueError:
        return None
    return u - (1 << 64) if u >= 1 << 63 else u


def block_slots(spec: ModelCacheSpec, group: str, n: int) -> list[TensorSlot]:
    """The tensors of a block file of ``n`` tokens of ``group``, in file order."""
    slots = []
    for i in spec.groups()[group]:
        for side, part, dtype, shape in _parts(spec.layers[i], n):
            suffix = side if part is None else f"{side}.{QPARTS[part]}"
            slots.append(TensorSlot(f"layer.{i}.{suffix}", group, i, side, part, dtype, shape))
    return slots


def snapshot_slots(spec: ModelCacheSpec, group: str, end: int) -> list[TensorSlot]:
    """The tensors of a snapshot file of ``group`` after ``end`` tokens, in file order: a recurrent
    layer's arrays, or a short window's ``tokens_held(end)`` tokens."""
    slots = []
    for i in spec.groups()[group]:
        layer = spec.layers[i]
        if layer.kind == RECURRENT:
            slots.extend(state_slots(layer, i))
            continue
        for side, part, dtype, shape in _parts(layer, layer.tokens_held(end)):
            suffix = side if part is None else f"{side}.{QPARTS[part]}"
            slots.append(TensorSlot(f"layer.{i}.{suffix}", group, i, side, part, dtype, shape))
    return slots


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """What a block file's header says (checked against its layout and size; ``read`` checks the tensors)."""

    key: int
    path: str
    group: str
    parent: int | None
    block_start: int
    start: int
    end: int
    token_ids: tuple[int, ...]   # from block_start to end
    nbytes: int
    slots: tuple[TensorSlot, ...] = field(repr=False)
    digests: dict[str, str] = field(repr=False)
    snapshot: bool = False       # the group's whole cache after ``end`` tokens (see the module doc)

    def usable_end(self, tokens, parent: int | None, upto: int) -> int:
        """How far (at most ``upto``) a history whose block starting here holds ``tokens``
        (from the block start) under ``parent`` may use this file: ``start`` when not at all.
        A snapshot serves all its tokens or none."""
        if parent != self.parent:
            return self.start
        if self.snapshot:
            n = self.end - self.block_start
            ok = upto >= self.end and len(tokens) >= n and tuple(tokens[:n]) == self.token_ids
            return self.end if ok else self.start
        n = min(upto, self.end) - self.block_start
        mine = self.token_ids
        k = 0
        while k < n and mine[k] == tokens[k]:
            k += 1
        return max(self.start, min(self.block_start + k, upto, self.end))


def _document(spec: ModelCacheSpec, fingerprint: str, group: str, parent, block_start, start, end, tokens, digests,
              snapshot: bool = False):
    doc = {
        "format": BLOCK_FORMAT,
        "format_version": SNAPSHOT_VERSION if snapshot else POSITIONAL_VERSION,
        "model_fingerprint": fingerprint,
        "group": group,
        "layers": [_layer_dict(spec, i) for i in spec.groups()[group]],
        "parent": parent,
        "block_start": block_start,
        "start": start,
        "end": end,
        "token_ids": list(tokens),
        "tensors": digests,
        "mlx": compat.MLX_VERSION,
        "mlx_lm": compat.MLX_LM_VERSION,
    }
    if snapshot:
        doc["snapshot"] = True
    return doc


def _layer_dict(spec: ModelCacheSpec, i: int) -> dict:
    return {"index": i, **spec.layers[i].to_dict()}


def write(
    path: str, spec: ModelCacheSpec, fingerprint: str, group: str, parent: int | None, block_start: int,
    start: int, tokens: tuple[int, ...], chunks: list[list[memoryview]], durable: bool, snapshot: bool = False,
) -> BlockInfo:
    """Write a block file of ``tokens`` (from ``block_start``; the file holds ``[start, end)``, or with
    ``snapshot`` the group's cache after ``end``, ``start`` the block start) with the tensors' bytes
    ``chunks`` (file order, one list per slot); crash-safe, not yet durable in its directory (the
    caller fsyncs the directory once for all its files)."""
    end = block_start + len(tokens)
    if snapshot:
        assert start == block_start, (start, block_start)
        key, slots = snapshot_key(parent, tokens, group), snapshot_slots(spec, group, end)
    else:
        key, slots = block_key(parent, tokens, start - block_start, group), block_slots(spec, group, end - start)
    assert os.path.basename(path) == key_name(key), (path, key)
    assert len(chunks) == len(slots)
    doc = _document(spec, fingerprint, group, parent, block_start, start, end, tokens, {s.name: "0" * 32 for s in slots},
                    snapshot)

    def header(digests: list[str]) -> bytes:
        doc["tensors"] = {s.name: d for s, d in zip(slots, digests)}
        return header_bytes(doc, slots)

    st, _ = atomic.write(path, header_bytes(doc, slots), chunks, header, durable, sync_dir=False)
    return BlockInfo(key, path, group, parent, block_start, start, end, tuple(tokens), st.st_size, tuple(slots),
                     dict(doc["tensors"]), snapshot)


def read_header(path: str, spec: ModelCacheSpec, fingerprint: str) -> BlockInfo:
    """Read and check a block file's header (not its tensors).

    Raises:
        CacheCorruptError: damaged, not a block file, or of another model or spec (named in the reason).
        OSError: the file cannot be opened.
    """
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise CacheCorruptError(path, f"truncated: {size} bytes, no header length")
        (n,) = struct.unpack("<Q", head)
        if not 2 <= n <= min(MAX_HEADER_BYTES, size - 8):
            raise CacheCorruptError(path, f"header length {n} does not fit a file of {size} bytes")
        raw = f.read(n)
    if len(raw) != n:
        raise CacheCorruptError(path, f"truncated header: {len(raw)} of {n} bytes")
    doc, table = _parse(path, raw)
    return _check(path, doc, table, spec, fingerprint, size, 8 + n)


def _parse(path: str, raw: bytes) -> tuple[dict, dict]:
    try:
        table = json.loads(raw)
        meta = table.pop("__metadata__")
        text = meta[DOC_KEY]
        ok = meta.get(DOC_HASH_KEY) == xxhash.xxh3_128(text.encode()).hexdigest()
    except (ValueError, RecursionError, KeyError, TypeError, AttributeError, UnicodeEncodeError) as exc:
        raise CacheCorruptError(path, f"not a block file header ({type(exc).__name__})") from None
    if not ok:
        raise CacheCorruptError(path, "document checksum mismatch")
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):
        raise CacheCorruptError(path, "document is not JSON") from None
    if not isinstance(doc, dict) or doc.get("format") != BLOCK_FORMAT:
        raise CacheCorruptError(path, "not a semantic-kv block file")
    version = doc.get("format_version")
    if type(version) is int and version > BLOCK_VERSION:
        raise CacheFormatError(f"{path} is a version {version} block file, written by a newer semantic; this build "
                               f"reads version {BLOCK_VERSION}: left alone")
    if version not in (POSITIONAL_VERSION, SNAPSHOT_VERSION) or type(version) is not int:
        raise CacheCorruptError(path, f"block format version {doc.get('format_version')!r}; this build reads "
                                      f"{POSITIONAL_VERSION} and {SNAPSHOT_VERSION}")
    # version 1 is positional (no "snapshot"); version 2 says it is a snapshot
    if doc.get("snapshot", None) is not (True if version == SNAPSHOT_VERSION else None):
        raise CacheCorruptError(path, f"a version {version} block file with snapshot {doc.get('snapshot')!r}")
    return doc, table


def _check(path: str, doc: dict, table: dict, spec: ModelCacheSpec, fingerprint: str, size: int, data_offset: int) -> BlockInfo:
    try:
        group, parent, bs, start, end = doc["group"], doc["parent"], doc["block_start"], doc["start"], doc["end"]
        tokens, digests, fp, layers = doc["token_ids"], doc["tensors"], doc["model_fingerprint"], doc["layers"]
    except (KeyError, TypeError) as exc:
        raise CacheCorruptError(path, f"malformed block document ({type(exc).__name__}: {exc})") from None
    if fp != fingerprint:
        raise CacheCorruptError(path, f"a block of model {fp!r}, not {fingerprint!r}")
    if not isinstance(group, str) or group not in spec.groups():
        raise CacheCorruptError(path, f"group {group!r} is not one of this spec's")
    if canon(layers) != _expected(spec, group, 0)[0]:
        raise CacheCorruptError(path, "the block's layer specs are not this model's")
    ints = (bs, start, end)
    if not all(type(v) is int for v in ints) or not 0 <= bs <= start < end or parent is not None and type(parent) is not int:
        raise CacheCorruptError(path, f"bad positions {ints} or parent {parent!r}")
    if not (isinstance(tokens, list) and len(tokens) == end - bs and all(type(t) is int and t >= 0 for t in tokens)):
        raise CacheCorruptError(path, "token_ids must be the block's non-negative ids from its start to its end")
    snapshot = doc.get("snapshot") is True
    if snapshot and start != bs:
        raise CacheCorruptError(path, f"a snapshot starts at its block start {bs}, not {start}")
    _, expected, offset, slots, names = _expected(spec, group, end if snapshot else end - start, snapshot)
    if canon(table) != expected or data_offset + offset != size:
        raise CacheCorruptError(path, f"tensor table or size ({size} bytes) does not match the block's layout")
    if not isinstance(digests, dict) or sorted(digests) != names:
        raise CacheCorruptError(path, "the document's checksums do not name the layout's tensors")
    key = key_of_name(os.path.basename(path))
    want = snapshot_key(parent, tokens, group) if snapshot else block_key(parent, tokens, start - bs, group)
    if key is None or key != want:
        raise CacheCorruptError(path, "the file's name is not the key of what it holds")
    return BlockInfo(key, path, group, parent, bs, start, end, tuple(tokens), size, slots, dict(digests), snapshot)


@functools.lru_cache(maxsize=1024)
def _expected(spec: ModelCacheSpec, group: str, n: int, snapshot: bool = False
              ) -> tuple[str, str, int, tuple[TensorSlot, ...], list[str]]:
    """What a block file of ``n`` tokens of ``group`` (a snapshot: after ``n`` tokens) must say, computed
    once per shape (a startup scan reads every block file's header): its layer specs and tensor table as
    canonical JSON (``canon``: 1, 1.0 and true differ), its tensors' bytes, slots and sorted names."""
    slots = tuple(snapshot_slots(spec, group, n) if snapshot else block_slots(spec, group, n))
    table, offset = {}, 0
    for s in slots:
        table[s.name] = _entry(s, offset)
        offset += s.nbytes
    return canon([_layer_dict(spec, i) for i in spec.groups()[group]]), canon(table), offset, slots, sorted(table)
