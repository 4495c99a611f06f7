"""EXP-005 speed: our verified cache files against mlx-lm's, and the readinto floor.

For each geometry (SmolLM2-135M at 2K and 8K tokens, Gemma 3 12B at 8K),
one cache of synthetic tensors in the real cache geometry (from
``ModelCacheSpec.from_config``, no weights) is written both ways, and these
are timed on the same caches, interleaved per trial (A B C ..., A B C ...):

- ``save``: ``persistence.save``, durable (temp file, fsync, rename, directory
  fsync); ``save_nosync`` the same without the fsyncs;
- ``mlxlm_save``: ``mlx_lm.models.cache.save_prompt_cache`` (it never
  fsyncs); ``mlxlm_save_fsync`` adds an fsync of its file;
- ``load``: ``persistence.load`` into a fresh pool, every checksum verified,
  every block array materialized;
- ``mlxlm_load``: ``load_prompt_cache`` plus ``mx.eval`` of every state;
- ``floor``: ``readinto`` of our file into a preallocated buffer.

All files sit in the page cache (they were just written), so reads measure
memory, not the disk. Statistics are percentiles of the raw samples, ratios
of p50s, and a Mann-Whitney U test per comparison. ``python -m
harness.persistence_bench`` writes ``results/exp_005/speed-<time>.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path
from typing import Callable

import mlx.core as mx
import numpy as np
import xxhash
from mlx_lm.models import cache as C
from scipy.stats import mannwhitneyu

from semantic import BlockPool, ModelCacheSpec, cachefile, compat, convert
from semantic.spec import GLOBAL

SMOLLM2_135M = {
    "model_type": "llama",
    "num_hidden_layers": 30,
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "torch_dtype": "bfloat16",
}
GEMMA3_12B = {
    "model_type": "gemma3_text",
    "num_hidden_layers": 48,
    "hidden_size": 3840,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 256,
    "sliding_window": 1024,
    "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16",
}
# name: (config, tokens, trials)
GEOMETRIES = {
    "smollm2-135m@2k": (SMOLLM2_135M, 2048, 30),
    "smollm2-135m@8k": (SMOLLM2_135M, 8192, 20),
    "gemma3-12b@8k": (GEMMA3_12B, 8192, 10),
}
OPS = ("floor", "load", "mlxlm_load", "save", "mlxlm_save", "save_nosync", "mlxlm_save_fsync")
# (ours, theirs): ratio of p50s and a Mann-Whitney U test each
COMPARISONS = {
    "load/mlxlm_load": ("load", "mlxlm_load"),
    "load/floor": ("load", "floor"),
    "mlxlm_load/floor": ("mlxlm_load", "floor"),
    "save/mlxlm_save": ("save", "mlxlm_save"),
    "save/mlxlm_save_fsync": ("save", "mlxlm_save_fsync"),
    "save_nosync/mlxlm_save": ("save_nosync", "mlxlm_save"),
}
GOALS = {"load/mlxlm_load": 1.0, "load/floor": 1.3, "save/mlxlm_save": 1.0}


def synthetic_blocks(spec: ModelCacheSpec, tokens: int, seed: int = 0):
    """A pooled cache of ``tokens`` random tokens in ``spec``'s geometry.

    Global layers hold every token; sliding layers hold their window, given
    to mlx-lm in the unrolled form a long run leaves (see ``compat``).
    """
    pool = BlockPool(spec, total_blocks=2 * (tokens // 256 + 2))
    key = mx.random.key(seed)
    caches = []
    for layer in spec.layers:
        held = tokens if layer.kind == GLOBAL else min(tokens, layer.window)
        key, kk, kv = mx.random.split(key, 3)
        shape = (1, layer.n_kv_heads, held, layer.head_dim)
        k = mx.random.normal(shape, key=kk).astype(layer.mx_dtype)
        v = mx.random.normal(shape, key=kv).astype(layer.mx_dtype)
        mx.eval(k, v)
        if layer.kind == GLOBAL:
            caches.append(compat.build_layer(compat.LayerState(compat.KV, k, v, tokens)))
        else:
            state = compat.LayerState(compat.ROTATING, k, v, tokens, layer.keep, layer.window, idx=held)
            caches.append(compat.build_layer(state))
    return pool, convert.extract(pool, caches, range(tokens))


@dataclass(slots=True)
class Geometry:
    """The measurements of one geometry (milliseconds, megabytes)."""

    name: str
    tokens: int
    file_mb: float
    mlxlm_file_mb: float
    samples_ms: dict[str, list[float]] = field(default_factory=dict)

    def summary(self) -> dict:
        p = {op: float(np.percentile(xs, 50)) for op, xs in self.samples_ms.items()}
        out = {
            "name": self.name,
            "tokens": self.tokens,
            "file_mb": self.file_mb,
            "mlxlm_file_mb": self.mlxlm_file_mb,
            "p50_ms": p,
            "p95_ms": {op: float(np.percentile(xs, 95)) for op, xs in self.samples_ms.items()},
            "ratios_p50": {},
            "mannwhitney_p": {},
            "samples_ms": self.samples_ms,
        }
        for name, (a, b) in COMPARISONS.items():
            out["ratios_p50"][name] = p[a] / p[b]
            out["mannwhitney_p"][name] = float(mannwhitneyu(self.samples_ms[a], self.samples_ms[b]).pvalue)
        out["goals_met"] = {name: out["ratios_p50"][name] <= limit for name, limit in GOALS.items()}
        return out


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def measure(name: str, config: dict, tokens: int, trials: int, warmup: int, workdir: Path) -> Geometry:
    spec = ModelCacheSpec.from_config(config)
    pool, blocks = synthetic_blocks(spec, tokens)
    live = convert.reconstruct(blocks)
    ours, theirs = str(workdir / f"{name}.safetensors"), str(workdir / f"{name}-mlxlm.safetensors")
    cachefile.save(ours, blocks, model_fingerprint=f"synthetic-{name}")
    C.save_prompt_cache(theirs, live)
    floor_buf = np.empty(os.path.getsize(ours), dtype=np.uint8)
    held: list = []  # what a load produced, dropped before the next call (untimed)

    def floor():
        with open(ours, "rb", buffering=0) as f:
            f.readinto(memoryview(floor_buf))

    def load():
        held.append(cachefile.load(ours, BlockPool(spec, pool.total_blocks)))

    def mlxlm_load():
        caches = C.load_prompt_cache(theirs)
        mx.eval([c.state for c in caches])
        held.append(caches)

    def mlxlm_save_fsync():
        C.save_prompt_cache(theirs, live)
        _fsync(theirs)

    ops: dict[str, Callable[[], None]] = {
        "floor": floor,
        "load": load,
        "mlxlm_load": mlxlm_load,
        "save": lambda: cachefile.save(ours, blocks, model_fingerprint=f"synthetic-{name}"),
        "mlxlm_save": lambda: C.save_prompt_cache(theirs, live),
        "save_nosync": lambda: cachefile.save(ours, blocks, model_fingerprint=f"synthetic-{name}", durable=False),
        "mlxlm_save_fsync": mlxlm_save_fsync,
    }
    geo = Geometry(name, tokens, os.path.getsize(ours) / 1e6, os.path.getsize(theirs) / 1e6, {op: [] for op in ops})
    for trial in range(warmup + trials):
        for op, fn in ops.items():
            held.clear()
            cachefile.settle()  # the previous save's old file is gone before the clock starts
            t0 = time.perf_counter_ns()
            fn()
            ms = (time.perf_counter_ns() - t0) / 1e6
            if trial >= warmup:
                geo.samples_ms[op].append(ms)
    held.clear()
    return geo


def hash_throughput(mb: int = 64, repeats: int = 7) -> dict[str, dict[str, float]]:
    """GB/s of each candidate checksum over a buffer, cold (bigger than the
    caches) and hot (a 2 MiB buffer hashed again and again)."""
    rng = np.random.default_rng(0)
    bufs = {"cold": rng.integers(0, 255, mb << 20, dtype=np.uint8), "hot": rng.integers(0, 255, 2 << 20, dtype=np.uint8)}
    fns = {
        "xxh3_64": lambda m: xxhash.xxh3_64(m).digest(),
        "xxh3_128": lambda m: xxhash.xxh3_128(m).digest(),
        "sha256": lambda m: hashlib.sha256(m).digest(),
        "blake2b": lambda m: hashlib.blake2b(m).digest(),
    }
    out = {}
    for name, fn in fns.items():
        out[name] = {}
        for temp, buf in bufs.items():
            view, xs = memoryview(buf), []
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn(view)
                xs.append(time.perf_counter() - t0)
            out[name][temp] = buf.nbytes / float(np.median(xs)) / 1e9
    return out


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def run(names: list[str], warmup: int, trials: int | None, out_dir: Path) -> Path:
    """Measure ``names`` (keys of GEOMETRIES) and write one results JSON."""
    geometries = []
    with tempfile.TemporaryDirectory(prefix="exp005-") as tmp:
        for name in names:
            config, tokens, default_trials = GEOMETRIES[name]
            geo = measure(name, config, tokens, trials or default_trials, warmup, Path(tmp))
            s = geo.summary()
            geometries.append(s)
            print(f"{name:18} {s['file_mb']:7.1f} MB  " + "  ".join(f"{k} {v:.2f}" for k, v in s["ratios_p50"].items()))
        cachefile.settle()
    doc = {
        "experiment": "exp_005_persistence_speed",
        "created": datetime.now(timezone.utc).isoformat(),
        "git_commit": _git_commit(),
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count()},
        "versions": {p: version(p) for p in ("mlx", "mlx-lm", "xxhash", "numpy", "safetensors")},
        "protocol": {
            "warmup": warmup,
            "interleaved": True,
            "units": "ms",
            "save": "temp file, fsync, rename, directory fsync; the replaced file is deleted in the background",
            "load": "fresh pool, every tensor checksum verified, block arrays materialized",
            "floor": "readinto of our file into a preallocated buffer",
            "page_cache": "files were just written: reads come from memory",
        },
        "goals": GOALS,
        "hash_throughput_gbps": hash_throughput(),
        "geometries": geometries,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"speed-{datetime.now(timezone.utc).strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps(doc, indent=1))
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.persistence_bench", description=__doc__.split("\n")[0])
    p.add_argument("--geometries", default=",".join(GEOMETRIES), help=f"comma-separated, from {sorted(GEOMETRIES)}")
    p.add_argument("--trials", type=int, default=None, help="per geometry (default: 30 / 20 / 10 by size)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default="results/exp_005")
    args = p.parse_args(argv)
    names = [n for n in args.geometries.split(",") if n]
    unknown = sorted(set(names) - set(GEOMETRIES))
    if unknown:
        p.error(f"unknown geometries {unknown}; known: {sorted(GEOMETRIES)}")
    print(run(names, args.warmup, args.trials, Path(args.out)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
