"""What a batch of agents decoding together costs: rows kept apart (``kinds.rows``) against merged rows.

``python -m harness.analysis.batch_rows [--geometry qwen3-coder-30b-a3b] [--tokens 4096,8192] [--agents 3]
[--rounds 3]``

B agents, each with a cache of ``tokens`` of a real model's geometry (``harness.trials.real_geometry``: a
tiny random bfloat16 body whose caches have the real model's bytes; the cache's values are random, its bytes
real), in the pool's shape: each agent's ``KVCache`` over buffers with room for the turn. Per round, in a
fresh process each and interleaved (rows, merged, merged, rows, ...), the step loop's own moves:

    join     the agents' caches become the batch (``kinds.merge``: rows kept apart, or mlx-lm's merge)
    decode   ``steps`` decode steps of the batch
    leave    each row taken back out (``extract``), as a finished turn's cache goes back to the pool

timed from the join to the last row out, and MLX's peak memory over those moves above what the agents' caches
held before the join (``mx.get_peak_memory``: what the batch copied). The figures go to
``results/batch_rows.json``; ratios pair each round's two modes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROOM = 256


def trial(mode: str, geometry: str, tokens: int, agents: int, steps: int) -> dict:
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from harness.trials.real_geometry.models import load_spec, write_model
    from semantic import blas, compat, cpuattention, kinds

    blas.enable(warn=False)
    cpuattention.install()
    model, spec = load_spec(write_model(geometry))
    caches = []
    for a in range(agents):
        n = tokens + 7 * a  # rows of different lengths, as agents' are
        row = []
        for layer in spec.layers:
            c = KVCache()
            shape = (1, layer.n_kv_heads, n + ROOM, layer.head_dim)
            c.keys = mx.random.normal(shape, key=mx.random.key(a)).astype(mx.bfloat16) * 0.1
            c.values = mx.random.normal(shape, key=mx.random.key(a + 99)).astype(mx.bfloat16) * 0.1
            c.offset = n
            mx.eval(c.keys, c.values)
            row.append(c)
        caches.append(row)
    held = mx.get_active_memory()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    batch = kinds.merge(caches, rows=mode == "rows")
    del caches
    for _ in range(steps):
        out = model(mx.array([[11]] * agents), cache=batch)
        mx.eval(out, [compat.cache_arrays(c) for c in batch])
    rows = [[c.extract(i) for c in batch] for i in range(agents)]
    mx.eval([x for row in rows for c in row for x in (c.keys, c.values)])
    took = time.perf_counter() - t0
    return {"mode": mode, "s": took, "peak_above_held_bytes": mx.get_peak_memory() - held, "held_bytes": held}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--geometry", default="qwen3-coder-30b-a3b")
    ap.add_argument("--tokens", default="4096,8192")
    ap.add_argument("--agents", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "results" / "batch_rows.json"))
    ap.add_argument("--trial", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.trial:
        mode, tokens = a.trial.split(":")
        print(json.dumps(trial(mode, a.geometry, int(tokens), a.agents, a.steps)))
        return 0
    rows = []
    for tokens in [int(t) for t in a.tokens.split(",")]:
        for r in range(a.rounds):
            for mode in (("rows", "merged") if r % 2 == 0 else ("merged", "rows")):
                cmd = [sys.executable, "-m", "harness.analysis.batch_rows", "--trial", f"{mode}:{tokens}",
                       "--geometry", a.geometry, "--agents", str(a.agents), "--steps", str(a.steps)]
                done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800,
                                      env={**os.environ, "PYTHONPATH": str(ROOT)})
                if done.returncode:
                    raise SystemExit(f"{mode} {tokens}: {done.stderr[-3000:]}")
                row = {"tokens": tokens, "round": r, **json.loads(done.stdout.strip().splitlines()[-1])}
                rows.append(row)
                print(f"{tokens:>6} round {r} {mode:>6}: {row['s']:.3f} s, peak above the agents' caches "
                      f"{row['peak_above_held_bytes'] / 2**20:.0f} MiB of {row['held_bytes'] / 2**20:.0f}", flush=True)
    summary = {}
    for tokens in sorted({r["tokens"] for r in rows}):
        pairs = [(x, y) for x in rows for y in rows if x["tokens"] == y["tokens"] == tokens
                 and x["round"] == y["round"] and x["mode"] == "rows" and y["mode"] == "merged"]
        summary[str(tokens)] = {
            "rows_over_merged_s": statistics.median(x["s"] / y["s"] for x, y in pairs),
            "rows_s": statistics.median(x["s"] for x, _ in pairs),
            "merged_s": statistics.median(y["s"] for _, y in pairs),
            "rows_peak_over_held": statistics.median(x["peak_above_held_bytes"] / x["held_bytes"] for x, _ in pairs),
            "merged_peak_over_held": statistics.median(y["peak_above_held_bytes"] / y["held_bytes"] for _, y in pairs),
        }
    doc = {"geometry": a.geometry, "agents": a.agents, "steps": a.steps, "rounds": a.rounds, "summary": summary,
           "rows": rows, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=1))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
