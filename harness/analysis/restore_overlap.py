"""What overlapping a restore's reads with the turn's forward would buy: a probe for the restore goal.

``python -m harness.analysis.restore_overlap [--tokens 16384] [--rounds 3] [--dir DIR]``

A restored agent's turn today reads its whole cache, then runs the forward: the two one after the other
(EXP-020: the restore end to end 0.46-0.61 of a sequential read, the read itself near the disk). This
probe measures the alternative before the store is changed for it: the cache of an attention model of a
real geometry (Llama 3.1 8B: 32 layers, 8 KV heads, head_dim 128, bfloat16, on a tiny body with as many
query heads as KV heads, as EXP-020's; a cache's bytes do not depend on its values) written one file per
layer, then, per round and in a fresh process each, with the page cache dropped first::

    serial    every layer's arrays made (with room for the turn) and read, then a 2-token forward
    overlap   a reader thread makes and reads layer after layer while the forward runs; each layer's
              cache, at its first update, evaluates what comes before it and waits for its layer's bytes
    floor     a plain sequential read of the same files into one buffer
    forward   the 2-token forward over the cache already in memory (a fully cached turn)

Variants interleave per round; the table gives medians and floor / variant (the goal's figure: at least
0.8). The overlap's logits are checked equal to the serial's (the same computation, evaluated in pieces).
This measures the layout and the wait; it is not the store's code (checksums, blocks, the damaged-block
path are left out: what a real implementation adds goes on top of ``overlap``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from harness.trials.real_geometry import floors

ROOT = Path(__file__).resolve().parents[2]
LAYERS, KV_HEADS, HEAD_DIM = 32, 8, 128
ROOM = 256   # slots past the history: the turn writes its tokens in place
NEW = 2      # the turn's new tokens (EXP-020's restore turn)
VARIANTS = ("serial", "overlap", "floor", "forward")


def _model():
    import mlx.core as mx
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=256, num_hidden_layers=LAYERS, intermediate_size=512,
                           num_attention_heads=KV_HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                           rms_norm_eps=1e-5, vocab_size=512, rope_theta=500000.0, tie_word_embeddings=True)
    mx.random.seed(0)
    model = llama.Model(args)
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    return model


def _paths(d: Path) -> list[Path]:
    return [d / f"layer{i:02d}.kv" for i in range(LAYERS)]


def write(d: Path, tokens: int) -> None:
    """One file per layer: the keys then the values, (heads, tokens, head_dim) bfloat16 each, random."""
    import numpy as np

    rng = np.random.default_rng(0)
    d.mkdir(parents=True, exist_ok=True)
    for p in _paths(d):
        if p.exists() and p.stat().st_size == 2 * KV_HEADS * tokens * HEAD_DIM * 2:
            continue
        # small random bfloat16 values: the upper halves of float32 draws
        bits = (rng.standard_normal(2 * KV_HEADS * tokens * HEAD_DIM, dtype=np.float32) * 0.5).view(np.uint32) >> 16
        with open(p, "wb") as f:
            f.write(bits.astype(np.uint16).tobytes())
            f.flush()
            os.fsync(f.fileno())


# ---------------------------------------------------------------- one trial, in its own process


def _layer(path: Path, tokens: int):
    """One layer's keys and values with room, made and evaluated on this thread, the file read into them."""
    import mlx.core as mx

    from semantic.store.blockread import writable

    k = mx.zeros((1, KV_HEADS, tokens + ROOM, HEAD_DIM), dtype=mx.bfloat16)
    v = mx.zeros((1, KV_HEADS, tokens + ROOM, HEAD_DIM), dtype=mx.bfloat16)
    mx.eval(k, v)
    row, slot = tokens * HEAD_DIM * 2, (tokens + ROOM) * HEAD_DIM * 2
    views = [writable(a)[h * slot:h * slot + row] for a in (k, v) for h in range(KV_HEADS)]
    fd = os.open(path, os.O_RDONLY)
    try:
        done, need = 0, sum(x.nbytes for x in views)
        while done < need:  # one readv fills every head's rows (a short read continues where it stopped)
            got = os.readv(fd, views)
            assert got > 0, (path, done, need)
            done += got
            while got and got >= views[0].nbytes:
                got -= views[0].nbytes
                views = views[1:]
            if got:
                views[0] = views[0][got:]
    finally:
        os.close(fd)
    return k, v


def _caches(tokens: int, held: dict, ready: list | None):
    """mlx-lm KVCaches that take their layer's arrays at their first update (waiting for them with ``ready``);
    ``held`` gives each up, so the turn's write lands in place."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    class Restored(KVCache):
        def __init__(self, i: int):
            super().__init__()
            self.i, self.offset = i, tokens

        def update_and_fetch(self, keys, values):
            if self.keys is None:
                if ready is not None:
                    mx.eval(keys, values)  # the layers before this one run now, while the reader goes on
                    ready[self.i].wait()
                self.keys, self.values = held.pop(self.i)
            return super().update_and_fetch(keys, values)

    return [Restored(i) for i in range(LAYERS)]


def trial(variant: str, d: Path, tokens: int) -> dict:
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    paths = _paths(d)
    if variant == "floor":  # EXP-020's floor: a plain sequential read of the files
        return {"s": floors.read_files(paths, floors.Buffers())["s"]}
    model = _model()
    ids = mx.array([[5, 7]])
    mx.eval(model(ids, cache=[KVCache() for _ in range(LAYERS)]))  # a server's first forward is behind it
    held: dict = {}
    if variant == "forward":  # the cache already in memory: read before the clock starts
        for i, p in enumerate(paths):
            held[i] = _layer(p, tokens)
        t = time.perf_counter()
        logits = model(ids, cache=_caches(tokens, held, None))
        mx.eval(logits)
        return {"s": time.perf_counter() - t}
    t = time.perf_counter()
    if variant == "serial":
        for i, p in enumerate(paths):
            held[i] = _layer(p, tokens)
        logits = model(ids, cache=_caches(tokens, held, None))
        mx.eval(logits)
        waited = 0.0
    else:
        ready = [threading.Event() for _ in paths]

        def reader():
            for i, p in enumerate(paths):
                held[i] = _layer(p, tokens)
                ready[i].set()

        th = threading.Thread(target=reader, daemon=True)
        th.start()
        logits = model(ids, cache=_caches(tokens, held, ready))
        mx.eval(logits)
        th.join()
        waited = None
    s = time.perf_counter() - t
    np_logits = logits[0, -1].astype(mx.float32)
    return {"s": s, "logits": [float(x) for x in np_logits[:64].tolist()], "waited": waited}


# ---------------------------------------------------------------- the rounds


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m harness.analysis.restore_overlap")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default="")
    p.add_argument("--out", default=str(ROOT / "results" / "restore_overlap.json"))
    p.add_argument("--trial", choices=VARIANTS, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.tokens < 256 or a.rounds < 1:
        p.error(f"--tokens {a.tokens} / --rounds {a.rounds}: at least 256 tokens and 1 round")
    d = Path(a.dir) if a.dir else Path(tempfile.gettempdir()) / f"restore-overlap-{a.tokens}"
    if a.trial:
        print(json.dumps(trial(a.trial, d, a.tokens)))
        return
    write(d, a.tokens)
    nbytes = sum(x.stat().st_size for x in _paths(d))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    rows = []
    for r in range(a.rounds):
        order = VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]
        for v in order:
            if v != "forward":
                floors.evict(_paths(d))
            out = subprocess.run([sys.executable, "-m", "harness.analysis.restore_overlap", "--trial", v,
                                  "--dir", str(d), "--tokens", str(a.tokens)], env=env, check=True,
                                 capture_output=True, text=True)
            rows.append({"round": r, "variant": v, **json.loads(out.stdout.strip().splitlines()[-1])})
            print(f"round {r} {v:8s} {rows[-1]['s']:.3f} s", flush=True)
    med = {v: statistics.median(x["s"] for x in rows if x["variant"] == v) for v in VARIANTS}
    same = all(x["logits"] == y["logits"] for x in rows if x["variant"] == "overlap"
               for y in rows if y["variant"] == "serial")
    summary = {v: {"median_s": round(med[v], 3), "floor_over_it": round(med["floor"] / med[v], 3)} for v in VARIANTS}
    print(f"{a.tokens} tokens, {nbytes / 1e9:.2f} GB, {LAYERS} layers, page cache dropped; medians of {a.rounds}")
    for v in VARIANTS:
        print(f"  {v:8s} {med[v]:.3f} s   floor / it {med['floor'] / med[v]:.2f}")
    print(f"  overlap's logits equal serial's: {same}")
    doc = {"tokens": a.tokens, "bytes": nbytes, "layers": LAYERS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
           "rounds": a.rounds, "summary": summary, "overlap_logits_equal_serial": same,
           "rows": [{k: v for k, v in x.items() if k != "logits"} for x in rows],
           "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=1))
    print(f"  -> {a.out}")


if __name__ == "__main__":
    main()
