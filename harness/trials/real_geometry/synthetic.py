"""A long agent's cache written without a prefill: random K/V of the real geometry, saved through the store.

A CPU cannot prefill 32K tokens of these geometries in any reasonable time, and a cache's bytes do not depend
on its values: so the trial builds the live mlx-lm caches an agent of ``n`` tokens would have (random bfloat16
K/V, the last window of a sliding layer, random recurrent states), cuts them into pooled blocks with
``semantic.cache.convert.extract`` and saves them with ``semantic.store.AgentCacheStore`` (layout "blocks",
durable) into the directory the server will be started on, under the server's fingerprint
(``semantic.service.model_fingerprint`` of the model directory) and agent id (``public/<name>``, what
``Service.agent_id`` makes of an unauthenticated request's agent). The agent's next turn sends the same token
ids plus a few new ones: the server loads the file and computes the new ones only.

Values: ``mx.random`` draws about 30 MB/s on this CPU, so each array is a random base (16 MiB) rolled by an
offset of its own and tiled to size. Within a head, a pattern repeats only after 64K tokens.
"""

from __future__ import annotations

import time
from pathlib import Path

BASE_VALUES = 1 << 23   # bfloat16 values in the random base (16 MiB)
BLOCK_TOKENS = 256
PUBLIC = "public"


def token_ids(n: int, seed: int) -> list[int]:
    """``n`` token ids of the byte vocabulary, printable bytes (never the end-of-turn byte 10)."""
    import numpy as np

    return np.random.default_rng(seed).integers(32, 127, size=n).tolist()


class Filler:
    """Random arrays of any shape and dtype from one random base, each at an offset of its own."""

    def __init__(self, seed: int):
        import mlx.core as mx

        self.key = mx.random.key(seed)
        self.base = mx.random.normal((BASE_VALUES,), key=self.key).astype(mx.bfloat16)
        mx.eval(self.base)
        self.n = 0

    def __call__(self, shape: tuple, dtype):
        import math

        import mlx.core as mx

        size = math.prod(shape)
        self.n += 1
        off = (self.n * 7_340_033) % BASE_VALUES
        rolled = mx.concatenate([self.base[off:], self.base[:off]])
        reps = -(-size // BASE_VALUES)
        x = (mx.tile(rolled, (reps,)) if reps > 1 else rolled)[:size].reshape(shape).astype(dtype)
        mx.eval(x)
        return x


def live_caches(spec, tokens: int, seed: int = 0) -> list:
    """The mlx-lm caches of ``spec`` after ``tokens`` tokens: random K/V (a sliding layer: its last window,
    as the ring unrolled holds it), random recurrent arrays. One full-length array per layer and side, so
    ``extract`` keeps them as the blocks' segment (no second copy)."""
    from semantic import kinds
    from semantic.cache.spec import RECURRENT

    fill = Filler(seed)
    out = []
    for i, layer in enumerate(spec.layers):
        if layer.kind == RECURRENT:
            arrays = tuple(fill((1, *shape), _mx_dtype(dt)) for shape, dt in layer.arrays)
            out.append(kinds.of(layer).build(i, layer, arrays, None, tokens, layer.tokens_held(tokens)))
            continue
        held = layer.tokens_held(tokens)
        k = fill((1, layer.n_kv_heads, held, layer.head_dim), layer.mx_dtype)
        v = fill((1, layer.n_kv_heads, held, layer.v_head_dim), layer.mx_dtype)
        out.append(kinds.of(layer).build(i, layer, k, v, tokens, held))
    return out


def _mx_dtype(name: str):
    import mlx.core as mx

    return getattr(mx, name)


def pool_blocks(spec, tokens: int) -> int:
    """Blocks a pool needs for one agent of ``tokens`` tokens (every group's, a snapshot's share), with room."""
    groups = len(spec.groups())
    snap = -(-spec.state_bytes() // max(1, int(spec.token_bytes() * BLOCK_TOKENS))) if spec.recurrent else 0
    return groups * (tokens // BLOCK_TOKENS + 2) + 2 * (snap + 1) + 8


def write_agent(cache_dir: Path, spec, fingerprint: str, agent: str, ids: list[int], seed: int = 0,
                durable: bool = True) -> dict:
    """Save a synthetic cache of ``ids`` for agent ``agent`` into ``cache_dir`` as the server would (blocks
    layout); returns the seconds the save took (``AgentCacheStore.save``, the store's own call, fsyncs
    included), the bytes it wrote, and how long building the arrays took."""
    import mlx.core as mx

    from semantic.cache.convert import extract
    from semantic.cache.pool import BlockPool
    from semantic.store import AgentCacheStore

    t0 = time.perf_counter()
    pool = BlockPool(spec, total_blocks=pool_blocks(spec, len(ids)), block_tokens=BLOCK_TOKENS)
    caches = live_caches(spec, len(ids), seed)
    blocks = extract(pool, caches, ids)
    del caches
    build_s = time.perf_counter() - t0
    store = AgentCacheStore(cache_dir, spec, fingerprint, 1 << 50, pool=pool, durable=durable, layout="blocks")
    t0 = time.perf_counter()
    store.save(f"{PUBLIC}/{agent}", blocks)
    save_s = time.perf_counter() - t0
    written = store.written_bytes
    blocks.release()
    del blocks, store, pool
    mx.clear_cache()
    return {"tokens": len(ids), "build_s": build_s, "save_s": save_s, "written_bytes": written}


def agent_files(cache_dir: Path) -> list[Path]:
    """Every regular file under ``cache_dir`` (its manifests and block files), largest first."""
    files = [p for p in Path(cache_dir).rglob("*") if p.is_file() and not p.is_symlink()]
    return sorted(files, key=lambda p: -p.stat().st_size)
