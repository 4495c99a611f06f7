"""One side of the throughput experiment, in a process of its own.

``python -m harness.trials.throughput.child SPEC.json`` loads the spec's model
variant with the BLAS the parent chose (``$SEMANTIC_BLAS``: the choice is fixed
when MLX loads, so it is an environment variable and each side needs its own
process), measures prefill and decode, and prints one JSON line.

- prefill: ``mlx_lm.generate.generate_step`` over N fresh tokens until the
  first token is read (so materialized): N / seconds;
- decode: B sequences in one ``BatchGenerator`` (through ``harness.baseline``),
  timed from the step where every sequence has its first token to the last
  step: generated tokens / seconds.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step

from harness import baseline, device, environment, models
from semantic import blas


def _ids(rng, n: int, vocab: int) -> list[int]:
    # plain ids away from the special tokens at the start of the vocabulary
    return [int(t) for t in rng.integers(100, min(vocab, 30_000), n)]


def prefill_seconds(model, ids: list[int]) -> float:
    """Seconds from a fresh cache to the first token of ``ids`` (materialized by reading it)."""
    mx.synchronize()
    t = time.perf_counter()
    tok, _ = next(generate_step(mx.array(ids), model, max_tokens=1, sampler=lambda x: mx.argmax(x, axis=-1)))
    int(tok)
    return time.perf_counter() - t


def decode_tokens_per_s(model, prompts: list[list[int]], tokens: int) -> float:
    """Tokens per second of ``len(prompts)`` sequences decoding together, prefill excluded."""
    gen = baseline.make_batch_generator(model, max_tokens=tokens + 1, stop_tokens=[])
    uids = set(baseline.insert(gen, prompts, [None] * len(prompts), [tokens + 1] * len(prompts)))
    started, t0, generated = set(), None, 0
    while responses := baseline.next_responses(gen):
        if t0 is None:
            started |= {r.uid for r in responses}
            if started == uids:  # every sequence has its first token: decoding starts now
                t0 = time.perf_counter()
            continue
        generated += len(responses)
    return generated / (time.perf_counter() - t0)


def main(spec: dict) -> dict:
    loaded = models.load(spec["model"], spec["variant"])
    vocab = loaded.tokenizer.vocab_size
    rng = np.random.default_rng(spec["seed"])
    for _ in range(spec["warmup"]):  # kernels and allocator warm, untimed
        prefill_seconds(loaded.model, _ids(rng, 32, vocab))
        decode_tokens_per_s(loaded.model, [_ids(rng, 16, vocab)], 2)
    prefill = {str(n): n / prefill_seconds(loaded.model, _ids(rng, n, vocab)) for n in spec["prefill_tokens"]}
    decode = {str(b): decode_tokens_per_s(loaded.model, [_ids(rng, spec["decode_prompt_tokens"], vocab)
                                                         for _ in range(b)], spec["decode_tokens"])
              for b in spec["decode_batches"]}
    return {
        "prefill_tps": prefill,
        "decode_tps": decode,
        "variant": loaded.variant,
        "fingerprint": loaded.fingerprint,
        "blas": blas.describe()["blas"],
        "matmul_gflops_f32": environment.matmul_gflops(),
    }


if __name__ == "__main__":
    device.ensure_working_device()  # this process computes on the default device: a wrong GPU leaves it first
    print(json.dumps(main(json.loads(Path(sys.argv[1]).read_text()))))
