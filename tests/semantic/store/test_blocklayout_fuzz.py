"""Thousands of damaged block files and manifests: every load is exact, an exact prefix, or a miss.

Two agents share a prompt on disk (block layout, gemma's sliding window wrapped, and a quantized
llama). Each case restores the directory, damages it once, and opens a store over it with a fresh
pool, as a restart would (or opens the store first, so that only the load's checks stand), then
loads both agents in a random order. The damage, as
test_persistence_fuzz.py does for cache files: bit flips, truncations, insertions, deletions,
duplicated, swapped and zeroed byte ranges, header lengths; JSON edits of a block file's header or
a manifest's document, checksummed again (a buggy writer) or not (bit rot); manifests whose extents
name another group's or another position's block file, checksummed again; block files and
manifests swapped, copied over each other, or deleted. A load must return the saved cache exactly,
or a prefix of it whose every block is the saved one's (so its continuation is a fresh prefill's:
see test_store_blocks.py), or None; the store must not raise, and must give back every block.
Below it, the forged manifests the fuzzer found, one test each.
"""

from __future__ import annotations

import json
import os
import struct
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import xxhash

from semantic import AgentCacheStore, BlockPool
from semantic.cachefile import DOC_HASH_KEY, DOC_KEY
from semantic.store import manifest, manifest_name
from tests.cache_helpers import assert_identical, make_executor, generate, history
from tests.fuzzing import cases
from tests.semantic.store.test_blocklayout import _rechecksum, _shared, _store
from tests.semantic.cachefile.test_cachefile_fuzz import _edit, _mutate

pytestmark = pytest.mark.compat

# per model: 1000 under make test-slow (2000 in all, about 30 s), 300 in make test; `make fuzz-blocks` sets 5000
# (10,000 damaged directories in all)
CASES = int(os.environ.get("SEMANTIC_FUZZ_CASES") or cases(full=1000, quick=300))
FP = "fuzz"


def _flat(x) -> list:
    return list(x) if isinstance(x, tuple) else [x]


def _same_prefix(loaded, original) -> None:
    """``loaded`` holds a prefix of ``original``'s history, and each of its blocks is ``original``'s
    block at the same place (cut to its length) bit for bit."""
    assert original.token_ids[: loaded.total_tokens] == loaded.token_ids
    for group, blocks in loaded.groups.items():
        theirs = {b.start: b for b in original.groups[group]}
        for b in blocks:
            o = theirs[b.start]
            assert o.n_tokens >= b.n_tokens and o.token_ids[: b.n_tokens] == b.token_ids
            for layer, (k, v) in b.layer_data.items():
                for x, y in zip(_flat(k) + _flat(v), _flat(o.layer_data[layer][0]) + _flat(o.layer_data[layer][1])):
                    assert np.array_equal(np.array(x), np.array(y[..., : b.n_tokens, :]))


def _snapshot(d: Path) -> dict[Path, bytes]:
    return {p.relative_to(d): p.read_bytes() for p in d.rglob("*") if p.is_file()}


def _restore(d: Path, files: dict[Path, bytes]) -> None:
    """Put ``d`` back as ``files`` (rewriting only what changed: removing directories is slow here)."""
    for p in [p for p in d.rglob("*") if p.is_file() and p.relative_to(d) not in files]:
        p.unlink()
    for rel, raw in files.items():
        p = d / rel
        if not p.is_file() or p.read_bytes() != raw:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(raw)


def _mutate_text(raw: bytes, rng: np.random.Generator) -> bytes:
    """Byte damage for a manifest (JSON, no length prefix)."""
    b = bytearray(raw)
    i, n = int(rng.integers(0, len(b))), int(rng.integers(1, 64))
    kind = int(rng.integers(0, 6))
    if kind == 0:
        for _ in range(int(rng.integers(1, 9))):
            j = int(rng.integers(0, len(b)))
            b[j] ^= 1 << int(rng.integers(0, 8))
    elif kind == 1:
        del b[i:]
    elif kind == 2:
        b[i:i] = rng.bytes(n)
    elif kind == 3:
        del b[i : i + n]
    elif kind == 4:
        b[i:i] = b[i : i + n]
    else:
        b[i : i + n] = rng.bytes(len(b[i : i + n]))
    return bytes(b)


def _edit_block_header(raw: bytes, rng: np.random.Generator) -> bytes:
    (n,) = struct.unpack("<Q", raw[:8])
    h, data = json.loads(raw[8 : 8 + n]), raw[8 + n :]
    doc = json.loads(h["__metadata__"][DOC_KEY])
    _edit(doc if rng.random() < 0.7 else h, rng)
    if isinstance(h.get("__metadata__"), dict) and rng.random() < 0.8:
        text = json.dumps(doc)
        h["__metadata__"][DOC_KEY] = text
        h["__metadata__"][DOC_HASH_KEY] = xxhash.xxh3_128(text.encode()).hexdigest()
    blob = json.dumps(h).encode()
    return struct.pack("<Q", len(blob)) + blob + data


def _edit_manifest(raw: bytes, rng: np.random.Generator, swap_keys: bool) -> bytes:
    outer = json.loads(raw)
    doc = json.loads(outer[manifest.DOC_KEY])
    if swap_keys:  # two extents trade block files: of another group, or of another place
        rows = [r for ex in doc["extents"].values() for r in ex]
        i, j = rng.choice(len(rows), 2, replace=False)
        rows[i][0], rows[j][0] = rows[j][0], rows[i][0]
    else:
        _edit(doc if rng.random() < 0.8 else outer, rng)
    if isinstance(outer, dict) and (swap_keys or rng.random() < 0.8):
        text = json.dumps(doc, separators=(",", ":"))
        outer[manifest.DOC_KEY] = text
        outer[manifest.HASH_KEY] = xxhash.xxh3_128(text.encode()).hexdigest()
    return json.dumps(outer).encode()


def _damage(d: Path, rng: np.random.Generator, after_startup: bool) -> str:
    """Damage the directory once; what was done. After startup, no manifest is swapped or copied over
    another: a load would serve the other agent's cache (see the xfail test in test_store_blocks.py)."""
    blocks = sorted(d.glob("blocks-*/*.kvb"))
    manifests = sorted(d.glob("*.kvm"))
    kind = int(rng.integers(0, 8))
    if kind <= 1:
        p = blocks[int(rng.integers(0, len(blocks)))]
        p.write_bytes(_mutate(p.read_bytes(), rng))
        return "block bytes"
    if kind == 2:
        p = blocks[int(rng.integers(0, len(blocks)))]
        p.write_bytes(_edit_block_header(p.read_bytes(), rng))
        return "block header"
    if kind == 3:
        p = manifests[int(rng.integers(0, len(manifests)))]
        p.write_bytes(_mutate_text(p.read_bytes(), rng))
        return "manifest bytes"
    if kind <= 5:
        p = manifests[int(rng.integers(0, len(manifests)))]
        p.write_bytes(_edit_manifest(p.read_bytes(), rng, swap_keys=kind == 5))
        return "manifest keys swapped" if kind == 5 else "manifest document"
    if kind == 6:
        pool = blocks if after_startup or rng.random() < 0.7 else manifests
        i, j = rng.choice(len(pool), 2, replace=False)
        x, y = pool[i].read_bytes(), pool[j].read_bytes()
        pool[j].write_bytes(x)
        if rng.random() < 0.5:
            pool[i].write_bytes(y)
            return "files swapped"
        return "file copied over another"
    victim = (blocks + manifests)[int(rng.integers(0, len(blocks) + len(manifests)))]
    victim.unlink()
    return "file deleted"


def _originals(executor, seed: int) -> dict:
    """Agents "a" and "b" on a shared prompt of 14 tokens: b's third block holds two of a's tokens.

    b starts from the pool, as the engine serves, so its K/V at the shared positions are a's bit for
    bit. Recomputed instead (``share=False``), they may differ from a's in the last bit (a BLAS rounds
    a row differently as the rows of a matmul change: OpenBLAS's Haswell kernels for 23 and 24 rows),
    while b's save names a's block file for those positions (their tokens are the same): a load then
    rightly returns a's K/V there, and no exact comparison with b's own could hold."""
    prompt = history(14, seed=seed)
    return {a: generate(executor, a, [*prompt, *history(9 + i, seed=seed + i)], 4, share=True).blocks
            for i, a in enumerate("ab")}


def test_the_second_agent_holds_the_first_agents_kv_where_their_histories_agree(llama_tiny):
    executor = make_executor(llama_tiny, 8)
    o = _originals(executor, 2026_11_25)
    for group, blocks in o["b"].groups.items():
        theirs = {x.start: x for x in o["a"].groups[group]}
        b = next(x for x in blocks if x.start == 12)  # tokens 12 and 13 shared, 14 and 15 not
        assert theirs[12].token_ids[:2] == b.token_ids[:2] and theirs[12].token_ids[2:] != b.token_ids[2:4]
        for layer, (k, v) in b.layer_data.items():
            ak, av = theirs[12].layer_data[layer]
            for x, y in zip(_flat(k) + _flat(v), _flat(ak) + _flat(av)):
                assert np.array_equal(np.array(x[..., :2, :]), np.array(y[..., :2, :]))


def fuzz(model, kv_bits, cases: int, seed: int, workdir: Path) -> Counter:
    """Save two agents on a shared prompt, then damage and load ``cases`` times; outcome counts
    (raises AssertionError at the first load that is neither exact, an exact prefix, nor a miss)."""
    executor = make_executor(model, kv_bits)
    originals = _originals(executor, seed)
    pristine = workdir / "pristine"
    store = AgentCacheStore(pristine, executor.spec, FP, 10**9, pool=executor.pool, durable=False)
    for a, c in originals.items():
        store.save(a, c)
    undamaged = AgentCacheStore(pristine, executor.spec, FP, 10**9, pool=BlockPool(executor.spec, 64, block_tokens=4),
                                durable=False)
    for a, c in originals.items():  # the oracle: without damage, every load is exact
        loaded = undamaged.load(a)
        assert_identical(loaded, c)
        loaded.release()
    files = _snapshot(pristine)
    d = workdir / "cache"
    rng = np.random.default_rng(seed)
    seen = Counter()
    for case in range(cases):
        _restore(d, files)
        pool = BlockPool(executor.spec, 64, block_tokens=4)
        after_startup, what = rng.random() < 0.4, "startup"  # after startup: only the load's checks stand
        try:
            if after_startup:
                store = AgentCacheStore(d, executor.spec, FP, 10**9, pool=pool, durable=False)
            what = _damage(d, rng, after_startup) + (" after startup" if after_startup else "")
            if not after_startup:
                store = AgentCacheStore(d, executor.spec, FP, 10**9, pool=pool, durable=False)
            got = {a: store.load(a) for a in (("a", "b") if rng.random() < 0.5 else ("b", "a"))}
        except Exception as exc:  # noqa: BLE001 - the point of the test
            raise AssertionError(f"case {case} ({what}): {type(exc).__name__}: {exc}") from exc
        for a, loaded in got.items():
            try:
                if loaded is None:
                    seen["miss"] += 1
                elif loaded.total_tokens == originals[a].total_tokens:
                    assert_identical(loaded, originals[a])
                    seen["exact"] += 1
                else:
                    _same_prefix(loaded, originals[a])
                    seen["prefix"] += 1
            except AssertionError as exc:
                raise AssertionError(f"case {case} ({what}), agent {a}: a silent difference: {exc}") from exc
            if loaded is not None:
                loaded.release()
        assert pool.stats().used == 0, f"case {case} ({what}): the store kept blocks"
        seen[what] += 1
    return seen


@pytest.mark.fuzz
@pytest.mark.parametrize("which,kv_bits", [("gemma", None), ("llama", 8)], ids=["gemma-wrapped", "quantized"])
def test_every_damaged_block_file_or_manifest_loads_exactly_as_an_exact_prefix_or_not_at_all(
    llama_tiny, gemma_tiny, tmp_path, which, kv_bits
):
    seen = fuzz(gemma_tiny if which == "gemma" else llama_tiny, kv_bits, CASES, 2026_11_25, tmp_path)
    assert seen["exact"] and seen["prefix"] and seen["miss"], seen  # the fuzzer reaches every outcome
    print(f"{which}: {CASES} damaged directories, {dict(seen)}")  # `make fuzz-blocks` shows the tally


def test_a_manifest_naming_another_groups_block_file_is_refused_not_loaded(gemma_tiny, tmp_path):
    executor = make_executor(gemma_tiny)
    c = generate(executor, "a", history(29), 1).blocks
    _store(executor, tmp_path).save("a", c)

    def swap(doc):  # same positions, same tokens, another group: only the group tells the files apart
        ex = doc["extents"]
        mine = ex[next(g for g in ex if g != "global")][0]
        theirs = next(r for r in ex["global"] if r[1:] == mine[1:])
        mine[0], theirs[0] = theirs[0], mine[0]

    _rechecksum(tmp_path / manifest_name("a"), swap)
    again = _store(make_executor(gemma_tiny), tmp_path)
    assert again.load("a") is None  # the sliding window's first block is gone: no prefix holds the window
    assert again.stats().misses == 1 and again.pool.stats().used == 0


def test_a_manifest_replaced_by_another_agents_after_startup_is_refused_not_served(llama_tiny, tmp_path):
    executor = make_executor(llama_tiny)
    caches = _shared(executor, 2)
    store = _store(executor, tmp_path)
    for a, c in caches.items():
        store.save(a, c)
    again = _store(make_executor(llama_tiny), tmp_path)
    (tmp_path / manifest_name("a")).write_bytes((tmp_path / manifest_name("b")).read_bytes())
    assert again.load("a") is None and again.stats().quarantined == 1
