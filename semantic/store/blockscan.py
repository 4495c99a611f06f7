"""What a cache directory of the block layout holds at startup, and cache files of the old layout.

The scan indexes the block files (a file whose header fails is quarantined), then the manifests (one
that fails is quarantined; one of another model, spec or block size is left in place as foreign; one of
a newer build is left alone and counted), then the old layout's cache files (indexed until their first
load converts them), and deletes the block files no manifest names.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path

from semantic import cachefile
from semantic.cache.blocks import AgentBlocks
from semantic.cachefile import atomic
from semantic.errors import CacheCorruptError, CacheFormatError, CacheMismatchError, InvalidAgentIdError
from semantic.cache.pool import BlockPool
from semantic.store import blockformat, manifest
from semantic.store.blockformat import BLOCK_SUFFIX
from semantic.store.agentindex import EXTRA_SUFFIX, file_name
from semantic.store.blockindex import Held
from semantic.store.manifest import MANIFEST_SUFFIX, manifest_name

log = logging.getLogger(__package__)


def scan(files) -> None:
    """Index the block files and manifests (and cache files still to convert), delete the block files
    no manifest names; raises OSError when the directory cannot be created or listed."""
    files.dir.mkdir(parents=True, exist_ok=True)
    files.cleaned.extend(atomic.remove_abandoned(files.dir))
    with files.lock:  # a directory made again: the files it lost are no longer there to share
        for info in [i for i in files.index.infos.values() if not os.path.exists(i.path)]:
            files.index.drop(info.key)
    if files.blocks_dir.is_dir():
        files.cleaned.extend(atomic.remove_abandoned(files.blocks_dir))
        _scan_blocks(files)
    found = _scan_manifests(files) + _scan_cache_files(files)
    with files.lock:
        for mtime_ns, agent_id, held in sorted(found, key=lambda x: (x[0], x[1]), reverse=True):
            if agent_id in files.entries:
                continue
            files.entries[agent_id] = held
            files.entries.move_to_end(agent_id, last=False)
            files.index.reference(set(held.keys), set())
            files.versions.setdefault(agent_id, mtime_ns)
    files.collect()
    files.scanned = True


def _scan_blocks(files) -> None:
    for path in sorted(files.blocks_dir.iterdir()):
        if not path.name.endswith(BLOCK_SUFFIX):
            continue
        try:
            info = blockformat.read_header(str(path), files.spec, files.fingerprint)
        except CacheCorruptError as exc:
            files.quarantine.set_aside(path, exc.reason)
            continue
        except CacheFormatError as exc:
            log.error("%s", exc)
            files.newer.append(str(path))
            continue
        except OSError as exc:
            log.warning("skipping unreadable block file %s: %s", path, exc)
            continue
        with files.lock:
            files.index.add(info)


def _scan_manifests(files) -> list[tuple[int, str, Held]]:
    found = []
    for path in sorted(files.dir.glob("*" + MANIFEST_SUFFIX)):
        try:
            m = manifest.read(str(path), files.spec, files.fingerprint, files.bt)
        except CacheCorruptError as exc:
            files.quarantine.set_aside(path, exc.reason)
            continue
        except CacheFormatError as exc:
            log.error("%s", exc)
            files.newer.append(str(path))
            _hold_newer(files, path)
            continue
        except CacheMismatchError:
            files.foreign.append(str(path))
            continue
        except OSError as exc:
            log.warning("skipping unreadable manifest %s: %s", path, exc)
            continue
        if not _named_for(path.name, m.agent_id, manifest_name):
            files.quarantine.set_aside(path, f"file name does not match its agent id {m.agent_id!r}")
            continue
        if m.extra is not None:
            files.extras.setdefault(m.agent_id, m.extra)
        found.append((path.stat().st_mtime_ns, m.agent_id, Held(path, m.nbytes, frozenset(m.keys()))))
    return found


def _scan_cache_files(files) -> list[tuple[int, str, Held]]:
    """Cache files of the single-file layout: indexed until their first load converts them (one whose
    agent already has a manifest was converted by a process that died before deleting it)."""
    found = []
    for path in sorted(files.dir.glob("*" + cachefile.SUFFIX)):
        try:
            info = cachefile.read_header(path)
        except CacheCorruptError as exc:
            files.quarantine.set_aside(path, exc.reason)
            continue
        except OSError:
            continue
        if info.model_fingerprint != files.fingerprint or info.spec != files.spec:
            files.foreign.append(str(path))
            continue
        if not _named_for(path.name, info.agent_id, file_name):
            files.quarantine.set_aside(path, f"file name does not match its agent id {info.agent_id!r}")
            continue
        mtime = path.stat().st_mtime_ns
        try:  # converted already (the converter died before deleting it), unless saved since by the file layout
            converted = (files.dir / manifest_name(info.agent_id)).stat().st_mtime_ns >= mtime
        except OSError:
            converted = False
        if converted:
            with contextlib.suppress(OSError):
                atomic.unlink_quietly(path)
            continue
        found.append((mtime, info.agent_id, Held(path, info.nbytes, legacy=True)))
    return found


def convert(files, agent_id: str, held: Held, pool: BlockPool, pool_lock) -> AgentBlocks | None:
    """Load a single-file cache, then save it as block files and a manifest and delete the file."""
    try:
        blocks = cachefile.load(held.path, pool, model_fingerprint=files.fingerprint, lock=pool_lock)
    except CacheCorruptError as exc:
        files.forget(agent_id)
        files.quarantine.set_aside(held.path, exc.reason)
        return None
    except (CacheMismatchError, OSError) as exc:
        log.warning("agent %r: cannot load %s: %s", agent_id, held.path, exc)
        files.forget(agent_id)
        return None
    extra = read_json(str(held.path) + EXTRA_SUFFIX)
    with files.lock:
        files.hits += 1
        if extra is not None:
            files.extras.setdefault(agent_id, extra)
    try:
        with pool_lock:
            prepared = cachefile.prepare_save(blocks)
        new = files.write(agent_id, blocks, prepared)
    except (OSError, CacheMismatchError) as exc:  # a full or read-only disk: converted on a later save
        log.warning("agent %r: its cache file stays in the single-file layout for now: %s", agent_id, exc)
        return blocks
    with files.lock:
        files.put(agent_id, new, files.versions.get(agent_id))
    with contextlib.suppress(OSError):
        atomic.unlink_quietly(held.path)
        atomic.unlink_quietly(str(held.path) + EXTRA_SUFFIX)
    log.info("agent %r: converted %s to block files", agent_id, held.path.name)
    return blocks


def _hold_newer(files, path: Path) -> None:
    """Keep the block files a newer build's manifest names (its extents, if it still lists them as this
    build does; else no block file is collected while it is here)."""
    try:
        doc = json.loads(json.loads(path.read_bytes())[manifest.DOC_KEY])
        keys = {manifest.unhex(row[0]) for rows in doc["extents"].values() for row in rows}
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError):
        files.hold_all = True
        return
    with files.lock:
        files.index.reference(keys, set())


def _named_for(name: str, agent_id, namer) -> bool:
    try:
        return namer(agent_id) == name
    except InvalidAgentIdError:
        return False


def read_json(path: str) -> dict | None:
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None
