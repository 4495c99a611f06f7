"""The fresh process of EXP-005: load a cache file, continue beside a fresh prefill.

``python -m harness.trials.persistence_roundtrip.child SPEC.json`` loads the spec's model
(in its variant) and cache file, continues it with the token ids ``continuation`` for ``steps`` tokens
beside a fresh prefill of the same tokens, and prints one JSON line with both
sequences' tokens and logprobs and the load time.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from harness import device, models
from harness.executors import make_executor
from semantic import Request, cachefile


def main(model: str, variant: str, path: str, T: list[int], steps: int) -> dict:
    loaded = models.load(model, variant)
    executor = make_executor(loaded, 64)
    t0 = time.perf_counter()
    cache = cachefile.load(path, executor.pool, model_fingerprint=loaded.fingerprint)
    load_ms = (time.perf_counter() - t0) * 1e3
    cached_uid = executor.submit(Request("agent", [*cache.token_ids, *T], steps), cache, share=False)
    fresh_uid = executor.submit(Request("fresh", list(cache.token_ids) + T, steps), share=False)
    done = {c.uid: c for c in executor.step()}
    side = lambda c: {"tokens": c.token_ids, "logprobs": c.logprobs, "prompt_tokens": c.prompt_tokens}  # noqa: E731
    return {"load_ms": load_ms, "cached": side(done[cached_uid]), "fresh": side(done[fresh_uid])}


if __name__ == "__main__":
    device.ensure_working_device()  # this process computes on the default device: a wrong GPU leaves it first
    spec = json.loads(Path(sys.argv[1]).read_text())
    print(json.dumps(main(spec["model"], spec["variant"], spec["path"], spec["continuation"], spec["steps"])))
