"""A cache directory read from outside the server: manifests, block files and single-file caches.

The store's default layout (``semantic serve --cache-layout blocks``)::

    <cache dir>/<slug>-<digest>.kvm          an agent's manifest: JSON {"semantic_kv_manifest": <document
                                             text>, "semantic_kv_xxh3_128": ...}; the document names the
                                             agent, its token ids and, per layer group, the extents
                                             [key hex, start, end] of the block files it uses
    <cache dir>/blocks-<12 hex>/<key>.kvb    block files, shared by every manifest that names them
    <cache dir>/<slug>-<digest>.safetensors  a cache file of the single-file layout (``--cache-layout file``)

Nothing here checks checksums or loads tensors (``semantic.store`` does): the harness only needs who
uses which file, and what tokens an agent's manifest holds. A manifest that does not parse reads as None.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from semantic.cachefile import SUFFIX as FILE_SUFFIX
from semantic.store.blockformat import BLOCK_SUFFIX
from semantic.store.manifest import DOC_KEY, MANIFEST_SUFFIX

BLOCKS_GLOB = "blocks-*"


@dataclass(frozen=True, slots=True)
class ManifestDoc:
    """What the harness reads from a manifest: its agent, its token ids, the block files it names."""

    path: Path
    agent_id: str
    token_ids: tuple[int, ...]
    blocks: frozenset[str]       # block file names (``<key hex>.kvb``)


def read_manifest(path: Path) -> ManifestDoc | None:
    """The manifest at ``path``, or None when it cannot be read or parsed (damaged, gone)."""
    try:
        doc = json.loads(json.loads(Path(path).read_bytes())[DOC_KEY])
        extents = doc["extents"]
        names = frozenset(str(row[0]) + BLOCK_SUFFIX for rows in extents.values() for row in rows)
        return ManifestDoc(Path(path), str(doc["agent_id"]), tuple(int(t) for t in doc["token_ids"]), names)
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError, RecursionError):
        return None


def manifests(cache_dir: Path) -> list[Path]:
    """The agents' manifests (not the quarantined ones, not temporaries)."""
    return sorted(p for p in cache_dir.glob("*" + MANIFEST_SUFFIX) if p.is_file())


def block_dirs(cache_dir: Path) -> list[Path]:
    return sorted(p for p in cache_dir.glob(BLOCKS_GLOB) if p.is_dir())


def block_files(cache_dir: Path) -> list[Path]:
    """The block files of every ``blocks-*`` folder (not temporaries)."""
    return sorted(p for d in block_dirs(cache_dir) for p in d.glob("*" + BLOCK_SUFFIX) if p.is_file())


def single_files(cache_dir: Path) -> list[Path]:
    """Cache files of the single-file layout."""
    return sorted(p for p in cache_dir.glob("*" + FILE_SUFFIX) if p.is_file())


def read_manifests(cache_dir: Path) -> list[ManifestDoc]:
    """Every manifest that parses."""
    return [m for m in (read_manifest(p) for p in manifests(cache_dir)) if m is not None]


def block_users(docs: list[ManifestDoc]) -> dict[str, set[str]]:
    """Block file name -> the agent ids whose manifests name it."""
    users: dict[str, set[str]] = {}
    for m in docs:
        for name in m.blocks:
            users.setdefault(name, set()).add(m.agent_id)
    return users


def header_end(path: Path) -> int | None:
    """Where a safetensors-framed file's tensors begin (8 + its header length), None when unreadable."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError:
        return None
    return 8 + struct.unpack("<Q", head)[0] if len(head) == 8 else None
