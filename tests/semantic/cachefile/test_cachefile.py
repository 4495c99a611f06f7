"""Cache files: exact round trips, prefix sharing on load, atomic saves, and
every kind of damage refused with a named error."""

from __future__ import annotations

import json
import os
import struct

import mlx.core as mx
import numpy as np
import pytest
import xxhash

from semantic import (
    BlockPool,
    CacheCorruptError,
    CacheMismatchError,
    InvalidRequestError,
    LayerSpec,
    ModelCacheSpec,
    PoolExhaustedError,
    Request,
)
from semantic import cachefile
from semantic.cache import convert
from semantic.cachefile import atomic
from semantic.cachefile import DOC_HASH_KEY, DOC_KEY, FORMAT_VERSION
from tests.cache_helpers import (
    assert_identical,
    check_executor,
    make_executor,
    generate,
    history,
    run,
    synthetic,
)
from tests.tiny_models import tiny_gemma3

pytestmark = pytest.mark.compat

STEPS = 16


@pytest.fixture
def gemma_file(gemma_tiny, tmp_path):
    """A tiny Gemma cache of 43 tokens (window 8 wrapped) saved to disk: 37 and 6 of the 7 generated (the last
    is never fed)."""
    executor = make_executor(gemma_tiny)
    done = generate(executor, "a", history(37), 7)
    path = tmp_path / "a.safetensors"
    cachefile.save(path, done.blocks, model_fingerprint="tiny-gemma")
    return path, done.blocks, executor


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize(
    "which,kv_bits,n",
    [("llama", None, 21), ("llama", 8, 21), ("gemma", None, 37)],
    ids=["kv", "quantized-8bit", "gemma-window-wrapped"],
)
def test_a_loaded_cache_is_bit_identical_and_continues_like_a_fresh_prefill(
    llama_tiny, gemma_tiny, tmp_path, which, kv_bits, n
):
    model = llama_tiny if which == "llama" else gemma_tiny
    first = generate(make_executor(model, kv_bits), "a", history(n), 6)
    path = tmp_path / "a.safetensors"
    cachefile.save(path, first.blocks, model_fingerprint="tiny")

    executor = make_executor(model, kv_bits)  # a fresh pool, as after a restart
    loaded = cachefile.load(path, executor.pool, model_fingerprint="tiny")
    assert_identical(loaded, first.blocks)
    T = [11, 12, 13]
    cont = executor.submit(Request("a", [*loaded.token_ids, *T], STEPS), loaded, share=False)
    ref = executor.submit(Request("b", list(first.blocks.token_ids) + T, STEPS), share=False)
    done = run(executor)
    assert done[cont].cached_tokens == n + 5  # the last of the 6 generated tokens is never fed
    assert done[cont].token_ids == done[ref].token_ids
    check_executor(executor, done[cont], done[ref])  # both mlx-lm's own generation, within its measured noise


def test_loading_into_a_pool_that_holds_the_prefix_shares_its_full_blocks(gemma_file):
    path, original, executor = gemma_file
    pool = executor.pool
    before = pool.stats()
    loaded = cachefile.load(path, pool)
    assert_identical(loaded, original)
    # 43 tokens in blocks of 4: 10 full global blocks and the tail; the window [35, 43) as the
    # pooled block [32, 36) its edge references (the prefill's checkpoint at 36 pooled it), one full block, the tail
    shared = [b for b in loaded.unique_blocks() if any(b is o for o in original.unique_blocks())]
    assert [(b.group, b.start) for b in shared] == [("sliding-w8-k0", s) for s in (32, 36, 40)] + [
        ("global", 4 * i) for i in range(11)
    ]
    assert all(pool.refcount(b) == 2 for b in shared)
    after = pool.stats()
    assert (after.hits - before.hits, after.used - before.used) == (14, 0)  # nothing private: every block hit


def _address(a) -> int:
    return np.asarray(memoryview(a)).__array_interface__["data"][0]


def test_a_file_loads_as_one_segment_per_group_that_reconstruction_hands_over_without_a_copy(gemma_file):
    path, original, executor = gemma_file
    loaded = cachefile.load(path, BlockPool(executor.spec, 64, block_tokens=4))
    for group, blocks in loaded.groups.items():
        segments = {id(b.segment_view.segment) for b in blocks}
        assert len(segments) == 1, group
        assert [b.segment_view.start for b in blocks] == list(np.cumsum([0] + [b.n_tokens for b in blocks[:-1]]))
    caches = convert.reconstruct(loaded)
    for i, c in enumerate(caches):
        seg = loaded.blocks_for_layer(i)[0].segment_view.segment
        keys = seg.layer_data[i][0]
        # the segment itself, not a copy; a window starts 3 tokens into its stored edge block [32, 36)
        skip = loaded.total_tokens - c.keys.shape[2] - 32 if i % 2 == 0 else 0
        assert _address(c.keys) == _address(keys) + skip * keys.shape[-1] * keys.itemsize


def test_after_a_partial_hit_each_run_of_missed_blocks_gets_a_compact_segment(gemma_file):
    path, original, executor = gemma_file
    pool = executor.pool  # it holds the original's blocks: the full ones hit
    loaded = cachefile.load(path, pool)
    missed = [b for b in loaded.unique_blocks() if not any(b is o for o in original.unique_blocks())]
    assert missed == []  # tails are keyed and the window edge is the pooled block [32, 36): all hits
    assert_identical(loaded, original)
    other = BlockPool(executor.spec, 64, block_tokens=4)
    for b in cachefile.load(path, other).unique_blocks():  # into an empty pool: one compact segment per group
        assert b.segment_view.segment.n_tokens == (11 if b.group.startswith("sliding") else 43)


def test_a_file_loads_into_a_pool_of_another_block_size(gemma_file, gemma_tiny):
    path, original, _ = gemma_file
    for bt in (3, 16):
        pool = BlockPool(original.spec, 64, block_tokens=bt)
        loaded = cachefile.load(path, pool)
        assert loaded.block_tokens == bt
        assert_identical(loaded, original)


def test_bfloat16_and_float16_caches_round_trip(tmp_path):
    for dtype in ("bfloat16", "float16"):
        spec = ModelCacheSpec((LayerSpec("global", 2, 32, 16, dtype),) * 3)
        blocks = synthetic(spec, BlockPool(spec, 16, block_tokens=8), history(21), seed=3)
        path = tmp_path / f"{dtype}.safetensors"
        cachefile.save(path, blocks, model_fingerprint="synthetic")
        assert_identical(cachefile.load(path, BlockPool(spec, 16, block_tokens=8)), blocks)


def test_an_empty_history_round_trips(tmp_path, gemma_tiny):
    spec = ModelCacheSpec.from_model(gemma_tiny)
    blocks = synthetic(ModelCacheSpec((spec.layers[1],)), BlockPool(ModelCacheSpec((spec.layers[1],)), 4), [])
    path = tmp_path / "empty.safetensors"
    info = cachefile.save(path, blocks, model_fingerprint="x")
    assert info.total_tokens == 0 and info.slots == ()
    loaded = cachefile.load(path, BlockPool(blocks.spec, 4))
    assert loaded.total_tokens == 0 and loaded.unique_blocks() == []


# ---------------------------------------------------------------- the format


def test_the_file_is_plain_safetensors_with_one_document_in_its_metadata(gemma_file):
    from safetensors import safe_open
    from safetensors.numpy import load_file

    path, original, _ = gemma_file
    tensors = load_file(str(path))
    with safe_open(str(path), "np") as f:
        meta = f.metadata()
    doc = json.loads(meta[DOC_KEY])
    assert meta[DOC_HASH_KEY] == xxhash.xxh3_128(meta[DOC_KEY].encode()).hexdigest()
    assert doc["format_version"] == FORMAT_VERSION and doc["hash"] == "xxh3_128"
    assert doc["model_fingerprint"] == "tiny-gemma"
    assert doc["token_ids"] == list(original.token_ids)
    assert ModelCacheSpec.from_dict(doc["spec"]) == original.spec
    assert {"mlx", "mlx_lm"} <= set(doc)
    assert doc["layers"][0] == {
        "cache": "RotatingKVCache", "offset": 43, "window": 8, "keep": 0, "ring_idx": 8, "bits": None, "group_size": None,
    }
    assert doc["layers"][1]["cache"] == "KVCache" and doc["layers"][1]["ring_idx"] is None
    # one tensor per layer and part: (1, heads, stored tokens, dim); a window holds tokens 35..42,
    # stored from 32: its edge references the pooled block [32, 36), which the file keeps whole
    assert doc["stored_from"] == {"sliding-w8-k0": 32}
    assert {n: t.shape for n, t in tensors.items()} == {
        f"layer.{i}.{side}": (1, 1, 11 if i % 2 == 0 else 43, 32) for i in range(4) for side in ("keys", "values")
    }
    assert sorted(doc["tensors"]) == sorted(tensors)
    for name, digest in doc["tensors"].items():
        assert xxhash.xxh3_128(tensors[name].tobytes()).hexdigest() == digest
    assert set(mx.load(str(path))) == set(tensors)


def test_header_reads_without_the_data(gemma_file):
    path, original, _ = gemma_file
    info = cachefile.read_header(path)
    assert info.token_ids == original.token_ids and info.spec == original.spec
    assert info.nbytes == os.path.getsize(path) and info.agent_id is None


# ---------------------------------------------------------------- damage


def _rewrite(path, table=None, doc=None, fix_hash=True):
    """Edit a file's header (and its document) in place, keeping the data."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header, data = json.loads(raw[8 : 8 + n]), raw[8 + n :]
    if doc is not None:
        d = json.loads(header["__metadata__"][DOC_KEY])
        doc(d)
        text = json.dumps(d, sort_keys=True, separators=(",", ":"))
        header["__metadata__"][DOC_KEY] = text
        if fix_hash:
            header["__metadata__"][DOC_HASH_KEY] = xxhash.xxh3_128(text.encode()).hexdigest()
    if table is not None:
        table(header)
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def _flip(path, offset_from_end=None, offset=None):
    raw = bytearray(path.read_bytes())
    i = offset if offset is not None else len(raw) - offset_from_end
    raw[i] ^= 0x10
    path.write_bytes(bytes(raw))


def _first_tensor(h):
    return next(k for k in h if k != "__metadata__")


def _set(h, field, value):
    h[_first_tensor(h)][field] = value


DAMAGE = {
    "empty file": (lambda p: p.write_bytes(b""), "no header length"),
    "truncated data": (lambda p: p.write_bytes(p.read_bytes()[:-1]), "truncated or extended"),
    "truncated header": (lambda p: p.write_bytes(p.read_bytes()[:100]), "does not fit"),
    "extended": (lambda p: p.write_bytes(p.read_bytes() + b"\0"), "truncated or extended"),
    "bit flip in the last tensor": (lambda p: _flip(p, offset_from_end=3), "checksum mismatch"),
    "bit flip in the document": (lambda p: _flip(p, offset=60), "document checksum mismatch|not JSON"),
    "edited token id": (lambda p: _rewrite(p, doc=lambda d: d["token_ids"].__setitem__(0, 7), fix_hash=False), "document checksum"),
    "missing tensor": (lambda p: _rewrite(p, table=lambda h: h.pop(_first_tensor(h))), "is missing"),
    "wrong shape": (lambda p: _rewrite(p, table=lambda h: _set(h, "shape", [1, 1, 1, 1, 1])), "layout needs"),
    "wrong dtype": (lambda p: _rewrite(p, table=lambda h: _set(h, "dtype", "F16")), "layout needs"),
    "unknown format version": (lambda p: _rewrite(p, doc=lambda d: d.update(format_version=3)), "unknown format version 3"),
    "not a cache file": (lambda p: mx.save_safetensors(str(p), {"x": mx.zeros(3)}), "not a semantic-kv cache file"),
    "malformed document": (lambda p: _rewrite(p, doc=lambda d: d.pop("spec")), "malformed document"),
    "edited layer meta": (lambda p: _rewrite(p, doc=lambda d: d["layers"][0].update(ring_idx=3)), "per-layer cache meta"),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_each_kind_of_damage_raises_cache_corrupt_error_naming_file_and_reason(gemma_file, case):
    path, _, executor = gemma_file
    damage, reason = DAMAGE[case]
    damage(path)
    fresh = BlockPool(executor.spec, 64, block_tokens=4)
    with pytest.raises(CacheCorruptError, match=reason) as err:
        cachefile.load(path, fresh)
    assert err.value.path == str(path) and str(path) in str(err.value)
    assert fresh.stats().used == 0


def test_a_failed_load_leaves_the_pool_unchanged(gemma_file):
    path, _, executor = gemma_file
    _flip(path, offset_from_end=1)  # the last tensor: every other one verifies first
    pool = BlockPool(executor.spec, 64, block_tokens=4)
    before = pool.stats()
    with pytest.raises(CacheCorruptError, match="checksum mismatch"):
        cachefile.load(path, pool)
    assert pool.stats() == before


def test_another_model_or_spec_raises_cache_mismatch_error(gemma_file, llama_tiny):
    path, _, executor = gemma_file
    with pytest.raises(CacheMismatchError, match="written for model 'tiny-gemma', not 'other'"):
        cachefile.load(path, BlockPool(executor.spec, 64, block_tokens=4), model_fingerprint="other")
    llama = ModelCacheSpec.from_model(llama_tiny)
    with pytest.raises(CacheMismatchError, match="another cache spec"):
        cachefile.load(path, BlockPool(llama, 64, block_tokens=4))
    narrower = ModelCacheSpec.from_model(tiny_gemma3(window=4))
    with pytest.raises(CacheMismatchError):
        cachefile.load(path, BlockPool(narrower, 64, block_tokens=4))


def test_a_pool_too_small_raises_before_taking_any_block(gemma_file):
    path, _, executor = gemma_file
    pool = BlockPool(executor.spec, 5, block_tokens=4)
    with pytest.raises(PoolExhaustedError, match=r"of free blocks \(14 of 4 tokens\)"):
        cachefile.load(path, pool)
    assert pool.stats().used == 0


# ---------------------------------------------------------------- saving


def test_saving_replaces_the_old_file_and_leaves_no_temporary_file(gemma_file, gemma_tiny):
    path, original, executor = gemma_file
    longer = generate(executor, "a", list(original.token_ids) + [5, 6], 3).blocks
    cachefile.save(path, longer, model_fingerprint="tiny-gemma")
    cachefile.settle()  # the replaced file is deleted in the background
    assert os.listdir(path.parent) == [path.name]
    assert_identical(cachefile.load(path, BlockPool(executor.spec, 64, block_tokens=4)), longer)


def test_a_save_that_fails_midway_keeps_the_old_file(gemma_file, monkeypatch):
    path, original, executor = gemma_file
    before = path.read_bytes()
    calls = []
    write = atomic._Writer.write

    def failing(self, views):  # the second tensor finds the disk full
        calls.append(len(views))
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        write(self, views)

    monkeypatch.setattr(atomic._Writer, "write", failing)
    with pytest.raises(OSError, match="No space left"):
        cachefile.save(path, original, model_fingerprint="tiny-gemma")
    assert path.read_bytes() == before
    assert os.listdir(path.parent) == [path.name]


def test_released_blocks_and_bad_arguments_are_refused(gemma_file, tmp_path):
    path, original, executor = gemma_file
    with pytest.raises(InvalidRequestError, match="model_fingerprint"):
        cachefile.save(tmp_path / "x.safetensors", original, model_fingerprint="")
    original.release()
    with pytest.raises(CacheMismatchError, match="released"):
        cachefile.save(tmp_path / "x.safetensors", original, model_fingerprint="m")
    assert not (tmp_path / "x.safetensors").exists()
