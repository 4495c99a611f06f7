"""In this process, one agent's cache of the real geometry and length: our store's save and restore beside
mlx-lm's ``save_prompt_cache`` / ``load_prompt_cache`` and the floors (``floors``), interleaved rep by rep.

Saves (the live caches built once; each rep's order rotates): ``AgentCacheStore.save`` (blocks layout, durable:
every file fsynced) into a fresh directory; ``save_prompt_cache`` into one file, timed without and with an
fsync after it (mlx-lm does not fsync); an fsync'd sequential write of as many bytes as ours wrote.

Restores (the live caches freed first), page cache dropped (cold) and then warm: ``AgentCacheStore.load``
from a store opened beforehand (as the server opens its own at start), every checksum verified (the loader
always does), then ``reconstruct`` into live mlx-lm caches (what a turn computes with); ``load_prompt_cache``
with every array evaluated; a sequential read of our files (cold: the disk's floor; warm: a read from the page
cache) and, warm, a memcpy of as many bytes.
"""

from __future__ import annotations

import gc
import os
import shutil
import time
from pathlib import Path

from harness.trials.real_geometry import floors
from harness.trials.real_geometry.synthetic import BLOCK_TOKENS, PUBLIC, agent_files, live_caches, pool_blocks

AGENT = "inproc"


def _arrays(x) -> list:
    out = []
    if isinstance(x, (list, tuple)):
        for y in x:
            out.extend(_arrays(y))
    elif hasattr(x, "shape") and hasattr(x, "dtype"):
        out.append(x)
    return out


def _cache_arrays(caches) -> list:
    return [a for c in caches for a in _arrays(c.state)]


def _blocks_arrays(blocks) -> list:
    out = []
    for group in blocks.groups.values():
        for b in group:
            for data in b.layer_data.values():
                out.extend(_arrays(data))
    return out


def _rotate(xs: list, r: int) -> list:
    r %= len(xs)
    return xs[r:] + xs[:r]


def saves(spec, fingerprint: str, ids: list[int], work: Path, reps: int, bufs: floors.Buffers, seed: int,
          also_into: Path | None = None) -> dict:
    """Build the live caches once; ``reps`` rounds of our save, mlx-lm's and the floor write. Keeps the last
    round's files (``work/ours``, ``work/mlx.safetensors``) for :func:`loads`. ``also_into``: one more save of
    the same cache into the server's directory (not timed in the rows: it is the same call)."""
    import mlx.core as mx
    from mlx_lm.models.cache import save_prompt_cache

    from semantic.cache.convert import extract
    from semantic.cache.pool import BlockPool
    from semantic.store import AgentCacheStore

    t0 = time.perf_counter()
    caches = live_caches(spec, len(ids), seed)
    pool = BlockPool(spec, total_blocks=pool_blocks(spec, len(ids)), block_tokens=BLOCK_TOKENS)
    blocks = extract(pool, caches, ids)
    build_s = time.perf_counter() - t0
    cache_bytes = sum(a.nbytes for a in _cache_arrays(caches))
    rows, ours_dir, mlx_file = [], work / "ours", work / "mlx.safetensors"
    written = 0

    def ours():
        shutil.rmtree(ours_dir, ignore_errors=True)
        store = AgentCacheStore(ours_dir, spec, fingerprint, 1 << 50, pool=pool, durable=True, layout="blocks")
        t = time.perf_counter()
        store.save(f"{PUBLIC}/{AGENT}", blocks)
        s = time.perf_counter() - t
        return {"s": s, "bytes": store.written_bytes}

    def mlx():
        if mlx_file.exists():
            mlx_file.unlink()
        t = time.perf_counter()
        save_prompt_cache(str(mlx_file), caches)
        s = time.perf_counter() - t
        fd = os.open(mlx_file, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return {"s": s, "s_fsync": time.perf_counter() - t, "bytes": mlx_file.stat().st_size}

    def floor():
        return floors.write_fsync(work / "floor.bin", written or cache_bytes, bufs)

    sides = {"ours": ours, "mlx_lm": mlx, "floor_write": floor}
    for r in range(reps):
        row = {"rep": r}
        for name in _rotate(list(sides), r):
            row[name] = sides[name]()
            if name == "ours":
                written = row[name]["bytes"]
        rows.append(row)
    into = None
    if also_into is not None:
        store = AgentCacheStore(also_into, spec, fingerprint, 1 << 50, pool=pool, durable=True, layout="blocks")
        t = time.perf_counter()
        store.save(f"{PUBLIC}/long", blocks)
        into = {"s": time.perf_counter() - t, "bytes": store.written_bytes}
    blocks.release()
    del blocks, caches, pool
    gc.collect()
    mx.clear_cache()
    return {"tokens": len(ids), "build_s": build_s, "cache_bytes": cache_bytes, "rows": rows, "server_copy": into}


def loads(spec, fingerprint: str, tokens: int, work: Path, reps: int, bufs: floors.Buffers, warm: bool) -> dict:
    """``reps`` rounds (order rotating) of our restore, mlx-lm's and the floor read; cold (page cache dropped
    before each), then warm when ``warm``."""
    import mlx.core as mx
    from mlx_lm.models.cache import load_prompt_cache

    from semantic.cache.convert import reconstruct
    from semantic.cache.pool import BlockPool
    from semantic.store import AgentCacheStore

    ours_dir, mlx_file = work / "ours", work / "mlx.safetensors"
    ours_files = agent_files(ours_dir)
    nbytes = sum(f.stat().st_size for f in ours_files)

    def ours(cold: bool):
        pool = BlockPool(spec, total_blocks=pool_blocks(spec, tokens), block_tokens=BLOCK_TOKENS)
        store = AgentCacheStore(ours_dir, spec, fingerprint, 1 << 50, pool=pool, layout="blocks")
        floors.evict([ours_dir]) if cold else floors.read_files(ours_files, bufs)
        t = time.perf_counter()
        blocks = store.load(f"{PUBLIC}/{AGENT}")
        if blocks is None:
            raise RuntimeError(f"our store did not load the agent it saved in {ours_dir}")
        mx.eval(_blocks_arrays(blocks))
        load_s = time.perf_counter() - t
        whole = blocks.total_tokens == tokens
        caches = reconstruct(blocks, materialize=True)
        s = time.perf_counter() - t
        del caches
        blocks.release()
        del blocks, store, pool
        gc.collect()
        mx.clear_cache()
        return {"s": s, "load_s": load_s, "whole": whole, "bytes": nbytes}

    def mlx(cold: bool):
        floors.evict([mlx_file]) if cold else floors.read_files([mlx_file], bufs)
        t = time.perf_counter()
        caches = load_prompt_cache(str(mlx_file))
        mx.eval(_cache_arrays(caches))
        s = time.perf_counter() - t
        del caches
        gc.collect()
        mx.clear_cache()
        return {"s": s, "bytes": mlx_file.stat().st_size}

    def floor(cold: bool):
        if cold:
            return floors.cold_read(ours_files, bufs)
        floors.read_files(ours_files, bufs)
        return {**floors.read_files(ours_files, bufs), "memcpy": floors.memcpy(nbytes, bufs),
                "memcpy_fresh": floors.memcpy_fresh(nbytes, bufs)}

    sides = {"ours": ours, "mlx_lm": mlx, "floor_read": floor}
    rows = []
    for mode in ("cold", "warm") if warm else ("cold",):
        for r in range(reps):
            row = {"rep": r, "mode": mode}
            for name in _rotate(list(sides), r):
                row[name] = sides[name](mode == "cold")
            rows.append(row)
    return {"bytes": nbytes, "files": len(ours_files), "rows": rows, "warm_skipped": not warm}
