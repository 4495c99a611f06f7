"""An agent's manifest: the small file that names the block files its cache is made of.

::

    <slug>-<digest>.kvm     JSON {"semantic_kv_manifest": <document>, "semantic_kv_xxh3_128": <its checksum>}

    document   format_version 3, model fingerprint, cache spec, agent id, block size,
               the exact token ids, the salt root, per sliding group where its buffer starts
               (``stored_from``, as cache files have it), the extra note (the echo), and
               per group the extents that cover the positions the group holds, in order:

    "global":  [[key, 0, 256], [key, 256, 512], [key, 512, 600], [key, 600, 623]]
                 block file      block file      turn 1's part    turn 2's part

An extent ``[key, a, b)`` uses positions ``a..b`` of the block file ``key``
(any part of it: a history may use a prefix of another's block). A group that
resumes only from a snapshot (``LayerSpec.snapshot_only``) has one extent per
snapshot the cache carries, ``[key, s, t]``: the snapshot file of its cache
after ``t`` tokens, ``s`` the block start before ``t`` (``blockclaim.snapshot_span``),
ends ascending, the last after all ``T`` tokens (the earlier ones: where a
regenerate, or a client that re-renders the reply, resumes); such groups are
listed in ``"snapshots"``. A manifest without that list was written before
snapshots: a short window's extents there are positional, and its window is
assembled from them on load::

    "snapshots": ["sliding-w128-k0"]
    "sliding-w128-k0": [[key, 512, 597], [key, 512, 600]]   the window after 597 and after 600 tokens

The
manifest is written after its block files are durable, atomically (temp,
fsync, rename, fsync the directory), so a crash leaves the old manifest or
the new one. A manifest of a newer format is refused with
:class:`CacheFormatError` and left alone; one of another model, spec or
block size is left in place (``foreign``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import xxhash

from semantic import cachefile, compat
from semantic.cache.blockclaim import snapshot_span, stored_ranges
from semantic.cachefile import atomic
from semantic.errors import CacheCorruptError, CacheFormatError, CacheMismatchError
from semantic.cache.spec import RECURRENT, ModelCacheSpec
from semantic.store.agentindex import file_name

MANIFEST_SUFFIX = ".kvm"
MANIFEST_VERSION = 4  # cache files were versions 1 and 2: one number line for the store's layouts
# a manifest without snapshot groups is still written as version 3, which builds before snapshots read;
# one with them is 4, which those builds leave alone as newer instead of refusing its snapshot extents
PLAIN_VERSION = 3
DOC_KEY = "semantic_kv_manifest"
HASH_KEY = "semantic_kv_xxh3_128"
MAX_MANIFEST_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Extent:
    """Positions ``[start, end)`` of the block file ``key``, in one block."""

    key: int
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class Manifest:
    agent_id: str
    model_fingerprint: str
    spec: ModelCacheSpec
    block_tokens: int
    token_ids: tuple[int, ...]
    hash_root: int | None
    stored_from: dict[str, int]
    extents: dict[str, tuple[Extent, ...]]
    extra: dict | None = None
    nbytes: int = field(default=0, compare=False)
    snapshots: frozenset[str] = frozenset()  # groups whose extents are snapshot files (the last: after T)


    @property
    def total_tokens(self) -> int:
        return len(self.token_ids)

    def keys(self) -> set[int]:
        """The block files this manifest uses."""
        return {e.key for extents in self.extents.values() for e in extents}


def manifest_name(agent_id: str) -> str:
    """The manifest's file name for ``agent_id`` (the cache file's name, another suffix)."""
    return file_name(agent_id)[: -len(cachefile.SUFFIX)] + MANIFEST_SUFFIX


def _hex(key: int) -> str:
    return f"{key & 0xFFFFFFFFFFFFFFFF:016x}"


def unhex(text: str) -> int:
    u = int(text, 16)
    if len(text) != 16 or not 0 <= u < 1 << 64:
        raise ValueError("a key is 16 hex digits")
    return u - (1 << 64) if u >= 1 << 63 else u


def encode(m: Manifest) -> bytes:
    doc = {
        "format_version": MANIFEST_VERSION if m.snapshots else PLAIN_VERSION,
        "model_fingerprint": m.model_fingerprint,
        "agent_id": m.agent_id,
        "spec": m.spec.to_dict(),
        "block_tokens": m.block_tokens,
        "token_ids": list(m.token_ids),
        "hash_root": m.hash_root,
        "stored_from": dict(m.stored_from),
        "extents": {g: [[_hex(e.key), e.start, e.end] for e in ex] for g, ex in m.extents.items()},
        "extra": m.extra,
        "mlx": compat.MLX_VERSION,
        "mlx_lm": compat.MLX_LM_VERSION,
    }
    if m.snapshots:
        doc["snapshots"] = sorted(m.snapshots)
    text = json.dumps(doc, separators=(",", ":"))
    return json.dumps({DOC_KEY: text, HASH_KEY: xxhash.xxh3_128(text.encode()).hexdigest()}).encode()


def write(path: str, m: Manifest, durable: bool) -> int:
    """Write the manifest atomically (durable: fsynced, and its directory); its size in bytes."""
    data = encode(m)
    tmp = atomic.temp_name(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        atomic.unlink_quietly(tmp)
        raise
    if durable:
        atomic.fsync_path(os.path.dirname(os.path.abspath(path)))
    return len(data)


def parse(path: str, data: bytes, spec: ModelCacheSpec, fingerprint: str, block_tokens: int) -> Manifest:
    """A manifest's bytes, checked against themselves, this model, spec and block size.

    Raises:
        CacheCorruptError: damaged, or not a manifest.
        CacheFormatError: written by a newer build.
        CacheMismatchError: another model's, spec's or block size's (left alone).
    """
    try:
        outer = json.loads(data)
        text = outer[DOC_KEY]
        ok = outer.get(HASH_KEY) == xxhash.xxh3_128(text.encode()).hexdigest()
        doc = json.loads(text) if ok else None
    except (ValueError, RecursionError, KeyError, TypeError, AttributeError, UnicodeEncodeError) as exc:
        raise CacheCorruptError(path, f"not a manifest ({type(exc).__name__})") from None
    if not ok:
        raise CacheCorruptError(path, "manifest checksum mismatch")
    if not isinstance(doc, dict):
        raise CacheCorruptError(path, "the manifest's document is not a JSON object")
    version = doc.get("format_version")
    if type(version) is int and version > MANIFEST_VERSION:
        raise CacheFormatError(
            f"{path} is a version {version} manifest, written by a newer semantic; this build reads version "
            f"{MANIFEST_VERSION}: run the newer build, or give this one another --cache-dir")
    if version not in (PLAIN_VERSION, MANIFEST_VERSION) or type(version) is not int:
        raise CacheCorruptError(path, f"unknown manifest version {version!r}")
    try:
        return _fields(path, doc, spec, fingerprint, block_tokens, len(data))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CacheCorruptError(path, f"malformed manifest ({type(exc).__name__}: {exc})") from None


def _fields(path, doc, spec, fingerprint, block_tokens, nbytes) -> Manifest:
    theirs = ModelCacheSpec.from_dict(doc["spec"])
    if doc["model_fingerprint"] != fingerprint or theirs != spec or doc["block_tokens"] != block_tokens:
        raise CacheMismatchError(f"{path} belongs to another model, cache spec or block size")
    tokens, agent_id, root = doc["token_ids"], doc["agent_id"], doc["hash_root"]
    if not (isinstance(tokens, list) and all(type(t) is int and t >= 0 for t in tokens)):
        raise ValueError("token_ids must be non-negative integers")
    if not isinstance(agent_id, str) or root is not None and type(root) is not int:
        raise ValueError("agent_id must be a string, hash_root an integer or null")
    stored_from = doc["stored_from"]
    if not isinstance(stored_from, dict) or not all(type(v) is int for v in stored_from.values()):
        raise ValueError("stored_from must map groups to positions")
    snapshots = _snapshots(path, doc, spec, block_tokens)
    extents = {}
    for g, layers in spec.groups().items():
        rows = doc["extents"].get(g, [])
        extents[g] = tuple(Extent(unhex(k), a, b) for k, a, b in rows)
        if g in snapshots:
            if g in stored_from:
                raise CacheCorruptError(path, f"stored_from names the snapshot group {g!r}")
            _check_snapshot(path, len(tokens), extents[g], block_tokens)
        else:
            _check_cover(path, spec.layers[layers[0]], len(tokens), stored_from.get(g), extents[g], block_tokens)
    extra = doc.get("extra")
    return Manifest(agent_id, fingerprint, spec, block_tokens, tuple(tokens), root, dict(stored_from), extents,
                    extra if isinstance(extra, dict) else None, nbytes, snapshots)


def _snapshots(path, doc, spec: ModelCacheSpec, block_tokens: int) -> frozenset[str]:
    """The document's snapshot groups: every snapshot-only group, or (a manifest written before snapshots)
    none, which only a short window's positional extents can be."""
    raw = doc.get("snapshots")
    want = spec.snapshot_groups(block_tokens)
    if raw is None:
        recurrent = [g for g in want if spec.layers[spec.groups()[g][0]].kind == RECURRENT]
        if recurrent:
            raise CacheCorruptError(path, f"the recurrent group {recurrent[0]!r} has no snapshot")
        return frozenset()
    if not isinstance(raw, list) or not all(isinstance(g, str) for g in raw) or set(raw) != want or len(raw) != len(want):
        raise CacheCorruptError(path, f"snapshots {raw!r}: this spec's snapshot groups are {sorted(want)}")
    return want


def _check_snapshot(path, total: int, extents, bt: int) -> None:
    """A snapshot group's extents: one per snapshot, each spanning the last block start before its end to it,
    ends ascending, the last after all ``total`` tokens (none when empty)."""
    have = [(e.start, e.end) for e in extents]
    ends = [b for _, b in have]
    ok = (all(type(a) is int and type(b) is int and 0 < b <= total for a, b in have) and ends == sorted(set(ends))
          and all(span == snapshot_span(b, bt) for span, b in zip(have, ends)))
    if not (ok and ends[-1:] == ([total] if total else [])):
        raise CacheCorruptError(path, f"a snapshot group's extents are {have[:3]}, a snapshot after {total} tokens "
                                      f"is {[snapshot_span(total, bt)] if total else []} (after earlier ones)")


def _check_cover(path, layer, total, stored_from, extents, bt) -> None:
    """The extents cover exactly what the group's buffer holds, in order, each within one block."""
    try:
        want = stored_ranges(layer, total, stored_from)
    except AssertionError:
        raise CacheCorruptError(path, f"stored_from {stored_from} does not fit {total} tokens") from None
    have, pos = [], None
    for e in extents:
        if not (type(e.start) is int and type(e.end) is int and 0 <= e.start < e.end and e.start // bt == (e.end - 1) // bt):
            raise CacheCorruptError(path, f"extent [{e.start}, {e.end}) is not inside one block")
        if pos == e.start:
            have[-1] = (have[-1][0], e.end)
        else:
            have.append((e.start, e.end))
        pos = e.end
    if have != [(a, b) for a, b in want if b > a]:
        raise CacheCorruptError(path, f"the extents cover {have[:3]}..., the group holds {want[:3]}...")


def read(path: str, spec: ModelCacheSpec, fingerprint: str, block_tokens: int) -> Manifest:
    """Read and check the manifest at ``path`` (see :func:`parse`); OSError when it cannot be read."""
    with open(path, "rb") as f:
        data = f.read(MAX_MANIFEST_BYTES + 1)
    if len(data) > MAX_MANIFEST_BYTES:
        raise CacheCorruptError(path, "larger than any manifest")
    return parse(path, data, spec, fingerprint, block_tokens)
