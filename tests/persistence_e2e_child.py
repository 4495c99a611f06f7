"""The fresh process of the EXP-005 round trip (tests/semantic/cachefile/test_cachefile_real.py).

``python -m tests.persistence_e2e_child MODEL FILE T STEPS`` loads the real
model and the cache file into a new pool, then runs two sequences in one
batch: the cached continuation with token ids T (comma-separated), and a
fresh prefill of the file's tokens + T. It prints one JSON line: both
sequences' tokens and logprobs, and a digest of the loaded cache's arrays.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time

from harness import device, models
from semantic import BlockPool, BatchExecutor, ModelCacheSpec, Request, cachefile, compat
from tests.cache_helpers import arrays


def digest(blocks) -> str:
    """sha256 over every array of the rebuilt caches: equal digests, equal caches."""
    h = hashlib.sha256()
    for a in arrays(blocks):
        h.update(a.tobytes())
    return h.hexdigest()


def main(model: str, path: str, T: list[int], steps: int) -> dict:
    loaded = models.load(model)
    spec = ModelCacheSpec.from_model(loaded.model)
    executor = BatchExecutor(loaded.model, loaded.tokenizer, BlockPool(spec, 64), spec, stop_tokens=[])
    t0 = time.perf_counter()
    cache = cachefile.load(path, executor.pool, model_fingerprint=loaded.fingerprint)
    load_ms = (time.perf_counter() - t0) * 1e3
    cached_uid = executor.submit(Request("agent", [*cache.token_ids, *T], steps), cache, share=False)
    fresh_uid = executor.submit(Request("fresh", list(cache.token_ids) + T, steps), share=False)
    done = {c.uid: c for c in executor.step()}
    side = lambda c: {  # noqa: E731
        "tokens": c.token_ids, "logprobs": c.logprobs, "prompt_tokens": c.prompt_tokens, "cached_tokens": c.cached_tokens,
    }
    return {
        "digest": digest(cache),
        "load_ms": load_ms,
        "mlx_lm": compat.MLX_LM_VERSION,
        "cached": side(done[cached_uid]),
        "fresh": side(done[fresh_uid]),
    }


if __name__ == "__main__":
    device.ensure_working_device()  # this process computes on the default device: a wrong GPU leaves it first
    model, path, t, steps = sys.argv[1:]
    print(json.dumps(main(model, path, [int(x) for x in t.split(",")], int(steps))))
