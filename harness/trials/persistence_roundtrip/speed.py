"""EXP-005 speed: our cache files against mlx-lm's, and the readinto floor, on the same caches.

For each geometry one cache of synthetic tensors in a real cache geometry
(``harness.synthetic``) is written both ways, and these are timed
through ``harness.timing``, interleaved per trial (A B C ..., A B C ...):

- ``save``: ``cachefile.save``, durable (temp file, fsync, rename, directory
  fsync); ``save_nosync`` the same without the fsyncs;
- ``mlxlm_save``: ``mlx_lm.models.cache.save_prompt_cache`` (it never
  fsyncs); ``mlxlm_save_fsync`` adds an fsync of its file;
- ``load``: ``cachefile.load`` into a fresh pool, every checksum verified,
  every block array materialized;
- ``mlxlm_load``: ``load_prompt_cache`` plus ``mx.eval`` of every state;
- ``floor``: ``readinto`` of our file into a preallocated buffer (numpy's,
  16-byte aligned: the floor the goals are set against);
- ``floor_aligned``: the same into a page-aligned buffer. The kernel copies
  from the page cache 3-4x faster when the destination's alignment matches
  the file offset's, so this is the floor a careful reader could reach; it
  is reported beside the goal, not judged.

All files sit in the page cache (they were just written), so reads measure
memory, not the disk.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as mlxlm_cache

from harness import stats
from harness.synthetic import GEMMA3_12B, SMOLLM2_135M, synthetic_blocks
from harness.timing import Protocol, Samples, time_interleaved
from semantic import BlockPool, ModelCacheSpec, cachefile
from semantic.cache import convert
from semantic.cachefile.atomic import fsync_path

# name: (model config, tokens)
GEOMETRIES = {
    "smollm2-135m@2k": (SMOLLM2_135M, 2048),
    "smollm2-135m@8k": (SMOLLM2_135M, 8192),
    "gemma3-12b@8k": (GEMMA3_12B, 8192),
}
# (ours, theirs): ratio of p50s and a Mann-Whitney U test each
COMPARISONS = {
    "load/mlxlm_load": ("load", "mlxlm_load"),
    "load/floor": ("load", "floor"),
    "load/floor_aligned": ("load", "floor_aligned"),
    "mlxlm_load/floor": ("mlxlm_load", "floor"),
    "save/mlxlm_save": ("save", "mlxlm_save"),
    "save/mlxlm_save_fsync": ("save", "mlxlm_save_fsync"),
    "save_nosync/mlxlm_save": ("save_nosync", "mlxlm_save"),
}
GOALS = {"load/mlxlm_load": 1.0, "load/floor": 1.3, "save/mlxlm_save": 1.0}


@dataclass(slots=True)
class Geometry:
    """The measurements of one geometry (milliseconds, megabytes)."""

    name: str
    tokens: int
    file_mb: float
    mlxlm_file_mb: float
    samples: dict[str, Samples]

    def __post_init__(self):
        if self.name not in GEOMETRIES:
            raise ValueError(f"geometry must be among {sorted(GEOMETRIES)}, got {self.name!r}")

    def summary(self) -> dict:
        """p50 and p95 per operation, ratios of p50s, p-values, and which goals are met."""
        ms = {op: s.ms for op, s in self.samples.items()}
        p = {op: float(np.percentile(xs, 50)) for op, xs in ms.items()}
        ratios = {name: p[a] / p[b] for name, (a, b) in COMPARISONS.items()}
        return {
            "name": self.name, "tokens": self.tokens, "file_mb": self.file_mb, "mlxlm_file_mb": self.mlxlm_file_mb,
            "p50_ms": p,
            "p95_ms": {op: float(np.percentile(xs, 95)) for op, xs in ms.items()},
            "ratios_p50": ratios,
            "mannwhitney_p": {name: stats.mannwhitney_p(ms[a], ms[b]) for name, (a, b) in COMPARISONS.items()},
            "goals_met": {name: ratios[name] <= limit for name, limit in GOALS.items()},
        }


def measure(name: str, protocol: Protocol, workdir: Path, progress=None) -> Geometry:
    """Write geometry ``name``'s cache both ways in ``workdir``, then time every operation, interleaved."""
    config, tokens = GEOMETRIES[name]
    spec = ModelCacheSpec.from_config(config)
    pool, blocks = synthetic_blocks(spec, tokens)
    live = convert.reconstruct(blocks)
    ours, theirs = str(workdir / f"{name}.safetensors"), str(workdir / f"{name}-mlxlm.safetensors")
    fingerprint = f"synthetic-{name}"
    cachefile.save(ours, blocks, model_fingerprint=fingerprint)
    mlxlm_cache.save_prompt_cache(theirs, live)
    floor_buf = np.empty(os.path.getsize(ours), dtype=np.uint8)
    spare = np.empty(os.path.getsize(ours) + 4096, dtype=np.uint8)
    aligned_buf = spare[-spare.ctypes.data % 4096 :][: floor_buf.size]  # page-aligned, like file offset 0
    held: list = []  # what a load produced, dropped before the next call (untimed)

    def floor():
        with open(ours, "rb", buffering=0) as f:
            f.readinto(memoryview(floor_buf))

    def floor_aligned():
        with open(ours, "rb", buffering=0) as f:
            f.readinto(memoryview(aligned_buf))

    def load():
        held.append(cachefile.load(ours, BlockPool(spec, pool.total_blocks)))

    def mlxlm_load():
        caches = mlxlm_cache.load_prompt_cache(theirs)
        mx.eval([c.state for c in caches])
        held.append(caches)

    def mlxlm_save_fsync():
        mlxlm_cache.save_prompt_cache(theirs, live)
        fsync_path(theirs)

    def setup():
        held.clear()
        cachefile.settle()  # the previous save's old file is gone before the clock starts

    ops: dict[str, Callable[[], None]] = {
        "floor": floor,
        "floor_aligned": floor_aligned,
        "load": load,
        "mlxlm_load": mlxlm_load,
        "save": lambda: cachefile.save(ours, blocks, model_fingerprint=fingerprint),
        "mlxlm_save": lambda: mlxlm_cache.save_prompt_cache(theirs, live),
        "save_nosync": lambda: cachefile.save(ours, blocks, model_fingerprint=fingerprint, durable=False),
        "mlxlm_save_fsync": mlxlm_save_fsync,
    }
    samples = time_interleaved(ops, protocol, setup=setup, progress=progress)
    held.clear()
    cachefile.settle()
    return Geometry(name, tokens, os.path.getsize(ours) / 1e6, os.path.getsize(theirs) / 1e6, samples)
