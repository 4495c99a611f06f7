"""The store on a disk that fills, turns read-only or vanishes: saves fail by name, nothing written is lost.

The read-only and full-filesystem cases use a real size-limited tmpfs
(``tests/fs_helpers``: root only, elsewhere skipped with the reason).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from semantic import AgentCacheStore, CacheSaveError
from semantic.store.diskhealth import DiskHealth
from tests.cache_helpers import assert_identical, make_executor, generate, history
from tests.fs_helpers import fill, remount, tmpfs

FP = "tiny-model"


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _store(executor, path, clock=None, layout="blocks"):
    store = AgentCacheStore(path, executor.spec, FP, 10**9, pool=executor.pool, durable=False, layout=layout)
    if clock is not None:  # the back-off on a clock the test moves
        store.health = DiskHealth(store.dir, clock=clock)
    return store


def _temps(path: Path) -> list[str]:
    return sorted(p.name for p in path.rglob(".*.tmp"))


@pytest.fixture
def executor(llama_tiny):
    return make_executor(llama_tiny, blocks=512)


@pytest.fixture
def caches(executor):
    return {a: generate(executor, a, history(n, seed=i), 4).blocks for i, (a, n) in enumerate((("a", 16), ("b", 60)))}


def test_a_save_the_disk_cannot_hold_is_refused_before_writing_and_older_files_still_load(executor, caches, tmp_path):
    store = _store(executor, tmp_path)
    store.save("a", caches["a"])
    before = sorted(p.name for p in tmp_path.iterdir())
    # the filesystem now has 1 MiB free of 10 GiB: less than the 5% reserve
    store.health._statvfs = lambda _p: SimpleNamespace(f_bavail=256, f_frsize=4096, f_blocks=10 * 262144)
    with pytest.raises(CacheSaveError) as err:
        store.save("b", caches["b"])
    assert err.value.kind == "disk_full" and not err.value.skipped
    assert sorted(p.name for p in tmp_path.iterdir()) == before and _temps(tmp_path) == []
    assert_identical(store.load("a"), caches["a"])
    stats = store.stats()
    assert stats.disk["state"] == "disk_full" and stats.disk["effective_budget_bytes"] == stats.disk_bytes
    with pytest.raises(CacheSaveError) as err:
        store.save("b", caches["b"])
    assert err.value.skipped  # backing off: not even checked again


def test_a_real_enospc_mid_write_leaves_the_old_file_whole_and_no_temporary_file(executor, caches):
    with tmpfs(2) as where:
        store = _store(executor, where / "cache", Clock())
        store.save("b", caches["a"])  # b's older, smaller cache
        filler = fill(where)
        store.health.room = lambda: None  # room unknown: the write itself must meet the full disk
        with pytest.raises(CacheSaveError) as err:
            store.save("b", caches["b"])
        assert err.value.kind == "disk_full" and _temps(where) == []
        assert_identical(store.load("b"), caches["a"])
        filler.unlink()
        store.health._clock.t += 60  # past the back-off
        store.save("b", caches["b"])
        assert store.stats().disk["state"] == "ok"
        assert_identical(store.load("b"), caches["b"])


def test_a_read_only_directory_still_serves_loads_and_saves_resume_when_it_is_writable(executor, caches):
    with tmpfs(16) as where:
        clock = Clock()
        store = _store(executor, where, clock)
        store.save("a", caches["a"])
        remount(where, "ro")
        try:
            with pytest.raises(CacheSaveError) as err:
                store.save("b", caches["b"])
            assert err.value.kind == "read_only"
            restarted = _store(executor, where)  # a restart onto the read-only directory: no error, loads work
            assert restarted.agents() == ["a"]
            assert_identical(restarted.load("a"), caches["a"])
        finally:
            remount(where, "rw")
        clock.t += 60
        store.save("b", caches["b"])
        assert store.agents() == ["a", "b"] and store.stats().disk["state"] == "ok"


def test_a_damaged_file_in_a_read_only_directory_is_refused_counted_and_left_in_place(executor, caches, llama_tiny):
    with tmpfs(16) as where:
        _store(executor, where, layout="file").save("b", caches["b"])
        store = _store(make_executor(llama_tiny, blocks=512), where, layout="file")  # a restart: no block of "b" is pooled
        path = next(where.glob("*.safetensors"))
        with open(path, "r+b") as f:  # the last tensor's last bytes: read by any load of "b"
            f.seek(-64, 2)
            tail = f.read()
            f.seek(-64, 2)
            f.write(bytes(x ^ 0x5A for x in tail))
        remount(where, "ro")
        try:
            assert store.load("b") is None
            assert path.exists() and store.agents() == []
            (q,) = store.quarantined
            assert not q.moved and q.original == str(path) and "checksum" in q.reason
            assert store.stats().quarantined == 1
        finally:
            remount(where, "rw")


def test_a_directory_that_cannot_be_made_at_startup_is_served_from_ram_and_indexed_once_it_can(executor, caches, tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory's parent should be")
    clock = Clock()
    store = AgentCacheStore(blocker / "cache", executor.spec, FP, 10**9, pool=executor.pool, durable=False)
    assert store.stats().disk["state"] == "missing" and store.agents() == []
    assert store.load("a") is None
    store.health = DiskHealth(store.dir, clock=clock)
    with pytest.raises(CacheSaveError) as err:
        store.save("a", caches["a"])
    assert err.value.kind == "missing"
    blocker.unlink()
    _store(executor, blocker / "cache").save("old", caches["a"])  # another process wrote meanwhile
    clock.t += 60
    store.save("b", caches["b"])
    assert store.agents() == ["b", "old"] and store.stats().disk["state"] == "ok"
    assert_identical(store.load("old"), caches["a"])


def test_a_directory_removed_mid_run_is_made_again_by_a_later_save(executor, caches, tmp_path):
    clock = Clock()
    store = _store(executor, tmp_path / "cache", clock)
    store.save("a", caches["a"])
    shutil.rmtree(tmp_path / "cache")
    with pytest.raises(CacheSaveError) as err:
        store.save("b", caches["b"])
    assert err.value.kind == "missing"
    assert store.load("a") is None  # its file went with the directory: a miss, forgotten
    clock.t += 60
    store.save("b", caches["b"])
    assert store.agents() == ["b"] and _temps(tmp_path) == []
