"""AgentCacheStore: files, the disk budget, restarts, quarantine, agent ids, threads.

The tests that name files pin down the single-file layout (``layout="file"``); those parametrized over
``LAYOUTS`` hold for both. The block layout's own tests are in test_store_blocks.py.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from semantic import (
    AgentCacheStore,
    CacheMismatchError,
    InvalidAgentIdError,
    ModelCacheSpec,
    PoolExhaustedError,
    Request,
)
from semantic import cachefile
from semantic.store import LAYOUTS, QUARANTINE_DIR, file_name
from tests.cache_helpers import assert_identical, check_executor, make_executor, generate, history, run

pytestmark = pytest.mark.compat

FP = "tiny-model"


def _store(executor, path, disk=10**9, layout="file", **kw):
    return AgentCacheStore(path, executor.spec, FP, disk, pool=executor.pool, durable=False, layout=layout, **kw)


def _files(path):
    return sorted(p.name for p in path.iterdir() if p.is_file())


@pytest.fixture
def executor(llama_tiny):
    return make_executor(llama_tiny, blocks=512)


@pytest.fixture
def caches(executor):
    """Three agents' caches of different lengths (20, 24, 28 tokens: the last generated one is never fed)."""
    return {a: generate(executor, a, history(n, seed=i), 5).blocks for i, (a, n) in enumerate((("a", 16), ("b", 20), ("c", 24)))}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("which,kv_bits", [("gemma", None), ("llama", 8)], ids=["gemma-window-wrapped", "quantized-8bit"])
def test_a_saved_cache_survives_a_restart_and_continues_like_a_fresh_prefill(
    llama_tiny, gemma_tiny, tmp_path, which, kv_bits, layout
):
    model = gemma_tiny if which == "gemma" else llama_tiny
    first = make_executor(model, kv_bits)
    done = generate(first, "agent-1", history(29), 5)
    _store(first, tmp_path, layout=layout).save("agent-1", done.blocks)

    after = make_executor(model, kv_bits)  # a new process: new pool, new store over the same directory
    store = _store(after, tmp_path, layout=layout)
    assert store.agents() == ["agent-1"]
    loaded = store.load("agent-1")
    assert_identical(loaded, done.blocks)
    assert (store.stats().disk_hits, store.stats().misses) == (1, 0)
    cont = after.submit(Request("agent-1", [*loaded.token_ids, *[3, 4]], 12), loaded, share=False)
    ref = after.submit(Request("ref", list(done.blocks.token_ids) + [3, 4], 12), share=False)
    out = run(after)
    assert out[cont].token_ids == out[ref].token_ids
    check_executor(after, out[cont], out[ref])  # both mlx-lm's own generation, within its measured noise


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_store_takes_no_reference_and_every_load_is_a_new_one_the_caller_owns(executor, caches, tmp_path, layout):
    store = _store(executor, tmp_path, layout=layout)
    store.save("a", caches["a"])
    refs = [executor.pool.refcount(b) for b in caches["a"].unique_blocks()]
    assert refs == [1] * len(refs)  # the caller's reference alone: the RAM tier is the scheduler's
    caches["a"].release()
    got = store.load("a")  # read from the file
    assert got is not None and got.total_tokens == 20
    got.release()
    again = store.load("a")
    assert again.total_tokens == 20 and not again.released
    s = store.stats()
    assert (s.disk_hits, s.misses, s.disk_agents) == (2, 0, 1)
    assert store.load("nobody") is None and store.stats().misses == 1


def test_the_disk_tier_deletes_the_least_recently_used_files(executor, caches, tmp_path):
    sizes = {a: os.path.getsize(cachefile.save(tmp_path / "probe", caches[a], model_fingerprint=FP).path) for a in "abc"}
    os.unlink(tmp_path / "probe")
    store = _store(executor, tmp_path, disk=sizes["a"] + sizes["c"] + sizes["b"] // 2)
    store.save("a", caches["a"])
    store.save("b", caches["b"])
    assert store.load("a") is not None  # now "b" is the least recently used
    store.save("c", caches["c"])
    assert store.agents() == ["a", "c"]
    assert _files(tmp_path) == sorted([file_name("a"), file_name("c")])
    assert store.stats().disk_evictions == 1
    assert store.load("b") is None


def test_the_file_just_saved_is_kept_even_over_the_disk_budget(executor, caches, tmp_path):
    store = _store(executor, tmp_path, disk=1)
    store.save("a", caches["a"])
    store.save("b", caches["b"])
    assert store.agents() == ["b"] and _files(tmp_path) == [file_name("b")]


def test_a_restart_orders_agents_by_file_age_and_trims_to_the_budget(executor, caches, tmp_path):
    store = _store(executor, tmp_path)
    for i, a in enumerate("abc"):
        store.save(a, caches[a])
        os.utime(tmp_path / file_name(a), ns=(10**18 + i, 10**18 + i))
    os.utime(tmp_path / file_name("a"), ns=(2 * 10**18, 2 * 10**18))  # "a" used last
    budget = sum(os.path.getsize(tmp_path / file_name(a)) for a in "ac")
    again = _store(executor, tmp_path, disk=budget)
    assert again.agents() == ["a", "c"] and again.stats().disk_evictions == 1


def test_startup_cleans_leftover_temporary_files_and_keeps_a_live_writers(executor, caches, tmp_path):
    dead = tmp_path / ".x.safetensors.999999999.0123abcd.tmp"
    ours_old = tmp_path / f".y.safetensors.{os.getpid()}.0123abcd.tmp"
    live = tmp_path / f".z.safetensors.{os.getppid()}.0123abcd.tmp"
    for p in (dead, ours_old, live):
        p.write_bytes(b"partial")
    os.utime(ours_old, ns=(1, 1))  # from before this process started
    store = _store(executor, tmp_path)
    assert sorted(store.cleaned) == sorted([str(dead), str(ours_old)])
    assert _files(tmp_path) == [live.name]


def test_corrupt_files_are_quarantined_and_reported_not_fatal(executor, caches, tmp_path):
    store = _store(executor, tmp_path)
    for a in "abc":
        store.save(a, caches[a])
    (tmp_path / file_name("a")).write_bytes(b"\x10\0\0\0\0\0\0\0{not json at all}")
    renamed = tmp_path / file_name("b")
    renamed.rename(tmp_path / file_name("someone-else"))
    again = _store(executor, tmp_path)
    assert again.agents() == ["c"]
    reasons = {os.path.basename(q.original): q.reason for q in again.quarantined}
    assert "not JSON" in reasons[file_name("a")]
    assert "does not match its agent id 'b'" in reasons[file_name("someone-else")]
    assert sorted(p.name.rsplit(".", 1)[0] for p in (tmp_path / QUARANTINE_DIR).iterdir()) == sorted(reasons)
    assert again.stats().quarantined == 2


def test_a_file_damaged_after_startup_is_quarantined_on_load_and_is_a_miss(executor, caches, tmp_path, llama_tiny):
    _store(executor, tmp_path).save("a", caches["a"])
    fresh = make_executor(llama_tiny)  # a pool without a's blocks: a pooled block would be shared, not read
    store = _store(fresh, tmp_path)
    path = tmp_path / file_name("a")
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 1
    path.write_bytes(bytes(raw))
    assert store.load("a") is None
    assert store.agents() == [] and store.stats().misses == 1
    assert "checksum mismatch" in store.quarantined[0].reason
    assert fresh.pool.stats().used == 0


def test_files_of_another_model_are_left_alone(executor, caches, tmp_path):
    cachefile.save(tmp_path / file_name("a"), caches["a"], model_fingerprint="other-model", agent_id="a")
    store = _store(executor, tmp_path)
    assert store.agents() == [] and store.foreign == [str(tmp_path / file_name("a"))]
    assert _files(tmp_path) == [file_name("a")]


def test_delete_forgets_an_agent_and_its_file(executor, caches, tmp_path):
    store = _store(executor, tmp_path)
    store.save("a", caches["a"])
    assert store.delete("a") is True and store.delete("a") is False
    assert store.agents() == [] and _files(tmp_path) == [] and store.load("a") is None
    assert store.stats().disk_bytes == 0


NASTY_IDS = [
    "../x", "../../etc/passwd", "/etc/passwd", "/tmp/abs", "a/b", "a\\b", "..", ".", "~", "$HOME", "C:\\x",
    "con", "NUL", "Agent", "agent", "ünïcödé 🤖", "x" * 256, " spaced ", "-rf", ".hidden", "a.safetensors",
]


def test_agent_ids_map_to_file_names_inside_the_cache_dir(executor, caches, tmp_path):
    root = tmp_path / "cache"
    store = _store(executor, root)
    for a in NASTY_IDS:
        store.save(a, caches["a"])
    names = {file_name(a) for a in NASTY_IDS}
    assert len(names) == len(NASTY_IDS)  # "Agent" and "agent" too: distinct also on case-insensitive disks
    assert _files(root) == sorted(names)
    assert [p.name for p in tmp_path.iterdir()] == ["cache"]  # nothing beside or above it
    assert all("/" not in n and "\\" not in n and not n.startswith(".") for n in names)
    again = _store(executor, root)
    assert again.agents() == sorted(NASTY_IDS)
    assert again.load("../x").token_ids == caches["a"].token_ids


@pytest.mark.parametrize("bad", ["", "a\0b", "line\nbreak", "x" * 257, "\ud800", None, 7, b"bytes"])
def test_unusable_agent_ids_raise_and_write_nothing(executor, caches, tmp_path, bad):
    store = _store(executor, tmp_path)
    for call in (lambda: store.save(bad, caches["a"]), lambda: store.load(bad), lambda: store.delete(bad)):
        with pytest.raises(InvalidAgentIdError):
            call()
    assert _files(tmp_path) == []


def test_caches_of_another_spec_or_pool_are_refused(executor, caches, tmp_path, gemma_tiny):
    store = _store(executor, tmp_path)
    other = generate(make_executor(gemma_tiny), "g", [1, 2, 3], 1).blocks
    with pytest.raises(CacheMismatchError, match="another cache spec"):
        store.save("g", other)
    foreign_pool = generate(make_executor(executor.model), "f", [1, 2, 3], 1).blocks
    with pytest.raises(CacheMismatchError, match="not live in this store's pool"):
        store.save("f", foreign_pool)
    assert _files(tmp_path) == [] and store.agents() == []
    with pytest.raises(ValueError, match="budgets"):
        _store(executor, tmp_path, disk=-1)


def test_a_load_into_a_full_pool_is_refused_the_file_stays_and_loads_once_there_is_room(llama_tiny, tmp_path):
    elsewhere = make_executor(llama_tiny)
    c = generate(elsewhere, "c", history(26, seed=3), 2).blocks  # 28 tokens: 7 blocks of 4
    cachefile.save(tmp_path / file_name("c"), c, model_fingerprint=FP, agent_id="c")
    executor = make_executor(llama_tiny, blocks=16)
    store = _store(executor, tmp_path)
    held = [generate(executor, name, history(26, seed=seed), 2).blocks for name, seed in (("a", 1), ("b", 2))]
    assert executor.pool.stats().used == 14  # the caller (the scheduler's RAM tier) holds a and b
    with pytest.raises(PoolExhaustedError):
        store.load("c")  # needs 7 blocks, 2 are free: making room is the scheduler's decision
    assert store.agents() == ["c"] and executor.pool.stats().used == 14
    held[0].release()  # the caller evicts a
    loaded = store.load("c")
    assert_identical(loaded, c)
    s = store.stats()
    assert (s.disk_hits, s.disk_agents) == (1, 1)


def test_threads_on_different_agents_overlap_and_on_the_same_agent_serialize(executor, caches, tmp_path, monkeypatch):
    store = _store(executor, tmp_path)
    in_flight: dict[str, int] = {}
    peak = {"same": 0, "all": 0}
    guard = threading.Lock()
    overlapped = threading.Event()
    real_save = cachefile.save

    def slow_save(path, blocks, **kw):
        agent = kw["agent_id"]
        with guard:
            in_flight[agent] = in_flight.get(agent, 0) + 1
            peak["same"] = max(peak["same"], in_flight[agent])
            peak["all"] = max(peak["all"], sum(in_flight.values()))
            if peak["all"] >= 2:
                overlapped.set()
        # held until another agent's save runs beside it, however the threads are scheduled (if saves of
        # different agents were serialized, that never happens: each save gives up after the ceiling)
        overlapped.wait(10)
        try:
            return real_save(path, blocks, **kw)
        finally:
            with guard:
                in_flight[agent] -= 1

    monkeypatch.setattr(cachefile, "save", slow_save)
    errors = []

    def worker(agent, seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(12):
                if rng.random() < 0.5:
                    store.save(agent, caches[agent])
                else:
                    got = store.load(agent)
                    if got is not None:
                        assert got.token_ids == caches[agent].token_ids
                        got.release()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(a, i)) for i, a in enumerate("abcabc")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert peak["same"] == 1 and peak["all"] >= 2
    for a in "abc":
        assert store.load(a).token_ids == caches[a].token_ids
    for b in caches.values():
        b.release()
    assert executor.pool.stats().used == 0  # every reference the store took was given back


def test_an_executor_pool_spec_mismatch_is_refused(executor, tmp_path, gemma_tiny):
    with pytest.raises(CacheMismatchError):
        AgentCacheStore(tmp_path, ModelCacheSpec.from_model(gemma_tiny), FP, 1, pool=executor.pool)
    with pytest.raises(ValueError, match="model_fingerprint"):
        AgentCacheStore(tmp_path, executor.spec, "", 1, pool=executor.pool)
