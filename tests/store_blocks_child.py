"""The writer side of the block layout's crash tests (tests/semantic/store/test_blocklayout_crash.py).

``python -m tests.store_blocks_child DIR POINT`` saves agent "a"'s old history durably in the block
layout, then saves its new one and dies (``os._exit(CRASHED)``: no cleanup, no flush) at ``POINT``:

    block-2                 right after the new history's 2nd block file is in place
    mid-block               the 3rd block file written under its temporary name, not renamed
    before-manifest-rename  every block file durable, the manifest written under its temporary name
    after-manifest-rename   the manifest renamed over the old one, before its directory's fsync and
                            before the old history's unused block files are collected

``python -m tests.store_blocks_child DIR soak`` prints ``ready``, then for each ``kill <ms>`` line
forks a writer that saves the two histories in turn, forever, SIGKILLs it after that many
milliseconds and prints ``killed`` (as tests/persistence_child.py does for cache files: the
caches' bytes are made ready before forking, since MLX cannot compute in a forked child).

The new history is an edited conversation: it keeps the old one's first 22 tokens and goes on
differently, so the old history's tail files become garbage once the new manifest is in place.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache

from semantic import AgentCacheStore, BlockPool, LayerSpec, ModelCacheSpec, cachefile
from semantic.cache.convert import extract
from semantic.store import blockformat

SPEC = ModelCacheSpec((LayerSpec("global", 2, 16, 16, "float32"),) * 2)
FINGERPRINT = "crash-test"
BLOCK_TOKENS = 4
CRASHED = 17
POINTS = ("block-2", "mid-block", "before-manifest-rename", "after-manifest-rename")
OLD = list(range(1, 31))                           # 30 tokens: 7 full blocks and half of the 8th
NEW = OLD[:22] + list(range(100, 121))             # 43 tokens, the first 22 shared


def versions(pool: BlockPool):
    """The old and the new history's caches; their first 22 positions hold the same K/V."""
    k0, k1 = mx.random.split(mx.random.key(38))
    shape = (1, 2, len(NEW), 16)
    base_k, base_v = mx.random.normal(shape, key=k0), mx.random.normal(shape, key=k1)
    odd_k, odd_v = mx.random.normal(shape, key=k1), mx.random.normal(shape, key=k0)
    out = []
    for tokens, (k, v) in ((OLD, (base_k, base_v)), (NEW, (mx.concatenate([base_k[:, :, :22], odd_k[:, :, 22:]], axis=2),
                                                         mx.concatenate([base_v[:, :, :22], odd_v[:, :, 22:]], axis=2)))):
        caches = []
        for _ in SPEC.layers:
            c = mlx_cache.KVCache()
            c.update_and_fetch(k[:, :, : len(tokens)], v[:, :, : len(tokens)])
            caches.append(c)
        out.append(extract(pool, caches, tokens))
    return out


def _crash_at(point: str) -> None:
    real_write, real_replace = blockformat.write, os.replace
    count = {"kvb": 0}

    def write(*a, **kw):
        info = real_write(*a, **kw)
        count["kvb"] += 1
        if point == "block-2" and count["kvb"] == 2:
            os._exit(CRASHED)
        return info

    def replace(src, dst, *a, **kw):
        dst = str(dst)
        if point == "mid-block" and dst.endswith(blockformat.BLOCK_SUFFIX) and count["kvb"] == 2:
            os._exit(CRASHED)
        if point == "before-manifest-rename" and dst.endswith(".kvm"):
            os._exit(CRASHED)
        real_replace(src, dst, *a, **kw)
        if point == "after-manifest-rename" and dst.endswith(".kvm"):
            os._exit(CRASHED)

    blockformat.write, os.replace = write, replace


def soak(directory: str) -> None:
    pool = BlockPool(SPEC, 64, block_tokens=BLOCK_TOKENS)
    versions = versions_ready(pool)
    prepared = [cachefile.prepare_save(v) for v in versions]
    print("ready", flush=True)
    for line in sys.stdin:
        cmd, *arg = line.split()
        if cmd != "kill":
            break
        pid = os.fork()
        if pid == 0:
            try:
                store = AgentCacheStore(directory, SPEC, FINGERPRINT, 10**9, pool=pool, durable=True)
                while True:
                    for v, p in zip(versions, prepared):
                        store.save("a", v, p)
            finally:
                os._exit(1)
        time.sleep(int(arg[0]) / 1000)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        print("killed", flush=True)


def versions_ready(pool: BlockPool):
    """:func:`versions`, each block's bytes contiguous and evaluated (nothing left for MLX to compute)."""
    out = versions(pool)
    for v in out:
        for b in v.unique_blocks():
            b.layer_data = {i: (mx.contiguous(k), mx.contiguous(vv)) for i, (k, vv) in b.layer_data.items()}
            b.segment_view = None
    mx.eval([b.layer_data for v in out for b in v.unique_blocks()])
    return out


def main(directory: str, point: str) -> None:
    if point == "soak":
        return soak(directory)
    assert point in POINTS, point
    pool = BlockPool(SPEC, 64, block_tokens=BLOCK_TOKENS)
    old, new = versions(pool)
    store = AgentCacheStore(directory, SPEC, FINGERPRINT, 10**9, pool=pool, durable=True)
    store.save("a", old)
    _crash_at(point)
    store.save("a", new)
    print("the save finished: no crash point was reached", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:3])
