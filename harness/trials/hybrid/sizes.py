"""Snapshot sizes of big real hybrid geometries, from their configs (no weights), and the time one takes
through the block store.

A Gated-DeltaNet layer's cache (mlx-lm ``qwen3_next`` / ``qwen3_5``: ``ArraysCache(2)``) is a conv state
``(conv_kernel - 1, conv_dim)``, ``conv_dim = 2 * key_heads * key_dim + value_heads * value_dim``, and an
SSM state ``(value_heads, value_dim, key_dim)``; every ``full_attention_interval``-th layer is attention
(a ``KVCache`` of ``kv_heads x head_dim``). One snapshot is every recurrent layer's arrays at one position;
it does not grow with the context, the attention layers' KV does::

    Qwen3.5-35B-A3B   40 layers: 30 GDN + 10 attention (2 KV heads x 256)   snapshot ~63 MB, KV 20 KiB/token
    Qwen3-Coder-Next  48 layers: 36 GDN + 12 attention (same dims)           snapshot ~75 MB, KV 24 KiB/token
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from semantic.cache.spec import GLOBAL, RECURRENT, LayerSpec, ModelCacheSpec

GDN = {"linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
       "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_key_value_heads": 2, "head_dim": 256,
       "full_attention_interval": 4, "ssm_dtype": "float32", "conv_dtype": "bfloat16", "kv_dtype": "bfloat16"}

# the real configs' cache-relevant values (Qwen/Qwen3.5-35B-A3B, Qwen/Qwen3-Coder-Next config.json)
BIG: dict[str, dict] = {
    "qwen3.5-35b-a3b": {**GDN, "num_hidden_layers": 40},
    "qwen3-coder-next": {**GDN, "num_hidden_layers": 48},
}


def gdn_arrays(c: dict) -> tuple:
    """One GDN layer's ``ArraysCache`` arrays as (shape without batch, dtype): conv state, SSM state."""
    kd, vd = c["linear_num_key_heads"] * c["linear_key_head_dim"], c["linear_num_value_heads"] * c["linear_value_head_dim"]
    conv = ((c["linear_conv_kernel_dim"] - 1, 2 * kd + vd), c["conv_dtype"])
    ssm = ((c["linear_num_value_heads"], c["linear_value_head_dim"], c["linear_key_head_dim"]), c["ssm_dtype"])
    return (conv, ssm)


def spec_of(c: dict, attention_only: bool = False) -> ModelCacheSpec:
    """The cache spec of config ``c``: layer ``i`` is attention when ``(i + 1) % interval == 0``
    (Qwen3-Next's and Qwen3.5's rule), else GDN; ``attention_only`` keeps the attention layers alone."""
    attn = LayerSpec(GLOBAL, c["num_key_value_heads"], c["head_dim"], c["head_dim"], c["kv_dtype"])
    gdn = LayerSpec(RECURRENT, 0, 0, 0, c["ssm_dtype"], arrays=gdn_arrays(c))
    layers = [attn if (i + 1) % c["full_attention_interval"] == 0 else gdn for i in range(c["num_hidden_layers"])]
    return ModelCacheSpec(tuple(l for l in layers if not attention_only or l.kind == GLOBAL))


def size_row(name: str, spec: ModelCacheSpec, block_tokens: int = 256, contexts=(4096, 32768)) -> dict:
    """One snapshot's bytes beside a block of KV and the KV of each context length."""
    snap, per_token = spec.state_bytes(), spec.token_bytes()
    block = per_token * block_tokens
    row = {"model": name, "layers": spec.n_layers,
           "recurrent_layers": sum(l.kind == RECURRENT for l in spec.layers),
           "attention_layers": sum(l.kind == GLOBAL for l in spec.layers),
           "snapshot_bytes": snap, "kv_bytes_per_token": per_token, "block_bytes": block,
           "snapshot_over_block": snap / block if block else None,
           "snapshot_tokens_equivalent": snap / per_token if per_token else None}
    for n in contexts:
        row[f"kv_bytes_{n}"] = per_token * n
        row[f"snapshot_over_kv_{n}"] = snap / (per_token * n)
    return row


def _synthetic_caches(spec: ModelCacheSpec, tokens: int, seed: int = 0) -> list:
    """Live mlx-lm caches of ``spec`` after ``tokens`` tokens: random K/V, random recurrent arrays."""
    import mlx.core as mx
    from mlx_lm.models import cache as C

    from semantic import compat

    key = mx.random.key(seed)
    caches = []
    for layer in spec.layers:
        if layer.kind == RECURRENT:
            arrays = []
            for shape, dt in layer.arrays:
                key, k = mx.random.split(key)
                arrays.append(mx.random.normal((1, *shape), key=k).astype(getattr(mx, dt)))
            c = compat.build_arrays(arrays)
        else:
            key, kk, kv = mx.random.split(key, 3)
            c = C.KVCache()
            shape = (1, layer.n_kv_heads, tokens)
            c.update_and_fetch(mx.random.normal((*shape, layer.head_dim), key=kk).astype(layer.mx_dtype),
                               mx.random.normal((*shape, layer.v_head_dim), key=kv).astype(layer.mx_dtype))
        caches.append(c)
    mx.eval([a for c in caches for a in (c.state if isinstance(c.state, (list, tuple)) else [c.state]) if a is not None])
    return caches


def evict(root: Path) -> None:
    """Drop ``root``'s files from the page cache (the restore reads the disk, as after a reboot)."""
    from harness.trials.block_store.servers import evict_page_cache

    evict_page_cache(root)


def time_store(spec: ModelCacheSpec, tokens: int, reps: int, work: Path | None = None, seed: int = 0) -> dict:
    """Save one agent of ``tokens`` tokens (its full blocks and, on a recurrent spec, its snapshot at the
    end) through ``AgentCacheStore`` (blocks layout, durable) into a fresh directory, then restore it in a
    fresh store and pool, page cache dropped first; ``reps`` times. Returns medians and the bytes on disk."""
    import mlx.core as mx

    from harness.trials.block_store.measure import disk_usage
    from semantic.cache.convert import extract
    from semantic.cache.pool import BlockPool
    from semantic.store import AgentCacheStore

    bt = 256
    snap_blocks = -(-spec.state_bytes() // max(1, int(spec.token_bytes() * bt))) if spec.recurrent else 0
    total = 4 + -(-tokens // bt) + 2 * (snap_blocks + 1)
    ids = [(7 * i + 3) % 1000 for i in range(tokens)]
    saves, loads, written, on_disk, restored = [], [], [], [], []
    for r in range(reps):
        with tempfile.TemporaryDirectory(prefix="exp018-store-", dir=work) as tmp:
            pool = BlockPool(spec, total_blocks=total, block_tokens=bt)
            blocks = extract(pool, _synthetic_caches(spec, tokens, seed + r), ids)
            store = AgentCacheStore(tmp, spec, "exp018-synthetic", 1 << 40, pool=pool)
            t0 = time.perf_counter()
            try:
                store.save("agent", blocks)
            except Exception as exc:  # noqa: BLE001 - a store that cannot save this spec yet is a result
                blocks.release()
                return {"tokens": tokens, "reps": reps, "error": f"{type(exc).__name__}: {exc}"[:400]}
            saves.append(time.perf_counter() - t0)
            written.append(store.written_bytes)
            blocks.release()
            on_disk.append(disk_usage(tmp).bytes)
            evict(Path(tmp))
            pool2 = BlockPool(spec, total_blocks=total, block_tokens=bt)
            store2 = AgentCacheStore(tmp, spec, "exp018-synthetic", 1 << 40, pool=pool2)
            t0 = time.perf_counter()
            loaded = store2.load("agent")
            if loaded is not None:
                mx.eval(_arrays_of(loaded))
            loads.append(time.perf_counter() - t0)
            restored.append(loaded is not None and loaded.total_tokens == tokens)
            if loaded is not None:
                loaded.release()
    return {"tokens": tokens, "reps": reps, "save_s": statistics.median(saves), "load_s": statistics.median(loads),
            "save_s_all": saves, "load_s_all": loads, "written_bytes": statistics.median(written),
            "disk_bytes": statistics.median(on_disk), "restored_whole": all(restored)}


def _arrays_of(blocks) -> list:
    """Every array an AgentBlocks holds (K/V of its blocks, a snapshot's arrays)."""
    out = []
    for group in blocks.groups.values():
        for b in group:
            for data in b.layer_data.values():
                for part in data:
                    out.extend(part if isinstance(part, (list, tuple)) else [part])
    return [a for a in out if a is not None and hasattr(a, "shape")]
