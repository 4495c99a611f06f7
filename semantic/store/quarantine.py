"""Cache files the store refused: set aside in ``quarantine/``, and the list of them.

A file that fails its checks (a header or checksum that does not verify, or a name that is not its
agent id's) is never loaded and never deleted: it is moved to ``quarantine/`` under a fresh name, for
people to look at. In a directory that cannot be written it stays where it is, still refused (the
index forgets it) and still listed, so a read-only disk loses no evidence.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path

from semantic.cachefile import atomic

log = logging.getLogger(__package__)  # the store's one logger: its lines keep the name they had

QUARANTINE_DIR = "quarantine"


@dataclass(frozen=True, slots=True)
class Quarantined:
    """A cache file set aside because it failed its checks: moved to ``quarantine/``, or, in a directory
    that cannot be written, left in place (``path == original``) and no longer indexed."""

    path: str       # where it is now
    original: str   # where it was
    reason: str

    @property
    def moved(self) -> bool:
        return self.path != self.original


class Quarantine:
    """The files refused in one cache directory.

    Args:
        directory: the cache directory; refused files go to its ``quarantine/``.
        lock: the store's lock, which guards ``refused``.
    """

    def __init__(self, directory: Path, lock: threading.Lock):
        self.dir = directory / QUARANTINE_DIR
        self.lock = lock
        self.refused: list[Quarantined] = []  # guarded by lock

    def set_aside(self, path: Path, reason: str) -> None:
        """Move ``path`` to ``quarantine/`` (left in place where it cannot be moved) and list it.

        Args:
            path: the refused cache file.
            reason: what is wrong with it.
        """
        try:
            dest = atomic.quarantine(path, self.dir)
        except OSError as exc:  # a read-only directory: left in place, not indexed, still refused and counted
            log.warning("cannot quarantine %s (%s): %s; left in place", path, reason, exc)
            with self.lock:
                self.refused.append(Quarantined(str(path), str(path), reason))
            return
        if dest is None:
            return
        log.warning("quarantined %s -> %s: %s", path, dest, reason)
        with self.lock:
            self.refused.append(Quarantined(str(dest), str(path), reason))
