"""A first EXP-006 measurement: rebuilding a real model's cache from 256-token blocks.

For each block count it builds every layer's K/V as 256-token blocks in the
real model's cache geometry, then times, interleaved per trial:

- ``concat``: the seeds' method, ``mx.concatenate`` of the blocks per layer
  into real cache objects, ending in ``mx.eval`` (materialized), with the
  time before ``mx.eval`` kept as ``concat_lazy`` (graph building only);
- ``memcpy``: numpy ``copyto`` of the same number of bytes into a
  preallocated buffer, the physical floor.

The full sweep, our engine's own reconstruction and the statistics arrive
with the EXP-006 experiment itself; this keeps ``make exp-006`` honest until then.
"""

from __future__ import annotations

import json
import platform
import subprocess
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import mlx.core as mx
import numpy as np
import pandas as pd
from mlx_lm.models.cache import make_prompt_cache

from harness import models
from semantic import compat

BLOCK = 256
_TEXT = "Agents keep long conversations that every request would otherwise encode again."


@dataclass(slots=True)
class Cell:
    blocks: int
    layers: int
    tokens: int
    cache_bytes: int
    samples_ms: dict[str, list[float]]


def _blocks_of(model, tokenizer, n_blocks: int, seed: int = 0):
    """Per-layer K/V blocks in the real model's cache geometry.

    A short real prefill gives each layer's shape and dtype; the block
    contents are random, since copying cost does not depend on values (a
    real 2048-token prefill takes minutes on MLX's CPU backend here).
    """
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([tokenizer.encode(_TEXT)[:8]]), cache=cache))
    key = mx.random.key(seed)
    layers = []
    for c in cache:
        st = compat.read_layer(c)
        b, heads, _, dim = st.keys.shape
        shape = (b, heads, BLOCK, dim)
        make = lambda: [mx.random.normal(shape, dtype=st.keys.dtype, key=k) for k in mx.random.split(key, n_blocks)]  # noqa: E731
        layers.append((make(), make()))
    mx.eval(layers)
    return layers


def _time_concat(layers) -> tuple[float, float]:
    t0 = time.perf_counter_ns()
    rebuilt = []
    for kb, vb in layers:
        k, v = mx.concatenate(kb, axis=2), mx.concatenate(vb, axis=2)
        rebuilt.append(compat.build_layer(compat.LayerState(compat.KV, k, v, k.shape[2])))
    t1 = time.perf_counter_ns()
    mx.eval([(c.keys, c.values) for c in rebuilt])
    t2 = time.perf_counter_ns()
    return (t2 - t0) / 1e6, (t1 - t0) / 1e6


def _time_memcpy(src: np.ndarray, dst: np.ndarray) -> float:
    t0 = time.perf_counter_ns()
    np.copyto(dst, src)
    return (time.perf_counter_ns() - t0) / 1e6


def measure(model_name: str, block_counts: list[int], trials: int, warmup: int) -> tuple[list[Cell], dict]:
    loaded = models.load(model_name)
    cells = []
    for n in block_counts:
        layers = _blocks_of(loaded.model, loaded.tokenizer, n)
        nbytes = sum(b.nbytes for kb, vb in layers for b in kb + vb)
        src = np.ones(nbytes, dtype=np.uint8)
        dst = np.empty_like(src)
        samples = {"concat": [], "concat_lazy": [], "memcpy": []}
        for i in range(warmup + trials):
            mat, lazy = _time_concat(layers)
            cp = _time_memcpy(src, dst)
            if i >= warmup:
                samples["concat"].append(mat)
                samples["concat_lazy"].append(lazy)
                samples["memcpy"].append(cp)
        cells.append(Cell(n, len(layers), n * BLOCK, nbytes, samples))
    return cells, {"model": model_name, "model_path": loaded.path, "fingerprint": loaded.fingerprint}


def summarize(cells: list[Cell]) -> pd.DataFrame:
    rows = []
    for c in cells:
        row = {"blocks": c.blocks, "layers": c.layers, "MB": c.cache_bytes / 1e6}
        for name, xs in c.samples_ms.items():
            p50, p95 = np.percentile(xs, [50, 95])
            row[f"{name}_p50_ms"], row[f"{name}_p95_ms"] = p50, p95
        row["concat/memcpy_p50"] = row["concat_p50_ms"] / row["memcpy_p50_ms"]
        rows.append(row)
    return pd.DataFrame(rows)


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def run(model_name: str, block_counts: list[int], trials: int, warmup: int, out_dir: Path) -> Path:
    cells, model_info = measure(model_name, block_counts, trials, warmup)
    table = summarize(cells)
    print(table.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"first-{stamp}.json"
    payload = {
        "experiment": "exp_006_first_measurement",
        "created": stamp,
        "model": model_info,
        "versions": {"mlx": compat.MLX_VERSION, "mlx_lm": compat.MLX_LM_VERSION, "numpy": np.__version__},
        "machine": {"platform": platform.platform(), "processor": platform.machine(), "device": str(mx.default_device())},
        "git_commit": _git_commit(),
        "protocol": {"warmup": warmup, "trials": trials, "block_tokens": BLOCK, "interleaved": True},
        "cells": [asdict(c) for c in cells],
        "summary": table.to_dict(orient="records"),
    }
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=1) + "\n")
    tmp.replace(path)
    print(f"wrote {path}")
    return path
