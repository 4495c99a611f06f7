"""The block layout keeps snapshots: groups that resume only from their whole cache (``LayerSpec.snapshot_only``).

Tiny random-weight models, 16-token blocks: LFM2 and Qwen3-Next (recurrent layers beside global ones) and
gpt-oss with a window of 8 (a sliding window shorter than a block). A saved agent, loaded by a new store
over the same directory into a fresh pool, continues exactly like a fresh prefill; a system prompt's
snapshot is one file for every agent that ends there; a damaged snapshot is quarantined and the agent
resumes from less; unused snapshot files are collected; files written before snapshots (positional
extents of a short window, and the single-file layout) still load; the shared tier carries snapshot files.

A finished cache carries several snapshots per snapshot group (the engine keeps the prompt's last token but
one, where a regenerate resumes, beside the turn's end): each is a file of its own, listed in the manifest,
and comes back on load; a continuation from any of them equals a fresh prefill; a damaged last one resumes
from the latest earlier one, a damaged earlier one drops only itself.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import xxhash

from semantic import AgentCacheStore, Request
from semantic.cache import convert, room
from semantic.cachefile import DOC_KEY
from semantic.errors import CacheCorruptError, PoolExhaustedError, UnsupportedCacheError
from semantic.store.remote import Fetched
from semantic.cache.spec import RECURRENT, LayerSpec
from semantic.store import blockformat, blockload, blockread, manifest, manifest_name
from tests.cache_helpers import arrays, check_executor, make_executor, generate, history, run
from tests.redis_helpers import RedisServer
from tests.tiny_models import tiny_gpt_oss, tiny_lfm2, tiny_qwen3_next

pytestmark = pytest.mark.compat

FP = "tiny-snapshots"
BT = 16
SYSTEM = history(37, seed=11)  # two full blocks and 5 tokens


# ---------------------------------------------------------------- tiny models (random weights)


_MAKERS = {"lfm2": tiny_lfm2, "qwen3_next": tiny_qwen3_next, "gpt_oss": tiny_gpt_oss}
_BUILT: dict[str, object] = {}


def _model(name):
    if name not in _BUILT:
        _BUILT[name] = _MAKERS[name]()
    return _BUILT[name]


@pytest.fixture(params=list(_MAKERS))
def model(request):
    return _model(request.param)


# ---------------------------------------------------------------- helpers


def _executor(model, blocks=256):
    return make_executor(model, blocks=blocks, block_tokens=BT)


def _store(executor, path, layout="blocks", remote=None):
    return AgentCacheStore(path, executor.spec, FP, 10**9, pool=executor.pool, durable=False, layout=layout, remote=remote)


def _snapshot_group(spec) -> str:
    (group,) = [g for g, ix in spec.groups().items() if spec.layers[ix[0]].snapshot_only(BT)]
    return group


def _infos(path: Path, spec) -> list[blockformat.BlockInfo]:
    return [blockformat.read_header(str(p), spec, FP) for p in sorted(path.glob("blocks-*/*.kvb"))]


def _snapshot_files(path: Path, spec) -> list[blockformat.BlockInfo]:
    """The snapshot files on disk, by end."""
    return sorted((i for i in _infos(path, spec) if i.snapshot), key=lambda i: i.end)


def _ends(blocks, group) -> list[int]:
    return [b.end for b in blocks.groups[group]]


def _manifest(path: Path, spec, agent: str) -> manifest.Manifest:
    return manifest.read(str(path / manifest_name(agent)), spec, FP, BT)


def _continues_like_a_fresh_prefill(executor, loaded, tokens, cached=None, tail=(3, 4)):
    """A turn on ``tokens`` + ``tail`` from ``loaded`` (all of it, or a prefix: the rest is prefilled) against one
    from nothing: the same greedy tokens, logprobs within the measured tolerance. ``cached``: where it must start (default:
    all of ``loaded``; an earlier snapshot of it when ``tokens`` leave its history there)."""
    cached = loaded.total_tokens if cached is None else cached
    assert tuple(tokens[:cached]) == loaded.token_ids[:cached]
    cont = executor.submit(Request("cont", [*tokens, *tail], 6), loaded, share=False)
    ref = executor.submit(Request("ref", [*tokens, *tail], 6), share=False)
    out = run(executor)
    assert out[cont].cached_tokens == cached
    assert out[cont].token_ids == out[ref].token_ids
    check_executor(executor, out[cont], out[ref])  # both mlx-lm's own generation, within its measured noise
    return out[cont].blocks


def _damage_tensors(path: str) -> None:
    raw = bytearray(Path(path).read_bytes())
    raw[-3] ^= 0xFF  # the last tensor's bytes: the header still checks, the checksum does not
    Path(path).write_bytes(bytes(raw))


# ---------------------------------------------------------------- save, restart, load


def test_a_saved_agent_reloads_after_a_restart_with_every_snapshot_and_continues_like_a_fresh_prefill(model, tmp_path):
    executor = _executor(model)
    prompt = history(45, seed=1)
    done = generate(executor, "a", prompt, 4)
    store = _store(executor, tmp_path)
    store.save("a", done.blocks)
    spec, total = executor.spec, done.blocks.total_tokens
    group = _snapshot_group(spec)
    assert _ends(done.blocks, group) == [len(prompt) - 1, total]  # the engine keeps where a regenerate resumes

    snaps = _snapshot_files(tmp_path, spec)
    assert [s.end for s in snaps] == [len(prompt) - 1, total]  # one file per snapshot
    for snap in snaps:
        start = (snap.end - 1) // BT * BT
        assert (snap.group, snap.block_start, snap.start) == (group, start, start)
        assert snap.token_ids == done.blocks.token_ids[snap.start:snap.end]
        for s in snap.slots:
            layer = spec.layers[s.layer]
            if layer.kind == RECURRENT:
                assert s.name.startswith(f"layer.{s.layer}.state.") and s.shape == (1, *layer.arrays[s.part][0])
                assert s.dtype == layer.arrays[s.part][1]
            else:
                assert s.shape == (1, layer.n_kv_heads, layer.tokens_held(snap.end), layer.head_dim)
    m = _manifest(tmp_path, spec, "a")
    assert m.snapshots == {group}
    assert m.extents[group] == tuple(manifest.Extent(s.key, s.start, s.end) for s in snaps)
    on_disk = sum(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file())
    assert store.stats().disk_bytes == on_disk  # the snapshot files count in the budget

    fresh = _executor(model)  # a restart: a new pool, a new store over the same directory
    loaded = _store(fresh, tmp_path).load("a")
    assert loaded is not None and loaded.total_tokens == total
    assert _ends(loaded, group) == [len(prompt) - 1, total]
    assert_identical_snapshot(loaded, done.blocks)
    assert_identical_snapshot(loaded, done.blocks, upto=len(prompt) - 1)
    # a regenerate (the same prompt again) starts from the earlier snapshot, a next turn from the end
    _continues_like_a_fresh_prefill(fresh, loaded, prompt, cached=len(prompt) - 1, tail=())
    _continues_like_a_fresh_prefill(fresh, loaded, list(loaded.token_ids) + history(7, seed=2))


def test_a_load_for_a_prompt_that_extends_the_history_leaves_the_earlier_snapshots_on_disk(model, tmp_path, monkeypatch):
    executor = _executor(model)
    prompt = history(45, seed=1)
    done = generate(executor, "a", prompt, 4).blocks
    _store(executor, tmp_path).save("a", done)
    group, total = _snapshot_group(executor.spec), done.total_tokens
    earlier = {s.path for s in _snapshot_files(tmp_path, executor.spec) if s.end < total}
    assert earlier
    read, real = [], blockread.read_file
    monkeypatch.setattr(blockread, "read_file", lambda into: (read.append(into.info.path), real(into))[1])

    fresh = _executor(model)  # a restart; the agent's next turn appends to its whole history
    nxt = [*done.token_ids, *history(7, seed=2)]
    restarted = _store(fresh, tmp_path)
    loaded = restarted.load("a", nxt)
    assert loaded is not None and loaded.total_tokens == total
    assert _ends(loaded, group) == [total]  # only the snapshot it resumes from
    assert read and not earlier & set(read)  # the earlier one neither read nor held
    after = _continues_like_a_fresh_prefill(fresh, loaded, nxt, tail=())
    loaded.release()
    # its next save lists where this turn resumed and its end, as a turn after a whole load does; the earlier
    # file, which no manifest names now, goes
    restarted.save("a", after)
    assert [e.end for e in _manifest(tmp_path, fresh.spec, "a").extents[group]] == [total, after.total_tokens]
    assert not any(Path(p).exists() for p in earlier)
    after.release()

    # a regenerate's prompt (the same prompt again) still brings every snapshot, the one it resumes from included
    again = _executor(model)
    regen = _store(again, tmp_path).load("a", nxt)
    assert _ends(regen, group) == [total, after.total_tokens]
    _continues_like_a_fresh_prefill(again, regen, nxt, cached=total, tail=())


def assert_identical_snapshot(a, b, upto=None, group=None) -> None:
    """Every layer's cache rebuilt from ``a`` equals ``b``'s (recurrent states included), after all their tokens
    or their first ``upto`` (of ``group``'s layers only, when given)."""
    from semantic.cache import convert
    from semantic import compat

    assert a.token_ids[:upto] == b.token_ids[:upto]
    pairs = zip(a.spec.layers, convert.reconstruct(a, upto=upto), convert.reconstruct(b, upto=upto))
    for x, y in ((x, y) for layer, x, y in pairs if group is None or layer.group == group):
        xs = compat.cache_arrays(x) if not x.empty() else []
        ys = compat.cache_arrays(y) if not y.empty() else []
        assert len(xs) == len(ys)
        for p, q in zip(xs, ys):
            assert p.shape == q.shape and p.dtype == q.dtype
            assert np.array_equal(np.array(p), np.array(q))


def test_a_turn_after_a_load_writes_a_new_snapshot_and_collects_the_one_no_manifest_names(model, tmp_path):
    executor = _executor(model)
    store = _store(executor, tmp_path)
    first = generate(executor, "a", history(30, seed=3), 2).blocks
    store.save("a", first)
    old = _snapshot_files(tmp_path, executor.spec)
    assert [o.end for o in old] == [29, first.total_tokens]
    uid = executor.submit(Request("a", [*first.token_ids, 9, 8, 7], 2), first, share=False)
    second = run(executor)[uid].blocks
    store.save("a", second)
    new = _snapshot_files(tmp_path, executor.spec)
    # where it resumed (the first turn's end: carried, and where a regenerate of its few new tokens resumes
    # too: no stop at its last token but one, ``snapshots.FEW_NEW``), its end
    assert [n.end for n in new] == [first.total_tokens, second.total_tokens]
    assert not Path(old[0].path).exists() and store.stats().collected >= 1
    fresh = _executor(model)
    _continues_like_a_fresh_prefill(fresh, _store(fresh, tmp_path).load("a"), list(second.token_ids))
    assert store.delete("a") and not list(tmp_path.glob("blocks-*/*.kvb"))  # every file goes with its agent


def _only_last(executor, blocks):
    """``blocks`` with each snapshot group's last snapshot only (a cache as builds before several snapshots had)."""
    from semantic.cache.blocks import AgentBlocks

    snap = {_snapshot_group(executor.spec)}
    groups = {g: [executor.pool.acquire(b) for b in (bl[-1:] if g in snap else bl)] for g, bl in blocks.groups.items()}
    return AgentBlocks(executor.spec, blocks.token_ids, groups, BT, _release=executor.pool.release, salt_root=blocks.salt_root)


def _carrying(executor, model, blocks, end):
    """``blocks`` carrying a snapshot after its first ``end`` tokens too (the model run on them, extracted)."""
    from semantic.cache import convert

    caches = executor.spec.make_cache()
    model(mx.array([list(blocks.token_ids[:end])]), cache=caches)
    at = convert.extract(executor.pool, caches, blocks.token_ids[:end])
    group = _snapshot_group(executor.spec)
    out = convert.extract(executor.pool, convert.reconstruct(blocks), blocks.token_ids,
                          earlier=[*blocks.groups[group][:-1], *at.groups[group]])
    at.release()
    return out


def test_a_manifest_with_one_snapshot_per_group_still_loads(tmp_path):
    model = _model("qwen3_next")
    executor = _executor(model)
    done = generate(executor, "a", history(45, seed=13), 3).blocks
    one = _only_last(executor, done)
    store = _store(executor, tmp_path)
    store.save("a", one)
    group = _snapshot_group(executor.spec)
    doc = json.loads(json.loads((tmp_path / manifest_name("a")).read_bytes())[manifest.DOC_KEY])
    assert doc["format_version"] == manifest.MANIFEST_VERSION and [row[2] for row in doc["extents"][group]] == [done.total_tokens]
    assert "a" in _store(executor, tmp_path).agents()  # indexed at startup, as before
    fresh = _executor(model)
    loaded = _store(fresh, tmp_path).load("a")
    assert loaded is not None and _ends(loaded, group) == [done.total_tokens]
    assert_identical_snapshot(loaded, done)
    _continues_like_a_fresh_prefill(fresh, loaded, list(done.token_ids))


@pytest.mark.parametrize("extents", [
    lambda ex: ex[::-1],                 # not ascending
    lambda ex: [ex[0], ex[0], ex[1]],    # an end twice
    lambda ex: ex[:1],                   # the last is not the turn's end
    lambda ex: [[ex[0][0], ex[0][1] + 1, ex[0][2]], ex[1]],  # not the span a snapshot at its end has
])
def test_a_manifest_whose_snapshot_extents_are_out_of_order_or_misplaced_is_refused(tmp_path, extents):
    executor = _executor(_model("lfm2"))
    _store(executor, tmp_path).save("a", generate(executor, "a", history(45, seed=14), 3).blocks)
    group = _snapshot_group(executor.spec)
    doc = json.loads(json.loads((tmp_path / manifest_name("a")).read_bytes())[manifest.DOC_KEY])
    doc["extents"][group] = extents(doc["extents"][group])
    text = json.dumps(doc)
    raw = json.dumps({manifest.DOC_KEY: text, manifest.HASH_KEY: xxhash.xxh3_128(text.encode()).hexdigest()})
    with pytest.raises(CacheCorruptError, match="snapshot"):
        manifest.parse("m", raw.encode(), executor.spec, FP, BT)


def test_a_snapshot_at_another_agents_end_is_that_agents_file_and_each_snapshot_resumes_exactly(model, tmp_path):
    executor = _executor(model)
    store = _store(executor, tmp_path)
    sys = generate(executor, "sys", SYSTEM, 1).blocks
    store.save("sys", sys)
    before = {p.name for p in tmp_path.glob("blocks-*/*.kvb")}
    prompt = [*sys.token_ids, *history(30, seed=15)]
    mine = _carrying(executor, model, generate(executor, "a", prompt, 3).blocks, sys.total_tokens)
    group = _snapshot_group(executor.spec)
    ends = [sys.total_tokens, len(prompt) - 1, mine.total_tokens]
    assert _ends(mine, group) == ends
    store.save("a", mine)
    m = _manifest(tmp_path, executor.spec, "a")
    assert [e.end for e in m.extents[group]] == ends
    assert m.extents[group][0] == _manifest(tmp_path, executor.spec, "sys").extents[group][-1]  # sys's file, not a copy
    assert len({p.name for p in tmp_path.glob("blocks-*/*.kvb")} - before) == len(m.keys() - set(
        _manifest(tmp_path, executor.spec, "sys").keys()))

    fresh = _executor(model)
    loaded = _store(fresh, tmp_path).load("a")
    assert loaded is not None and _ends(loaded, group) == ends
    other = mine.token_ids[sys.total_tokens] ^ 1
    _continues_like_a_fresh_prefill(fresh, loaded, list(sys.token_ids), cached=sys.total_tokens, tail=(other, 4))
    _continues_like_a_fresh_prefill(fresh, loaded, prompt, cached=len(prompt) - 1, tail=())
    _continues_like_a_fresh_prefill(fresh, loaded, list(mine.token_ids))


def test_a_load_that_the_pool_cannot_hold_with_its_earlier_snapshots_takes_nothing(tmp_path, monkeypatch):
    model = _model("lfm2")
    executor = _executor(model)
    done = generate(executor, "a", history(45, seed=16), 3).blocks
    _store(executor, tmp_path).save("a", done)
    n = len(done.unique_blocks())
    group = _snapshot_group(executor.spec)
    assert len(done.groups[group]) == 2
    costs = room.block_costs(executor.spec, BT)
    # room for all but one snapshot block: the final plan alone would fit
    small = make_executor(model, block_tokens=BT, capacity_bytes=sum(costs[b.group] for b in done.unique_blocks())
                   - costs[group])
    before = small.pool.free_count
    with pytest.raises(PoolExhaustedError):
        _store(small, tmp_path).load("a")
    assert small.pool.free_count == before and small.pool.stats().used == 0
    enough = make_executor(model, block_tokens=BT, capacity_bytes=sum(costs[b.group] for b in done.unique_blocks()))
    loaded = _store(enough, tmp_path).load("a")
    assert loaded is not None and _ends(loaded, group) == _ends(done, group) and enough.pool.free_bytes == 0
    loaded.release()
    monkeypatch.setattr(blockread, "read_file", lambda into: pytest.fail(f"read {into.info.path}"))
    again = _store(enough, tmp_path).load("a")  # every block a pool hit now, the earlier snapshot too: nothing read
    assert again is not None and _ends(again, group) == _ends(done, group)
    assert enough.pool.stats().used == n


# ---------------------------------------------------------------- sharing and damage


def test_a_system_prompt_snapshot_is_one_file_for_every_agent_that_ends_there(tmp_path):
    model = _model("lfm2")
    executor = _executor(model)
    store = _store(executor, tmp_path)
    a = generate(executor, "a", SYSTEM, 1).blocks  # a cache of the system prompt alone
    store.save("a", a)
    files, written = {p.name for p in tmp_path.glob("blocks-*/*.kvb")}, store.stats().written_bytes
    b = generate(executor, "b", SYSTEM, 1).blocks
    store.save("b", b)
    assert {p.name for p in tmp_path.glob("blocks-*/*.kvb")} == files  # nothing written twice
    assert store.stats().written_bytes - written == (tmp_path / manifest_name("b")).stat().st_size
    snaps = _snapshot_files(tmp_path, executor.spec)
    assert [s.end for s in snaps] == [len(SYSTEM) - 1, a.total_tokens]
    assert _manifest(tmp_path, executor.spec, "a").keys() == _manifest(tmp_path, executor.spec, "b").keys()
    assert store.stats().disk_shared_bytes >= sum(s.nbytes for s in snaps)
    store.delete("a")
    assert all(Path(s.path).exists() for s in snaps)  # b still names them
    fresh = _executor(model)
    loaded = _store(fresh, tmp_path).load("b")
    assert loaded.token_ids == b.token_ids == a.token_ids  # the prompt and the greedy token it fed
    _continues_like_a_fresh_prefill(fresh, loaded, list(loaded.token_ids))


@pytest.mark.parametrize("which", ["snapshots", "positional"])
def test_a_damaged_file_is_quarantined_and_the_agent_resumes_exactly_from_the_system_prompts_snapshot(tmp_path, which):
    model = _model("qwen3_next")
    executor = _executor(model)
    store = _store(executor, tmp_path)
    sys = generate(executor, "sys", SYSTEM, 1).blocks  # the system prompt and the token it fed: 38
    store.save("sys", sys)
    mine = generate(executor, "a", [*sys.token_ids, *history(40, seed=4)], 3).blocks
    store.save("a", mine)
    m = _manifest(tmp_path, executor.spec, "a")
    group = _snapshot_group(executor.spec)
    infos = {i.key: i for i in _infos(tmp_path, executor.spec)}
    if which == "snapshots":  # both of the agent's own: the prompt's, and the turn's end
        damaged = list(m.extents[group])
        assert [e.end for e in damaged] == [sys.total_tokens + 40 - 1, mine.total_tokens]
    else:  # the global block right after the system prompt's snapshot: the prefix before it stays whole
        damaged = [next(e for g, ex in m.extents.items() if g != group for e in ex if e.start == 48)]
    for e in damaged:
        _damage_tensors(infos[e.key].path)

    fresh = _executor(model)
    again = _store(fresh, tmp_path)
    loaded = again.load("a")
    assert again.stats().quarantined == len(damaged) and not any(Path(infos[e.key].path).exists() for e in damaged)
    assert loaded is not None and loaded.total_tokens == sys.total_tokens
    _continues_like_a_fresh_prefill(fresh, loaded, list(mine.token_ids))


def test_a_damaged_last_snapshot_resumes_exactly_from_the_agents_earlier_one(tmp_path):
    model = _model("qwen3_next")
    executor = _executor(model)
    store = _store(executor, tmp_path)
    store.save("sys", generate(executor, "sys", SYSTEM, 1).blocks)  # another snapshot to fall back on, further back
    prompt = [*SYSTEM, *history(40, seed=4)]
    mine = generate(executor, "a", prompt, 3).blocks
    store.save("a", mine)
    group = _snapshot_group(executor.spec)
    last = _manifest(tmp_path, executor.spec, "a").extents[group][-1]
    path = next(i.path for i in _infos(tmp_path, executor.spec) if i.key == last.key)
    _damage_tensors(path)

    fresh = _executor(model)
    again = _store(fresh, tmp_path)
    m = _manifest(tmp_path, executor.spec, "a")
    assert blockload.whole_prefix(m, {i.key: i for i in _infos(tmp_path, executor.spec)}) == mine.total_tokens  # not yet known
    loaded = again.load("a")
    assert again.stats().quarantined == 1 and not Path(path).exists()
    assert loaded is not None and loaded.total_tokens == len(prompt) - 1 and _ends(loaded, group) == [len(prompt) - 1]
    # its state is the agent's own snapshot, bit for bit (the positional blocks before it: the system prompt's
    # files, which a prefill of another length computed)
    assert_identical_snapshot(loaded, mine, upto=len(prompt) - 1, group=group)
    _continues_like_a_fresh_prefill(fresh, loaded, list(mine.token_ids))
    assert blockload.whole_prefix(m, {i.key: i for i in _infos(tmp_path, executor.spec)}) == len(prompt) - 1


def test_a_damaged_earlier_snapshot_drops_only_itself(tmp_path):
    model = _model("lfm2")
    executor = _executor(model)
    store = _store(executor, tmp_path)
    prompt = history(45, seed=12)
    mine = generate(executor, "a", prompt, 3).blocks
    store.save("a", mine)
    group = _snapshot_group(executor.spec)
    first = _manifest(tmp_path, executor.spec, "a").extents[group][0]
    path = next(i.path for i in _infos(tmp_path, executor.spec) if i.key == first.key)
    _damage_tensors(path)

    fresh = _executor(model)
    again = _store(fresh, tmp_path)
    loaded = again.load("a")
    assert again.stats().quarantined == 1 and not Path(path).exists()
    assert loaded is not None and loaded.total_tokens == mine.total_tokens
    assert _ends(loaded, group) == [mine.total_tokens]
    assert_identical_snapshot(loaded, mine)
    _continues_like_a_fresh_prefill(fresh, loaded, list(mine.token_ids))
    # its next save lists only what it carries: a manifest of whole files again
    again.save("a", loaded)
    assert [e.end for e in _manifest(tmp_path, executor.spec, "a").extents[group]] == [mine.total_tokens]



def test_a_damaged_snapshot_with_no_other_to_fall_back_on_is_a_miss(tmp_path):
    model = _model("gpt_oss")
    executor = _executor(model)
    store = _store(executor, tmp_path)
    mine = generate(executor, "a", history(50, seed=5), 2).blocks
    store.save("a", mine)
    snaps = _snapshot_files(tmp_path, executor.spec)
    assert len(snaps) == 2
    for snap in snaps:  # the prompt's and the turn's: one after the other, each quarantined
        _damage_tensors(snap.path)
    again = _store(_executor(model), tmp_path)
    assert again.load("a") is None and again.stats().quarantined == 2
    m = _manifest(tmp_path, executor.spec, "a")
    assert blockload.whole_prefix(m, {i.key: i for i in _infos(tmp_path, executor.spec)}) == 0


def test_a_snapshot_file_serves_only_a_history_that_matches_all_its_tokens(tmp_path):
    model = _model("lfm2")
    executor = _executor(model)
    a = generate(executor, "a", SYSTEM, 1).blocks
    _store(executor, tmp_path).save("a", a)
    snap = _snapshot_files(tmp_path, executor.spec)[-1]
    tokens, end = list(a.token_ids[snap.block_start:]), a.total_tokens
    assert snap.usable_end(tokens, snap.parent, end) == end
    assert snap.usable_end(tokens[:-1] + [tokens[-1] ^ 1], snap.parent, end) == snap.start  # never a prefix
    assert snap.usable_end(tokens, snap.parent, end - 1) == snap.start
    assert snap.usable_end(tokens, (snap.parent or 0) ^ 1, end) == snap.start
    positional = blockformat.block_key(snap.parent, tuple(tokens), 0, snap.group)
    assert snap.key == blockformat.snapshot_key(snap.parent, tuple(tokens), snap.group) != positional


# ---------------------------------------------------------------- files written before snapshots


def _same_arrays(xs, ys) -> None:
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys):
        assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y)


def _positional_short_window(monkeypatch):
    """Make a window shorter than a block positional again, as builds before snapshots had it."""
    monkeypatch.setattr(LayerSpec, "snapshot_only", lambda self, block_tokens: self.kind == RECURRENT)
    # reconstruction asks each spec's layers once: a cache of its own while the patch holds
    monkeypatch.setattr(convert, "_LAYERS", {})


def test_a_manifest_with_a_short_windows_positional_extents_still_loads_and_its_next_save_is_a_snapshot(
        tmp_path, monkeypatch):
    model = _model("gpt_oss")
    tokens = history(50, seed=6)
    with monkeypatch.context() as patch:
        _positional_short_window(patch)
        old = _executor(model)
        done = generate(old, "a", tokens, 4).blocks  # 53 tokens: the last generated one is never fed
        want = arrays(done)  # its caches, rebuilt as that build did
        _store(old, tmp_path).save("a", done)
        group = next(g for g in old.spec.groups() if g.startswith("sliding"))
        doc = json.loads(json.loads((tmp_path / manifest_name("a")).read_bytes())[manifest.DOC_KEY])
        assert "snapshots" not in doc and len(doc["extents"][group]) >= 1
        assert [row[1:] for row in doc["extents"][group]] == [[45, 48], [48, 53]]  # the window, in two files
        assert not any(i.snapshot for i in _infos(tmp_path, old.spec))
        old_files = {p.name for p in tmp_path.glob("blocks-*/*.kvb")}

    fresh = _executor(model)
    store = _store(fresh, tmp_path)
    m = _manifest(tmp_path, fresh.spec, "a")
    assert m.snapshots == frozenset()
    loaded = store.load("a")
    assert loaded is not None and loaded.token_ids == done.token_ids
    _same_arrays(arrays(loaded), want)  # the window, assembled from its positional pieces
    after = _continues_like_a_fresh_prefill(fresh, loaded, list(done.token_ids) + [5, 6])
    store.save("a", after)
    sliding = sorted((i for i in _infos(tmp_path, fresh.spec) if i.group == group), key=lambda i: i.end)
    assert all(i.snapshot for i in sliding) and [i.end for i in sliding] == _ends(after, group)
    assert sliding[-1].end == after.total_tokens
    assert _manifest(tmp_path, fresh.spec, "a").snapshots == {group}
    assert old_files - {p.name for p in tmp_path.glob("blocks-*/*.kvb")}  # the old window's files, collected


def test_a_short_window_cache_file_of_the_single_file_layout_still_loads_in_both_layouts(tmp_path, monkeypatch):
    model = _model("gpt_oss")
    tokens = history(50, seed=7)
    with monkeypatch.context() as patch:
        _positional_short_window(patch)
        old = _executor(model)
        done = generate(old, "a", tokens, 3).blocks
        want = arrays(done)
        for d in ("file", "blocks"):
            _store(old, tmp_path / d, layout="file").save("a", done)
    for d in ("file", "blocks"):  # the block layout converts it on its first load
        fresh = _executor(model)
        loaded = _store(fresh, tmp_path / d, layout=d).load("a")
        assert loaded is not None and loaded.token_ids == done.token_ids
        _same_arrays(arrays(loaded), want)
        _continues_like_a_fresh_prefill(fresh, loaded, list(done.token_ids))
    assert _manifest(tmp_path / "blocks", fresh.spec, "a").snapshots


def test_the_single_file_layout_refuses_recurrent_layers_naming_them_and_the_blocks_layout(tmp_path):
    from semantic import cachefile

    executor = _executor(_model("lfm2"))
    with pytest.raises(UnsupportedCacheError, match=r"recurrent.*layout='blocks'"):
        _store(executor, tmp_path, layout="file")
    blocks = generate(executor, "a", SYSTEM, 1).blocks
    with pytest.raises(UnsupportedCacheError, match="recurrent"):
        cachefile.save(tmp_path / "a.safetensors", blocks, model_fingerprint=FP)
    assert not list(tmp_path.iterdir())


# ---------------------------------------------------------------- the shared tier


class _MemoryTier:
    """What the store uses of ``semantic.store.remote.RemoteTier``, in memory and synchronous (the bytes as the
    real tier keeps them: a manifest per agent, block files by key)."""

    def __init__(self):
        self.manifests: dict[str, tuple[int, bytes]] = {}
        self.blocks: dict[int, bytes] = {}
        self.pointers: dict[int, str] = {}
        self.lock = threading.Lock()

    def version(self, agent_id):
        got = self.manifests.get(agent_id)
        return None if got is None else got[0]

    def fetch(self, agent_id):
        got = self.manifests.get(agent_id)
        return None if got is None else Fetched(*got)

    def fetch_blocks(self, keys):
        return {k: self.blocks[k] for k in keys if k in self.blocks}

    def drop_block(self, key):
        self.blocks.pop(key, None)

    def drop(self, agent_id, version):
        if self.version(agent_id) == version:
            del self.manifests[agent_id]

    def holder(self, chain):
        n = next((i for i in range(len(chain), 0, -1) if chain[i - 1] in self.pointers), 0)
        return (n, self.pointers[chain[n - 1]]) if n else None

    def publish(self, agent_id, path, version, chain=(), blocks=()):
        with self.lock:
            for key, p in blocks:
                self.blocks.setdefault(key, Path(p).read_bytes())
            if version > (self.version(agent_id) or -1):
                self.manifests[agent_id] = (version, Path(path).read_bytes())
                self.pointers.update({k: agent_id for k in chain})

    def flush(self, timeout=None):
        return True


def _through_the_tier(model, tmp_path, tier_for):
    e1, e2 = _executor(model), _executor(model)
    s1, s2 = _store(e1, tmp_path / "one", remote=tier_for()), _store(e2, tmp_path / "two", remote=tier_for())
    done = generate(e1, "public/a", [*SYSTEM, *history(20, seed=8)], 3).blocks
    s1.save("public/a", done)
    assert s1.remote.flush(10)
    loaded = s2.load("public/a")  # server two never saw it: manifest and block files, snapshots included
    assert loaded is not None and loaded.total_tokens == done.total_tokens
    assert {i.name for i in (tmp_path / "two").glob("blocks-*/*.kvb")} == {
        i.name for i in (tmp_path / "one").glob("blocks-*/*.kvb")}
    group = _snapshot_group(e2.spec)
    assert [i.end for i in _snapshot_files(tmp_path / "two", e2.spec)] == _ends(done, group) == _ends(loaded, group)
    assert len(_ends(loaded, group)) == 2  # the prompt's snapshot and the turn's
    assert_identical_snapshot(loaded, done)
    assert_identical_snapshot(loaded, done, upto=_ends(done, group)[0])
    _continues_like_a_fresh_prefill(e2, loaded, list(done.token_ids))
    return s1, s2


def test_snapshot_files_travel_through_the_shared_tier_like_other_block_files(tmp_path):
    tier = _MemoryTier()
    _through_the_tier(_model("qwen3_next"), tmp_path, lambda: tier)
    assert any(_is_snapshot(raw) for raw in tier.blocks.values())


def _is_snapshot(raw: bytes) -> bool:
    n = int.from_bytes(raw[:8], "little")
    doc = json.loads(json.loads(raw[8:8 + n])["__metadata__"][DOC_KEY])
    return doc.get("snapshot") is True and doc["format_version"] == blockformat.SNAPSHOT_VERSION


def test_snapshot_files_travel_through_a_real_redis_server(tmp_path):
    from semantic.store.remote import RemoteTier

    (tmp_path / "redis").mkdir()
    server = RedisServer(tmp_path / "redis").start()
    try:
        _through_the_tier(_model("lfm2"), tmp_path, lambda: RemoteTier(server.url, FP, timeout_s=0.5))
    finally:
        server.stop()
