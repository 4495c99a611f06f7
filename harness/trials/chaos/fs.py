"""The cache filesystem the soak owns: a size-limited tmpfs it mounts, fills, makes read-only and unmounts.

Mounting needs root (``mount -t tmpfs``); without it :func:`mount_tmpfs` returns the reason and the
run keeps a plain folder, skipping the faults that need the mount (disk full, read-only). Corrupting
a file (a manifest, a block file, or a single-file cache: :mod:`harness.storefiles`) needs nothing but
the folder.
"""

from __future__ import annotations

import errno
import os
import subprocess
import time
from pathlib import Path

import numpy as np

from harness import storefiles
from semantic.store.manifest import MANIFEST_SUFFIX

FILLER = "filler.bin"
CHUNK = 1 << 20


def _mount(*args: str) -> tuple[bool, str]:
    try:
        done = subprocess.run(["mount", *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"{type(exc).__name__}: {exc}"
    return done.returncode == 0, (done.stderr or done.stdout).strip()


def mount_tmpfs(where: Path, size_mb: int) -> str | None:
    """Mount a ``size_mb`` tmpfs on ``where`` (created); None when mounted, else why not."""
    where.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return "not root: cannot mount a tmpfs"
    ok, msg = _mount("-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(where))
    return None if ok else f"mount -t tmpfs failed: {msg}"


def unmount(where: Path, attempts: int = 20) -> str | None:
    """Unmount ``where`` (retrying while busy, then lazily); None when done, else the error."""
    msg = ""
    for _ in range(attempts):
        try:
            done = subprocess.run(["umount", str(where)], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"{type(exc).__name__}: {exc}"
        if done.returncode == 0:
            return None
        msg = done.stderr.strip()
        time.sleep(0.5)
    subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)
    return f"umount: {msg} (unmounted lazily)"


def remount(where: Path, mode: str, attempts: int = 50) -> tuple[bool, int, str]:
    """``mount -o remount,<mode>``: (done, attempts used, last message). A remount to ``ro`` fails
    while a file is open for writing (a save in progress), so it is retried."""
    msg = ""
    for i in range(1, attempts + 1):
        ok, msg = _mount("-o", f"remount,{mode}", str(where))
        if ok:
            return True, i, ""
        time.sleep(0.1)
    return False, attempts, msg


def fill(where: Path) -> int:
    """Write ``where/filler.bin`` until the filesystem says ENOSPC; returns the bytes written."""
    written = 0
    block = b"\xa5" * CHUNK
    with open(where / FILLER, "wb", buffering=0) as f:
        while True:
            try:
                written += f.write(block)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                # fill the last partial chunk too: page by page
                for _ in range(CHUNK // 4096):
                    try:
                        written += f.write(block[:4096])
                    except OSError:
                        break
                return written


def free(where: Path) -> None:
    (where / FILLER).unlink(missing_ok=True)


def cache_files(cache_dir: Path) -> list[Path]:
    """The agents' cache files: manifests, block files, single-file caches (not the quarantined ones, not
    temporaries)."""
    return storefiles.manifests(cache_dir) + storefiles.block_files(cache_dir) + storefiles.single_files(cache_dir)


def temp_files(cache_dir: Path) -> list[str]:
    """Writers' temporary files left in the cache folder or its block folders (``.<name>.<pid>.<hex>.tmp``),
    as paths relative to the cache folder."""
    found = [p for d in (cache_dir, *storefiles.block_dirs(cache_dir)) for p in d.glob(".*.tmp")]
    return sorted(str(p.relative_to(cache_dir)) for p in found)


def quarantined_files(cache_dir: Path) -> list[str]:
    q = cache_dir / "quarantine"
    return sorted(p.name for p in q.iterdir()) if q.is_dir() else []


def corrupt(path: Path, rng: np.random.Generator) -> dict:
    """Damage a cache file: truncate it to a random share, or overwrite random bytes past its first KiB.

    Returns:
        What was done: ``{"file", "mode", "size", ...}``; a flip in a block or single-file cache also says
        whether it hit the header (``region``: "header", found by any scan) or only tensor bytes ("data",
        found when the file is read).
    """
    size = path.stat().st_size
    header_end = storefiles.header_end(path) if path.suffix != MANIFEST_SUFFIX else None
    if rng.random() < 0.5 or size < 8192:
        keep = int(size * rng.uniform(0.1, 0.9))
        os.truncate(path, keep)
        return {"file": path.name, "mode": "truncate", "size": size, "kept": keep}
    offsets = sorted(int(x) for x in rng.integers(1024, size - 64, 8))
    with open(path, "r+b") as f:
        for off in offsets:
            f.seek(off)
            old = f.read(64)
            f.seek(off)
            f.write(bytes(b ^ 0x5A for b in old))
        f.flush()
        os.fsync(f.fileno())
    done = {"file": path.name, "mode": "flip", "size": size, "offsets": offsets}
    if header_end is not None:
        done["region"] = "header" if offsets[0] < header_end else "data"
    return done
