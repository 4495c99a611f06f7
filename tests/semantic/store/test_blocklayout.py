"""The block layout (``AgentCacheStore(..., layout="blocks")``): block files written once, a manifest per agent.

What a turn writes, sharing a prompt on disk, collection, quarantine of one shared block, old cache
files converted, newer and foreign manifests, loads served from the pool, and the extra note. Crashes
are in test_store_blocks_crash.py, threads in test_store_blocks_threads.py, and mutated files in
test_store_blocks_fuzz.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import xxhash

from semantic import AgentCacheStore, Request, cachefile
from semantic.cachefile import DOC_HASH_KEY, DOC_KEY, atomic
from semantic.store import blockformat, blocklayout, blockload, blockread, file_name, manifest, manifest_name
from tests.cache_helpers import assert_identical, check_executor, make_executor, generate, history, run

pytestmark = pytest.mark.compat

FP = "tiny-model"
SYSTEM = history(12, seed=5)  # three full blocks of 4 tokens


def _store(executor, path, layout="blocks", fp=FP, disk=10**9):
    return AgentCacheStore(path, executor.spec, fp, disk, pool=executor.pool, durable=False, layout=layout)


def _kvbs(path: Path) -> dict[str, tuple[int, int, int]]:
    """Every block file: name -> (inode, mtime, size)."""
    return {p.name: (s.st_ino, s.st_mtime_ns, s.st_size) for p in path.glob("blocks-*/*.kvb") for s in [p.stat()]}


def _infos(path: Path, spec) -> dict[str, blockformat.BlockInfo]:
    return {p.name: blockformat.read_header(str(p), spec, FP) for p in path.glob("blocks-*/*.kvb")}


def _manifest(path: Path, spec, agent: str) -> manifest.Manifest:
    return manifest.read(str(path / manifest_name(agent)), spec, FP, 4)


def _names(m: manifest.Manifest) -> set[str]:
    return {blockformat.key_name(k) for k in m.keys()}


def _tensor_bytes(path: str) -> int:
    raw = Path(path).read_bytes()
    return len(raw) - 8 - int.from_bytes(raw[:8], "little")


def _turn(executor, agent, blocks, new_tokens, max_tokens=1):
    uid = executor.submit(Request(agent, [*blocks.token_ids, *new_tokens], max_tokens), blocks, share=False)
    return run(executor)[uid].blocks


def _continues_like_a_fresh_prefill(executor, loaded, tokens):
    """A turn on ``tokens`` from ``loaded`` (all of them, or a prefix: the rest is prefilled); its cache."""
    assert tuple(tokens[: loaded.total_tokens]) == loaded.token_ids
    cont = executor.submit(Request("cont", [*tokens, 3, 4], 6), loaded, share=False)
    ref = executor.submit(Request("ref", [*tokens, 3, 4], 6), share=False)
    out = run(executor)
    assert out[cont].token_ids == out[ref].token_ids
    check_executor(executor, out[cont], out[ref])  # both mlx-lm's own generation, within its measured noise
    return out[cont].blocks


def _shared(executor, n=3):
    """Agents "a", "b", "c"... on SYSTEM and their own tokens (the engine shares the pooled prompt)."""
    return {a: generate(executor, a, [*SYSTEM, *history(5 + i, seed=i)], 2).blocks for i, a in enumerate("abc"[:n])}


def _rechecksum(path: Path, edit) -> None:
    outer = json.loads(path.read_bytes())
    doc = json.loads(outer[manifest.DOC_KEY])
    edit(doc)
    text = json.dumps(doc, separators=(",", ":"))
    path.write_bytes(json.dumps({manifest.DOC_KEY: text, manifest.HASH_KEY: xxhash.xxh3_128(text.encode()).hexdigest()}).encode())


# ---------------------------------------------------------------- what a turn writes


@pytest.mark.parametrize("which,kv_bits,n,add", [
    ("llama", None, 30, 7), ("llama", None, 29, 2), ("gemma", None, 30, 7), ("llama", 8, 30, 7),
], ids=["across-blocks", "within-a-block", "gemma-window-wrapped", "quantized-8bit"])
def test_a_turn_writes_only_the_positions_it_added_and_its_manifest(llama_tiny, gemma_tiny, tmp_path, which, kv_bits, n, add):
    model = gemma_tiny if which == "gemma" else llama_tiny
    executor = make_executor(model, kv_bits)
    first = generate(executor, "a", history(n), 1).blocks  # n tokens: the generated one is never fed
    store = _store(executor, tmp_path)
    store.save("a", first)
    before, written = _kvbs(tmp_path), store.stats().written_bytes
    second = _turn(executor, "a", first, history(add, seed=99))
    assert second.total_tokens == n + add
    store.save("a", second)

    after = _kvbs(tmp_path)
    assert all(after[k] == before[k] for k in before.keys() & after.keys())  # no block file written twice
    # a global history keeps every file; a sliding window leaves the files behind it, collected
    assert store.stats().collected == len(before.keys() - after.keys()) == (2 if which == "gemma" else 0)
    assert store.on_disk("a")[0] == n + add
    new = {k: i for k, i in _infos(tmp_path, executor.spec).items() if k not in before}
    kvm = (tmp_path / manifest_name("a")).stat().st_size
    assert store.stats().written_bytes - written == sum(i.nbytes for i in new.values()) + kvm
    for group, layers in executor.spec.groups().items():
        mine = sorted((i.start, i.end) for i in new.values() if i.group == group)
        assert mine[0][0] == n and mine[-1][1] == n + add and all(a[1] == b[0] for a, b in zip(mine, mine[1:]))
        row = sum(executor.spec.layers[i].token_bytes() for i in layers)
        assert sum(_tensor_bytes(i.path) for i in new.values() if i.group == group) == add * row

    assert_identical(_store(make_executor(model, kv_bits), tmp_path).load("a"), second)  # old and new files, stitched


def test_a_save_lets_go_of_its_views_once_its_bytes_are_written_before_making_them_durable(llama_tiny, tmp_path,
                                                                                          monkeypatch):
    # the views pin the pool's buffers (MLX copies a buffer anything else views at a turn's first write):
    # held through the fsyncs, the next turn would wait for the disk or copy its cache
    executor = make_executor(llama_tiny)
    first = generate(executor, "a", history(30), 1).blocks
    store = AgentCacheStore(tmp_path, executor.spec, FP, 10**9, pool=executor.pool, durable=True, layout="blocks")
    prepared = cachefile.prepare_save(first)
    events, fsync = [], atomic.fsync_file
    monkeypatch.setattr(atomic, "fsync_file", lambda p: (events.append(("fsync", prepared.released)), fsync(p)))
    store.save("a", first, prepared, bytes_out=lambda: events.append(("out", prepared.released)))
    assert events[0] == ("out", True) and len(events) == 1 + len(_kvbs(tmp_path))
    assert all(e == ("fsync", True) for e in events[1:])
    assert_identical(_store(make_executor(llama_tiny), tmp_path).load("a"), first)


# ---------------------------------------------------------------- sharing


def test_agents_on_a_shared_prompt_store_its_blocks_once_and_each_continues_like_a_fresh_prefill(llama_tiny, tmp_path):
    executor = make_executor(llama_tiny)
    caches = _shared(executor)
    store = _store(executor, tmp_path)
    for a, c in caches.items():
        store.save(a, c)
    ms = {a: _manifest(tmp_path, executor.spec, a) for a in caches}
    prompt = {a: [e.key for e in m.extents["global"] if e.end <= 12] for a, m in ms.items()}
    assert len(prompt["a"]) == 3 and prompt["a"] == prompt["b"] == prompt["c"]
    infos = _infos(tmp_path, executor.spec)
    assert sum(1 for i in infos.values() if i.end <= 12) == 3  # the prompt's files, once
    s = store.stats()
    assert s.disk_shared_bytes == sum(infos[blockformat.key_name(k)].nbytes for k in prompt["a"]) > 0
    manifests = sum(p.stat().st_size for p in tmp_path.glob("*.kvm"))
    assert s.disk_bytes == s.disk_shared_bytes + s.disk_unique_bytes == sum(i.nbytes for i in infos.values()) + manifests
    assert s.disk_block_files == len(infos)

    after = make_executor(llama_tiny)  # a restart: a new pool, the same directory
    again = _store(after, tmp_path)
    for a, c in caches.items():
        loaded = again.load(a)
        assert_identical(loaded, c)
        _continues_like_a_fresh_prefill(after, loaded, c.token_ids)


def test_a_history_ending_mid_block_uses_a_prefix_of_another_agents_partial_block_file(llama_tiny, tmp_path):
    executor = make_executor(llama_tiny)
    prompt = history(10, seed=8)
    # each cache holds its prompt and every generated token but the last (never fed)
    x = generate(executor, "x", prompt, 6).blocks  # 15 tokens: its last file holds [12, 15)
    y = generate(executor, "y", prompt, 4).blocks  # greedy: x's first 13 tokens
    z = generate(executor, "z", [*x.token_ids[:13], 77, 78], 2).blocks  # x's first 13, then its own
    assert y.token_ids == x.token_ids[:13] and z.token_ids[:13] == y.token_ids
    store = _store(executor, tmp_path)
    store.save("x", x)
    before = _kvbs(tmp_path)
    store.save("y", y)
    assert _kvbs(tmp_path) == before  # y wrote its manifest, nothing else
    infos = {i.key: i for i in _infos(tmp_path, executor.spec).values()}
    tail = _manifest(tmp_path, executor.spec, "y").extents["global"][-1]
    assert (tail.start, tail.end) == (12, 13) and (infos[tail.key].start, infos[tail.key].end) == (12, 15)
    store.save("z", z)
    zs = _manifest(tmp_path, executor.spec, "z").extents["global"]
    assert zs[3] == tail and [(e.start, e.end) for e in zs[4:]] == [(13, 16)]
    assert store.stats().disk_shared_bytes == sum(i.nbytes for i in infos.values())  # every file x has, y and z use

    after = make_executor(llama_tiny)
    again = _store(after, tmp_path)
    for agent, c in (("y", y), ("z", z), ("x", x)):
        loaded = again.load(agent)
        assert loaded.token_ids == c.token_ids
        _continues_like_a_fresh_prefill(after, loaded, c.token_ids)


# ---------------------------------------------------------------- collection


def test_deleting_an_agent_frees_only_the_blocks_no_other_manifest_uses(llama_tiny, tmp_path):
    executor = make_executor(llama_tiny)
    caches = _shared(executor)
    store = _store(executor, tmp_path)
    for a, c in caches.items():
        store.save(a, c)
    used = {a: _names(_manifest(tmp_path, executor.spec, a)) for a in caches}
    assert set(_kvbs(tmp_path)) == used["a"] | used["b"] | used["c"]
    assert store.delete("a")
    assert set(_kvbs(tmp_path)) == used["b"] | used["c"]
    assert store.stats().collected == len(used["a"] - used["b"] - used["c"]) > 0
    assert_identical(_store(make_executor(llama_tiny), tmp_path).load("b"), caches["b"])
    assert store.delete("b") and store.delete("c")
    assert _kvbs(tmp_path) == {} and store.stats().disk_bytes == 0 and list(tmp_path.glob("*.kvm")) == []


def test_the_budget_evicts_the_least_recent_agent_and_frees_only_its_own_blocks(llama_tiny, tmp_path):
    executor = make_executor(llama_tiny)
    caches = _shared(executor)
    store = _store(executor, tmp_path)
    for a, c in caches.items():
        store.save(a, c)
    used = {a: _names(_manifest(tmp_path, executor.spec, a)) for a in caches}
    store.disk_budget = store.stats().disk_bytes - 1
    store.save("a", caches["a"])  # "a" is the most recent now, "b" the least
    assert store.agents() == ["a", "c"] and store.stats().disk_evictions == 1
    assert set(_kvbs(tmp_path)) == used["a"] | used["c"]


def test_block_files_no_manifest_names_are_collected_at_startup(llama_tiny, tmp_path):
    executor = make_executor(llama_tiny)
    caches = _shared(executor)
    store = _store(executor, tmp_path)
    store.save("a", caches["a"])
    elsewhere = tmp_path / "elsewhere"
    _store(executor, elsewhere).save("c", caches["c"])
    stray = next(p for p in elsewhere.glob("blocks-*/*.kvb") if p.name not in _kvbs(tmp_path))
    blocks_dir = next(tmp_path.glob("blocks-*"))
    (blocks_dir / stray.name).write_bytes(stray.read_bytes())  # a valid block file nothing names
    store.save("b", caches["b"])
    (tmp_path / manifest_name("b")).unlink()  # a crash after b's block files, before its manifest
    orphans = set(_kvbs(tmp_path)) - _names(_manifest(tmp_path, executor.spec, "a"))
    assert len(orphans) > 1

    again = _store(make_executor(llama_tiny), tmp_path)
    assert set(_kvbs(tmp_path)) == _names(_manifest(tmp_path, executor.spec, "a"))
    s = again.stats()
    assert (s.collected, s.quarantined) == (len(orphans), 0) and again.agents() == ["a"]
    assert_identical(again.load("a"), caches["a"])


# ---------------------------------------------------------------- quarantine of one shared block


def test_a_damaged_block_two_agents_share_is_quarantined_once_and_both_resume_from_the_blocks_before_it(llama_tiny, tmp_path):
    executor = make_executor(llama_tiny)
    caches = _shared(executor, 2)
    store = _store(executor, tmp_path)
    for a, c in caches.items():
        store.save(a, c)
    ms = {a: _manifest(tmp_path, executor.spec, a) for a in caches}
    bad = ms["a"].extents["global"][1]  # positions 4..8 of the shared prompt
    assert bad in ms["b"].extents["global"]
    infos = {i.key: i for i in _infos(tmp_path, executor.spec).values()}
    with open(infos[bad.key].path, "r+b") as f:  # the tensor data's last bytes
        f.seek(-16, 2)
        tail = f.read()
        f.seek(-16, 2)
        f.write(bytes(x ^ 0xFF for x in tail))
    rest = {k: i for k, i in infos.items() if k != bad.key}
    assert blockload.whole_prefix(ms["a"], rest) == blockload.whole_prefix(ms["b"], rest) == bad.start == 4

    after = make_executor(llama_tiny)  # a restart: nothing pooled, the damage is found by the load's checksums
    again = _store(after, tmp_path)
    for a in ("a", "b"):
        loaded = again.load(a)
        assert loaded.token_ids == caches[a].token_ids[: bad.start]
        assert again.stats().quarantined == 1 and "checksum" in again.quarantined[0].reason
        turn = _continues_like_a_fresh_prefill(after, loaded, caches[a].token_ids)
        loaded.release()
    assert again.agents() == ["a", "b"] and not Path(infos[bad.key].path).exists()
    again.save("b", turn)  # the turn's save writes the block again, and its whole history loads
    assert Path(infos[bad.key].path).exists()
    last = make_executor(llama_tiny)
    whole = _store(last, tmp_path).load("b")
    assert whole.token_ids == turn.token_ids  # its K/V past 4: from this turn and from the first process, equal
    _continues_like_a_fresh_prefill(last, whole, turn.token_ids)


def test_a_damaged_block_before_the_window_a_sliding_layer_needs_is_a_miss(gemma_tiny, tmp_path):
    executor = make_executor(gemma_tiny)
    c = generate(executor, "a", history(29), 1).blocks
    _store(executor, tmp_path).save("a", c)
    m = _manifest(tmp_path, executor.spec, "a")
    first = next(i for i in _infos(tmp_path, executor.spec).values() if i.key == m.extents["global"][0].key)
    raw = Path(first.path).read_bytes()
    Path(first.path).write_bytes(raw[:-1] + bytes([raw[-1] ^ 0xFF]))
    again = _store(make_executor(gemma_tiny), tmp_path)
    assert again.load("a") is None and again.stats().quarantined == 1  # no prefix holds the window


# ---------------------------------------------------------------- old cache files


def test_a_cache_file_of_the_single_file_layout_is_converted_on_its_first_load(gemma_tiny, tmp_path):
    executor = make_executor(gemma_tiny)
    c = generate(executor, "a", history(29), 1).blocks
    old = _store(executor, tmp_path, layout="file")
    old.save("a", c)
    assert old.save_extra("a", {"echo": [1, 2, 3]})
    store = _store(make_executor(gemma_tiny), tmp_path)
    assert store.agents() == ["a"] and store.has("a")
    assert_identical(store.load("a"), c)
    assert not (tmp_path / file_name("a")).exists() and list(tmp_path.glob("*.json")) == []
    assert _manifest(tmp_path, executor.spec, "a").extra == {"echo": [1, 2, 3]}
    again = _store(make_executor(gemma_tiny), tmp_path)
    assert again.agents() == ["a"] and again.load_extra("a") == {"echo": [1, 2, 3]}
    assert_identical(again.load("a"), c)


def test_a_conversion_that_died_before_deleting_the_cache_file_loads_from_its_manifest(llama_tiny, tmp_path, monkeypatch):
    executor = make_executor(llama_tiny)
    c = generate(executor, "a", history(21), 1).blocks
    _store(executor, tmp_path, layout="file").save("a", c)

    def dies(path):
        raise OSError(f"the process died before deleting {path}")

    with monkeypatch.context() as m:  # the conversion wrote the manifest; the cache file stays
        m.setattr(blocklayout.atomic, "unlink_quietly", dies)
        assert_identical(_store(make_executor(llama_tiny), tmp_path).load("a"), c)
    assert (tmp_path / file_name("a")).exists() and (tmp_path / manifest_name("a")).exists()
    again = _store(make_executor(llama_tiny), tmp_path)
    assert not (tmp_path / file_name("a")).exists() and again.agents() == ["a"]
    assert_identical(again.load("a"), c)


# ---------------------------------------------------------------- newer and foreign manifests


def test_a_manifest_of_a_newer_format_is_left_alone_counted_and_a_miss(llama_tiny, tmp_path):
    executor = make_executor(llama_tiny)
    caches = _shared(executor, 2)
    store = _store(executor, tmp_path)
    for a, c in caches.items():
        store.save(a, c)
    path = tmp_path / manifest_name("a")
    _rechecksum(path, lambda doc: doc.update(format_version=manifest.MANIFEST_VERSION + 1))
    raw = path.read_bytes()
    again = _store(make_executor(llama_tiny), tmp_path)
    s = again.stats()
    assert (s.newer, s.quarantined, again.agents()) == (1, 0, ["b"])
    assert again.load("a") is None and path.read_bytes() == raw
    assert_identical(again.load("b"), caches["b"])


def test_the_block_files_a_newer_manifest_names_are_left_alone_too(llama_tiny, tmp_path):
    executor = make_executor(llama_tiny)
    _store(executor, tmp_path).save("a", generate(executor, "a", history(20), 1).blocks)
    before = _kvbs(tmp_path)
    _rechecksum(tmp_path / manifest_name("a"), lambda doc: doc.update(format_version=manifest.MANIFEST_VERSION + 1))
    again = _store(make_executor(llama_tiny), tmp_path)
    assert again.stats().newer == 1 and _kvbs(tmp_path) == before


def test_a_block_file_of_a_newer_format_is_left_alone_not_quarantined(llama_tiny, tmp_path):
    executor = make_executor(llama_tiny)
    _store(executor, tmp_path).save("a", generate(executor, "a", history(20), 1).blocks)
    path = next(tmp_path.glob("blocks-*/*.kvb"))
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    doc = json.loads(header["__metadata__"][DOC_KEY])
    doc["format_version"] = blockformat.BLOCK_VERSION + 1
    text = json.dumps(doc)
    header["__metadata__"].update({DOC_KEY: text, DOC_HASH_KEY: xxhash.xxh3_128(text.encode()).hexdigest()})
    blob = json.dumps(header).encode()
    path.write_bytes(len(blob).to_bytes(8, "little") + blob + raw[8 + n :])
    again = _store(make_executor(llama_tiny), tmp_path)
    assert again.stats().quarantined == 0 and path.exists()


def test_a_manifest_of_another_model_is_left_in_place_as_foreign(llama_tiny, tmp_path):
    executor = make_executor(llama_tiny)
    caches = _shared(executor, 2)
    _store(executor, tmp_path, fp="other-model").save("a", caches["a"])
    theirs = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    ours = _store(executor, tmp_path)  # the same pool: caches of this process, another model's files
    ours.save("b", caches["b"])
    assert ours.agents() == ["b"] and ours.foreign == [str(tmp_path / manifest_name("a"))]
    assert ours.load("a") is None and ours.stats().quarantined == 0
    assert all((tmp_path / p).read_bytes() == raw for p, raw in theirs.items())
    assert_identical(_store(make_executor(llama_tiny), tmp_path, fp="other-model").load("a"), caches["a"])


# ---------------------------------------------------------------- the pool first


def test_a_load_reads_no_block_file_whose_blocks_are_already_pooled(llama_tiny, tmp_path, monkeypatch):
    executor = make_executor(llama_tiny)
    caches = _shared(executor, 2)
    store = _store(executor, tmp_path)
    for a, c in caches.items():
        store.save(a, c)
    reads, real = [], blockread.read_file
    monkeypatch.setattr(blockread, "read_file", lambda into: reads.append(into.info.key) or real(into))
    assert_identical(store.load("a"), caches["a"])  # every block is pooled: the caller holds them
    assert reads == []

    fresh = make_executor(llama_tiny)
    again = _store(fresh, tmp_path)
    a = again.load("a")
    assert sorted(reads) == sorted(_manifest(tmp_path, executor.spec, "a").keys())
    reads.clear()
    assert_identical(again.load("b"), caches["b"])  # the prompt's blocks come from a's, pooled
    assert sorted(reads) == sorted(e.key for e in _manifest(tmp_path, executor.spec, "b").extents["global"] if e.start >= 12)
    a.release()


# ---------------------------------------------------------------- the extra note


def test_the_extra_note_goes_into_the_manifest_and_survives_a_restart(llama_tiny, tmp_path):
    executor = make_executor(llama_tiny)
    caches = _shared(executor, 2)
    store = _store(executor, tmp_path)
    assert store.save_extra("a", {"echo": "before any save"})  # kept, and written with the first save
    store.save("a", caches["a"])
    assert _manifest(tmp_path, executor.spec, "a").extra == {"echo": "before any save"}
    store.save("b", caches["b"])
    assert store.save_extra("b", {"echo": [4, 5], "n": 2})
    assert _manifest(tmp_path, executor.spec, "b").extra == {"echo": [4, 5], "n": 2}
    assert store.load_extra("b") == {"echo": [4, 5], "n": 2} and store.load_extra("nobody") is None
    assert not store.save_extra("b", {"not json": object()})
    again = _store(make_executor(llama_tiny), tmp_path)
    assert again.load_extra("a") == {"echo": "before any save"} and again.load_extra("b") == {"echo": [4, 5], "n": 2}
    assert_identical(again.load("b"), caches["b"])
    assert again.delete("b") and again.load_extra("b") is None
