"""Whether the cache directory takes a save now: the room left on its disk, its last failure, a back-off.

The store asks before each save and reports after it::

    check(nbytes) ─ backing off after a failure ─► CacheSaveError(kind, skipped)  not tried, counted
                  ─ room() < nbytes               ─► CacheSaveError("disk_full")   not tried
    write ─ OSError ─► failed(exc): its kind; retry after 1 s, doubling to 10 s; one log line per kind
          ─ done    ─► ok(): "ok" again (one log line when it was not)

``room()`` is the free space less a reserve (5% of the filesystem), re-read
(``statvfs``) at every check, so it follows what other programs write. A
full disk stops new saves; it never deletes older caches to make room: their
agents still resume from them. Plain state: the caller serializes calls
(the store's lock).
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections import Counter
from pathlib import Path
from typing import Callable

from semantic.errors import CacheSaveError

log = logging.getLogger(__name__)

RESERVE_SHARE = 0.05      # of the filesystem, never taken by cache files
BACKOFF_S = (1.0, 10.0)   # the first wait after a failure, and the longest

KINDS = ("disk_full", "read_only", "missing", "io")
_KIND_OF = {
    errno.ENOSPC: "disk_full", errno.EDQUOT: "disk_full", errno.EFBIG: "disk_full",
    errno.EROFS: "read_only", errno.EACCES: "read_only", errno.EPERM: "read_only",
    errno.ENOENT: "missing", errno.ENOTDIR: "missing",
}
_SAYS = {
    "disk_full": "the disk is full",
    "read_only": "the cache directory is not writable",
    "missing": "the cache directory is gone",
    "io": "writing failed",
}


def kind_of(exc: OSError) -> str:
    """The failure kind of an OSError from writing a cache file."""
    return _KIND_OF.get(exc.errno, "io")


class DiskHealth:
    """The cache directory's state for saves (see the module doc).

    Args:
        directory: where cache files go.
        reserve_share: of the filesystem's size, left free.
        clock, statvfs: injected by tests.
    """

    def __init__(self, directory: Path, *, reserve_share: float = RESERVE_SHARE,
                 backoff_s: tuple[float, float] = BACKOFF_S, clock: Callable[[], float] = time.monotonic,
                 statvfs: Callable = os.statvfs):
        self.dir, self.reserve_share, self.backoff_s = Path(directory), reserve_share, backoff_s
        self._clock, self._statvfs = clock, statvfs
        self.state = "ok"
        self.reason: str | None = None   # the last failure's message, while not ok
        self._since = clock()
        self._retry_at = 0.0
        self._delay = backoff_s[0]
        self.errors: Counter[str] = Counter()  # failed saves by kind (tried or not)
        self.skipped = 0                        # saves not tried while backing off

    def room(self) -> tuple[int, int] | None:
        """(free bytes, bytes a save may take: free less the reserve), or None when the directory cannot be read."""
        try:
            st = self._statvfs(self.dir)
        except OSError:
            return None
        free = st.f_bavail * st.f_frsize
        reserve = int(st.f_blocks * st.f_frsize * self.reserve_share)
        return free, max(0, free - reserve)

    def check(self, nbytes: int) -> None:
        """Raise CacheSaveError when a save of ``nbytes`` should not be tried now."""
        now = self._clock()
        if self.state != "ok" and now < self._retry_at:
            self.skipped += 1
            self.errors[self.state] += 1
            raise CacheSaveError(self.state, f"not saved: {_SAYS[self.state]} ({self.reason}); next try in "
                                             f"{self._retry_at - now:.1f} s", skipped=True)
        room = self.room()
        if room is not None and nbytes > room[1]:
            raise self._fail("disk_full", f"{nbytes} bytes do not fit: {room[0]} bytes free, "
                                          f"{room[0] - room[1]} of them kept in reserve")

    def failed(self, exc: OSError) -> CacheSaveError:
        """Record a write that raised ``exc``; returns the error to raise."""
        return self._fail(kind_of(exc), f"{exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else ""))

    def ok(self) -> None:
        """A save was written: the directory takes saves again."""
        if self.state != "ok":
            log.info("cache dir %s: saving again (%s for %.0f s)", self.dir, _SAYS[self.state],
                     self._clock() - self._since)
            self.state, self.reason, self._since = "ok", None, self._clock()
        self._delay = self.backoff_s[0]

    def snapshot(self) -> dict:
        """The state for stats: what it is, for how long, when saves are tried again, and the counts."""
        now = self._clock()
        room = self.room()
        return {
            "state": self.state, "reason": self.reason, "state_s": round(now - self._since, 1),
            "retry_in_s": round(max(0.0, self._retry_at - now), 1) if self.state != "ok" else 0.0,
            "free_bytes": room[0] if room else None, "room_bytes": room[1] if room else None,
            "errors_by_kind": {k: self.errors[k] for k in KINDS if self.errors[k]}, "skipped": self.skipped,
        }

    def _fail(self, kind: str, reason: str) -> CacheSaveError:
        now = self._clock()
        if kind != self.state:  # one line when a kind of failure starts, not one per turn
            log.warning("cache dir %s: %s (%s); caches stay in RAM, saves are retried from %.0f s on",
                        self.dir, _SAYS[kind], reason, self._delay)
            self.state, self._since = kind, now
        else:
            self._delay = min(self._delay * 2, self.backoff_s[1])
        self.reason = reason
        self._retry_at = now + self._delay
        self.errors[kind] += 1
        return CacheSaveError(kind, f"not saved: {_SAYS[kind]} ({reason})")
