"""The cache directory's state for saves: room, failure kinds, the back-off, one log line per kind."""

from __future__ import annotations

import errno
import logging
from types import SimpleNamespace

import pytest

from semantic.store.diskhealth import DiskHealth, kind_of
from semantic.errors import CacheSaveError

MB = 1 << 20


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def disk(free_mb: float, size_mb: float = 100):
    """A statvfs of a filesystem of ``size_mb`` with ``free_mb`` free, in 4 KiB blocks."""
    return lambda _path: SimpleNamespace(f_bavail=int(free_mb * MB) // 4096, f_frsize=4096,
                                         f_blocks=int(size_mb * MB) // 4096)


def health(tmp_path, free_mb=50.0, clock=None) -> DiskHealth:
    return DiskHealth(tmp_path, statvfs=disk(free_mb), clock=clock or Clock())


@pytest.mark.parametrize("code, kind", [(errno.ENOSPC, "disk_full"), (errno.EDQUOT, "disk_full"),
                                        (errno.EROFS, "read_only"), (errno.EACCES, "read_only"),
                                        (errno.ENOENT, "missing"), (errno.EIO, "io")])
def test_an_oserror_is_named_by_its_cause(code, kind):
    assert kind_of(OSError(code, "x")) == kind


def test_a_save_larger_than_the_free_space_less_the_reserve_is_refused_before_it_is_tried(tmp_path):
    h = health(tmp_path, free_mb=10)  # 5% of 100 MB is kept in reserve: 5 MB may be taken
    h.check(5 * MB)
    with pytest.raises(CacheSaveError) as err:
        h.check(5 * MB + 1)
    assert err.value.kind == "disk_full" and not err.value.skipped and h.state == "disk_full"
    assert "reserve" in str(err.value)


def test_after_a_failure_saves_are_skipped_for_a_back_off_that_doubles_and_resets_on_success(tmp_path):
    clock = Clock()
    h = health(tmp_path, clock=clock)
    h.failed(OSError(errno.EROFS, "Read-only file system"))
    waits = []
    for _ in range(6):
        with pytest.raises(CacheSaveError) as err:
            h.check(1)
        assert err.value.skipped and err.value.kind == "read_only"
        waits.append(h.snapshot()["retry_in_s"])
        clock.t += waits[-1]
        h.check(1)  # the wait is over: tried (and it fails again)
        h.failed(OSError(errno.EROFS, "Read-only file system"))
    assert waits == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert h.skipped == 6 and h.errors["read_only"] == 13
    h.ok()
    assert h.state == "ok" and h.snapshot()["retry_in_s"] == 0.0
    h.check(1)
    h.failed(OSError(errno.EROFS, "Read-only file system"))
    assert h.snapshot()["retry_in_s"] == 1.0  # a new streak starts from the first wait


def test_each_kind_of_failure_is_logged_once_while_it_lasts_and_recovery_once(tmp_path, caplog):
    clock = Clock()
    h = health(tmp_path, clock=clock)
    with caplog.at_level(logging.INFO, logger="semantic.store.diskhealth"):
        for _ in range(20):
            h.failed(OSError(errno.ENOSPC, "No space left on device"))
            clock.t += 30
        h.failed(OSError(errno.ENOENT, "No such file or directory"))
        h.ok()
        h.ok()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines
    assert "disk is full" in lines[0] and "gone" in lines[1] and "saving again" in lines[2]


def test_an_unreadable_directory_has_no_room_figure_and_the_snapshot_says_so(tmp_path):
    def gone(_path):
        raise FileNotFoundError(errno.ENOENT, "No such file or directory")

    h = DiskHealth(tmp_path / "nope", statvfs=gone)
    h.check(10**12)  # nothing known about the room: the write itself will say
    snap = h.snapshot()
    assert snap["free_bytes"] is None and snap["state"] == "ok"
