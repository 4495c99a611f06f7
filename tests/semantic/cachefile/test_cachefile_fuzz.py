"""Thousands of damaged cache files: each loads bit-identically or raises one of ours.

A seeded mutator flips bits, truncates, extends, overwrites, deletes,
duplicates and swaps byte ranges, and rewrites the header length, across
the whole file and the header in particular (where parsing happens). A
second one edits the parsed header and document behind a recomputed
checksum, as a buggy or hostile writer would, to reach the checks behind it.
Anything but a :class:`CacheError` or an exact load fails the test; a crash
would take the test process down with it.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import xxhash

from semantic import BlockPool, CacheError, cachefile
from semantic.cachefile import DOC_HASH_KEY, DOC_KEY
from tests.cache_helpers import assert_identical, make_executor, generate, history
from tests.fuzzing import cases

pytestmark = pytest.mark.compat

CASES = cases(full=4000, quick=800)  # per base file; a few seconds each at the full count
HEADER_CASES = cases(full=1000, quick=250)


def _header_end(raw: bytes) -> int:
    return 8 + int.from_bytes(raw[:8], "little")


def _mutate(raw: bytes, rng: np.random.Generator) -> bytes:
    b = bytearray(raw)
    hi = _header_end(raw) if rng.random() < 0.5 else len(b)  # half the time, aim at the header
    pos = lambda: int(rng.integers(0, hi))  # noqa: E731
    span = lambda: int(rng.integers(1, 64))  # noqa: E731
    kind = int(rng.integers(0, 9))
    if kind == 0:
        for _ in range(int(rng.integers(1, 9))):
            i = pos()
            b[i] ^= 1 << int(rng.integers(0, 8))
    elif kind == 1:
        del b[pos():]
    elif kind == 2:
        b += rng.bytes(span())
    elif kind == 3:
        i, n = pos(), span()
        b[i : i + n] = rng.bytes(len(b[i : i + n]))
    elif kind == 4:
        i = pos()
        del b[i : i + span()]
    elif kind == 5:
        i, n = pos(), span()
        b[i:i] = b[i : i + n]
    elif kind == 6:
        b[:8] = int(rng.choice([0, 1, 7, len(b), 2**63, int(rng.integers(0, 2**31))])).to_bytes(8, "little")
    elif kind == 7:
        i, j, n = pos(), pos(), span()
        b[i : i + n], b[j : j + n] = bytes(b[j : j + n]), bytes(b[i : i + n])
    else:
        i = pos()
        b[i : i + span()] = bytes(len(b[i : i + span()]))
    return bytes(b)


@pytest.mark.fuzz
@pytest.mark.parametrize("which,kv_bits,n", [("gemma", None, 37), ("llama", 8, 9)], ids=["gemma-wrapped", "quantized"])
def test_every_mutated_file_loads_bit_identically_or_raises_a_cache_error(
    llama_tiny, gemma_tiny, tmp_path, which, kv_bits, n
):
    model = gemma_tiny if which == "gemma" else llama_tiny
    executor = make_executor(model, kv_bits)
    original = generate(executor, "a", history(n), 6).blocks
    path = tmp_path / "a.safetensors"
    cachefile.save(path, original, model_fingerprint="fuzz")
    raw = path.read_bytes()
    rng = np.random.default_rng(20260122 + n)
    outcomes = {"loaded": 0, "refused": 0}
    for case in range(CASES):
        mutated = _mutate(raw, rng)
        path.write_bytes(mutated)
        pool = BlockPool(executor.spec, 64, block_tokens=4)
        try:
            loaded = cachefile.load(path, pool, model_fingerprint="fuzz")
        except CacheError:
            outcomes["refused"] += 1
            assert pool.stats().used == 0, f"case {case}: a refused load took blocks"
            continue
        except Exception as exc:  # noqa: BLE001 - the point of the test
            pytest.fail(f"case {case}: {type(exc).__name__}: {exc}")
        assert_identical(loaded, original)
        outcomes["loaded"] += 1
    assert outcomes["refused"] > CASES * 0.9, outcomes  # nearly every mutation must be caught


ODD_VALUES = [None, True, False, 0, 1, -1, 2, 3, 7, 2**40, 1.5, "", "x", "F32", "global", [], [1], [0, 1], {}, {"a": 1}]


def _paths(node, prefix=()):
    """Every (path, value) in a JSON tree; token ids are left out (see below)."""
    yield prefix, node
    if isinstance(node, dict):
        for k, v in node.items():
            if k != "token_ids":
                yield from _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, (*prefix, i))


def _edit(tree, rng: np.random.Generator):
    path, _ = list(_paths(tree))[int(rng.integers(1, sum(1 for _ in _paths(tree))))]
    parent = tree
    for k in path[:-1]:
        parent = parent[k]
    if isinstance(parent, dict) and rng.random() < 0.2:
        del parent[path[-1]]
    else:
        parent[path[-1]] = ODD_VALUES[int(rng.integers(0, len(ODD_VALUES)))]


@pytest.mark.fuzz
def test_headers_edited_behind_a_valid_checksum_load_identically_or_raise_a_cache_error(gemma_tiny, tmp_path):
    """Token ids are not edited: new ids with a recomputed checksum are a
    forgery, which checksums (unlike signatures) cannot tell from the truth."""
    executor = make_executor(gemma_tiny)
    original = generate(executor, "a", history(21), 4).blocks
    path = tmp_path / "a.safetensors"
    cachefile.save(path, original, model_fingerprint="fuzz")
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header, data = json.loads(raw[8 : 8 + n]), raw[8 + n :]
    rng = np.random.default_rng(7)
    refused = 0
    for case in range(HEADER_CASES):
        h = json.loads(json.dumps(header))
        doc = json.loads(h["__metadata__"][DOC_KEY])
        _edit(doc if rng.random() < 0.6 else h, rng)
        if isinstance(h.get("__metadata__"), dict):
            text = json.dumps(doc)
            h["__metadata__"][DOC_KEY] = text
            h["__metadata__"][DOC_HASH_KEY] = xxhash.xxh3_128(text.encode()).hexdigest()
        blob = json.dumps(h).encode()
        path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)
        try:
            loaded = cachefile.load(path, BlockPool(executor.spec, 64, block_tokens=4), model_fingerprint="fuzz")
        except CacheError:
            refused += 1
            continue
        except Exception as exc:  # noqa: BLE001 - the point of the test
            pytest.fail(f"case {case}: {type(exc).__name__}: {exc}")
        assert_identical(loaded, original)
    assert refused > HEADER_CASES * 0.8
