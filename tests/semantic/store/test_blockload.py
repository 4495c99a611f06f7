"""Restoring an agent from its block files (``blockload``, ``blockread``): straight into arrays sized for each run.

After a restart every block misses the pool: each run of a group's blocks is read into one array per layer
and part (a segment), bit for bit what was saved, and reconstruct hands each layer over with no
concatenation. Global, sliding (window edges), recurrent and short-window snapshots, and quantized layers;
blocks stitched from the files of several turns; a damaged block in the middle of a run; the reader's own
rules (rows no array takes are still checked; it returns only once no thread writes).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from semantic import AgentCacheStore, Request, compat
from semantic.cache import convert, lending
from semantic.cache.blocks import Segment, segment_runs
from semantic.cachefile.fileformat import MX_DTYPES
from semantic.errors import CacheCorruptError
from semantic.store import blockformat, blockread, manifest_name
from semantic.store import manifest as manifest_mod
from tests.cache_helpers import make_executor, generate, history, run
from tests.tiny_models import tiny_gpt_oss, tiny_lfm2

pytestmark = pytest.mark.compat

FP = "tiny-restore"
_BUILT: dict[str, object] = {}


def _model(name, llama_tiny, gemma_tiny):
    makers = {"llama": lambda: llama_tiny, "gemma": lambda: gemma_tiny, "lfm2": tiny_lfm2, "gpt_oss": tiny_gpt_oss}
    if name not in _BUILT:
        _BUILT[name] = makers[name]()
    return _BUILT[name]


def _store(executor, path):
    return AgentCacheStore(path, executor.spec, FP, 10**9, pool=executor.pool, durable=False, layout="blocks")


def _one_segment_per_layer(blocks) -> None:
    """Every positional layer's pieces are one run of one segment (a snapshot group's are its snapshot)."""
    bt = blocks.block_tokens
    for i, layer in enumerate(blocks.spec.layers):
        if layer.snapshot_only(bt):
            continue
        pieces, _, _ = convert._pieces(blocks, i, blocks.total_tokens)
        runs = segment_runs(pieces, i)
        assert len(runs) == 1 and isinstance(runs[0].source, Segment), (i, runs)


def _arrays(caches) -> list[np.ndarray]:
    """Every array of rebuilt mlx-lm caches, in layer order (recurrent states too; bfloat16 as raw uint16)."""
    return [np.array(x.view(mx.uint16) if x.dtype == mx.bfloat16 else x)
            for c in caches if not c.empty() for x in compat.cache_arrays(c)]


def _same(xs: list[np.ndarray], ys: list[np.ndarray]) -> None:
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys):
        assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y)


def _identical_without_concatenating(loaded, saved, monkeypatch, upto=None) -> None:
    """``loaded`` rebuilds bit for bit as ``saved`` (after its first ``upto`` tokens), and with no concatenation."""
    assert loaded.token_ids == saved.token_ids[:upto]
    want = _arrays(convert.reconstruct(saved, upto=upto))  # the engine's blocks: several segments, concatenated
    with monkeypatch.context() as mp:
        mp.setattr(convert, "_cat", lambda parts: pytest.fail(f"concatenated {len(parts)} pieces"))
        _same(_arrays(convert.reconstruct(loaded)), want)


def _infos(path: Path, spec) -> dict[int, blockformat.BlockInfo]:
    return {i.key: i for i in (blockformat.read_header(str(p), spec, FP) for p in path.glob("blocks-*/*.kvb"))}


# ---------------------------------------------------------------- exact, one segment per layer


@pytest.mark.parametrize("which,kv_bits,bt,n", [
    ("llama", None, 4, 45), ("gemma", None, 4, 45), ("lfm2", None, 16, 45), ("gpt_oss", None, 16, 45),
    ("llama", 8, 4, 45),
], ids=["global", "sliding-window-edge", "recurrent-snapshot", "short-window-snapshot", "quantized-8bit"])
def test_a_restore_into_preallocated_segments_is_bit_identical_to_the_saved_cache(
        llama_tiny, gemma_tiny, tmp_path, monkeypatch, which, kv_bits, bt, n):
    model = _model(which, llama_tiny, gemma_tiny)
    executor = make_executor(model, kv_bits, block_tokens=bt)
    saved = generate(executor, "a", history(n), 1).blocks  # n tokens: the generated one is never fed
    assert saved.total_tokens % bt  # a tail block, and (sliding) a window edge inside a block
    _store(executor, tmp_path).save("a", saved)

    after = make_executor(model, kv_bits, block_tokens=bt)  # a restart: an empty pool, every block read from its file
    loaded = _store(after, tmp_path).load("a")
    _one_segment_per_layer(loaded)
    _identical_without_concatenating(loaded, saved, monkeypatch)


def test_reconstruct_after_a_restore_hands_each_layer_over_without_concatenating(llama_tiny, gemma_tiny, tmp_path,
                                                                                   monkeypatch):
    # three turns, each ending mid-block: blocks stitched from two or three files, read into one segment
    for model in (llama_tiny, gemma_tiny):
        executor = make_executor(model)
        first = generate(executor, "a", history(21), 1).blocks
        store = _store(executor, tmp_path / str(id(model)))
        store.save("a", first)
        turns = [first]
        for k, add in enumerate((3, 6)):
            uid = executor.submit(Request("a", [*turns[-1].token_ids, *history(add - 1, seed=k)], 1), turns[-1], share=False)
            turns.append(run(executor)[uid].blocks)
            store.save("a", turns[-1])
        extents = manifest_mod.read(str(tmp_path / str(id(model)) / manifest_name("a")), executor.spec, FP, 4).extents["global"]
        assert len({e.key for e in extents}) > len({e.start // 4 for e in extents})  # some block has several files

        after = make_executor(model)
        loaded = _store(after, tmp_path / str(id(model))).load("a")
        _one_segment_per_layer(loaded)
        _identical_without_concatenating(loaded, turns[-1], monkeypatch)


def test_a_history_read_whole_gets_its_next_turns_room_so_that_turn_writes_into_the_segment_read(
        llama_tiny, tmp_path):
    n = 4101  # long enough for spare slots (``restored_spare``: none for a short history)
    executor = make_executor(llama_tiny, block_tokens=256)
    saved = generate(executor, "a", history(n), 1).blocks
    _store(executor, tmp_path).save("a", saved)
    after = make_executor(llama_tiny, block_tokens=256)
    loaded = _store(after, tmp_path).load("a")
    seg = loaded.groups["global"][0].segment_view.segment
    assert seg.n_tokens == n and seg.capacity == n + lending.restored_spare(n) > n
    uid = after.submit(Request("a", [*loaded.token_ids, *history(3, seed=1)], 2), loaded, share=False)
    done = run(after)[uid].blocks
    manager = after.cache_manager
    assert (manager.lent_turns, manager.copied_turns, manager.grown_segments) == (1, 0, 0)  # no grown copy
    assert {id(b.segment_view.segment) for b in done.groups["global"]} == {id(seg)} and seg.n_tokens == n + 4

    quantized = make_executor(llama_tiny, 8, block_tokens=256)  # no room for a kind that takes none
    _store(quantized, tmp_path / "q").save("a", generate(quantized, "a", history(n), 1).blocks)
    (group,) = _store(make_executor(llama_tiny, 8, block_tokens=256), tmp_path / "q").load("a").groups.values()
    seg = group[0].segment_view.segment
    assert seg.capacity == seg.n_tokens == n
    assert lending.restored_spare(2000) == 0  # a short history: none


# ---------------------------------------------------------------- damage


def test_a_corrupted_block_in_the_middle_of_a_run_is_quarantined_and_the_load_resumes_from_the_blocks_before_it(
        llama_tiny, tmp_path, monkeypatch):
    executor = make_executor(llama_tiny)
    saved = generate(executor, "a", history(39), 1).blocks  # ten blocks of 4
    _store(executor, tmp_path).save("a", saved)
    m = manifest_mod.read(str(tmp_path / manifest_name("a")), executor.spec, FP, 4)
    bad = m.extents["global"][5]  # positions 20..24
    path = _infos(tmp_path, executor.spec)[bad.key].path
    raw = bytearray(Path(path).read_bytes())
    raw[-len(raw) // 3] ^= 0xFF  # a tensor's byte in the file's middle: the header still checks
    Path(path).write_bytes(bytes(raw))

    after = make_executor(llama_tiny)
    again = _store(after, tmp_path)
    loaded = again.load("a")
    assert loaded.token_ids == saved.token_ids[: bad.start] == saved.token_ids[:20]
    assert again.stats().quarantined == 1 and "checksum" in again.quarantined[0].reason
    assert not Path(path).exists()
    _one_segment_per_layer(loaded)
    _identical_without_concatenating(loaded, saved, monkeypatch, upto=20)
    # the next turn prefills the rest, and its save writes the damaged block again: the whole history loads
    uid = after.submit(Request("a", [*saved.token_ids, 5], 1), loaded, share=False)
    turn = run(after)[uid].blocks
    again.save("a", turn)
    assert Path(path).exists()
    assert _store(make_executor(llama_tiny), tmp_path).load("a").token_ids == turn.token_ids


# ---------------------------------------------------------------- the reader


def _one_file(llama_tiny, tmp_path):
    executor = make_executor(llama_tiny)
    saved = generate(executor, "a", history(7), 1).blocks  # two blocks of 4
    _store(executor, tmp_path).save("a", saved)
    info = min(_infos(tmp_path, executor.spec).values(), key=lambda i: i.start)
    return executor, info


def test_rows_of_a_file_no_array_takes_are_read_only_to_be_hashed_and_still_checked(llama_tiny, tmp_path):
    executor, info = _one_file(llama_tiny, tmp_path)
    assert (info.start, info.end) == (0, 4)
    whole = {s.name: mx.zeros(s.shape, dtype=MX_DTYPES[s.dtype]) for s in info.slots}
    part = {s.name: mx.zeros((1, s.shape[1], 5, s.shape[3]), dtype=MX_DTYPES[s.dtype]) for s in info.slots}
    mx.eval(list(whole.values()), list(part.values()))
    blockread.read_file(blockread.Into(info, {k: blockread.writable(a) for k, a in whole.items()}))
    # rows 1..3 of the file into rows 2..4 of a bigger array: rows 0 and 3 are only hashed
    blockread.read_file(blockread.Into(info, {k: blockread.writable(a) for k, a in part.items()}, ((1, 3, 2),)))
    for name in whole:
        assert np.array_equal(np.array(part[name][..., 2:4, :]), np.array(whole[name][..., 1:3, :]))
        assert not np.array(part[name][..., [0, 1, 4], :]).any()

    raw = bytearray(Path(info.path).read_bytes())
    raw[len(raw) - sum(s.nbytes for s in info.slots)] ^= 0x01  # row 0 of the first tensor: not taken
    Path(info.path).write_bytes(bytes(raw))
    with pytest.raises(CacheCorruptError, match="checksum"):
        blockread.read_file(blockread.Into(info, {k: blockread.writable(a) for k, a in part.items()}, ((1, 3, 2),)))


def test_a_file_shorter_than_its_layout_is_corrupt_and_a_missing_one_is_unreadable(llama_tiny, tmp_path):
    executor, info = _one_file(llama_tiny, tmp_path)
    dests = {s.name: mx.zeros(s.shape, dtype=MX_DTYPES[s.dtype]) for s in info.slots}
    mx.eval(list(dests.values()))
    into = blockread.Into(info, {k: blockread.writable(a) for k, a in dests.items()})
    raw = Path(info.path).read_bytes()
    Path(info.path).write_bytes(raw[:-5])
    with pytest.raises(CacheCorruptError):
        blockread.read_file(into)
    Path(info.path).unlink()
    with pytest.raises(FileNotFoundError):
        blockread.read_file(into)


def test_read_all_stops_at_the_first_bad_file_and_returns_only_once_no_thread_reads(llama_tiny, tmp_path, monkeypatch):
    _, info = _one_file(llama_tiny, tmp_path)
    active, done, lock = [0], [], threading.Lock()

    def read_file(into):
        with lock:
            active[0] += 1
        try:
            time.sleep(0.02)
            if into.rows == ((3, 4, 0),):
                raise CacheCorruptError(into.info.path, "checksum mismatch")
        finally:
            with lock:
                active[0] -= 1
                done.append(into.rows)

    monkeypatch.setattr(blockread, "read_file", read_file)
    jobs = [blockread.Into(info, {}, ((k, k + 1, 0),)) for k in range(40)]
    with pytest.raises(CacheCorruptError):
        blockread.read_all(jobs)
    assert active[0] == 0  # nothing writes into the arrays once it has raised
    assert ((3, 4, 0),) in done and len(done) < len(jobs)  # the files after it were left unread
