"""The restarted process of EXP-007: continue every conversation from the cache files alone.

``python -m harness.trials.multiturn.child SPEC.json`` opens a new pool,
store and scheduler on the cache directory (nothing of the first process
survives but its files), runs each conversation's next turn alone, then a
full re-prefill of the reference conversation, and prints one JSON line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from harness import device, models
from harness.executors import fresh_first_token, logprob_diff, make_executor, open_scheduler
from semantic import Request, encode, render_chat


def main(spec: dict) -> dict:
    loaded = models.load(spec["model"], spec["variant"])
    fresh = make_executor(loaded, spec["pool_blocks"])
    fresh_first_token(fresh, loaded.tokenizer.encode("warm up the kernels"))
    sched = open_scheduler(loaded, Path(spec["cache_dir"]), spec["pool_blocks"], write_behind=False)
    turns, results = {}, {}
    try:
        for agent, convo in spec["conversations"].items():  # one at a time: each TTFT is its own
            r = results[agent] = sched.submit(Request(agent, encode(loaded.tokenizer, convo), spec["answer_tokens"]), timeout=None).result()
            turns[agent] = {"ttft_ms": r.ttft_s * 1e3, "context_tokens": r.history_tokens,
                            "cached_tokens": r.cached_tokens, "new_tokens": r.prompt_tokens, "reuse": r.reuse}
        store = sched.store.stats()
    finally:
        sched.close()
    ref = spec["reference"]
    full = fresh_first_token(fresh, render_chat(loaded.tokenizer, spec["conversations"][ref]))
    return {
        "turns": turns,
        "disk_hits": store.disk_hits,
        "reference": ref,
        "reference_context_tokens": turns[ref]["context_tokens"],
        "reference_cached_ms": turns[ref]["ttft_ms"],
        "reference_uncached_ms": full.ttft_s * 1e3,
        "first_token_match": full.token_ids[0] == results[ref].token_ids[0],
        "first_logprob_diff": logprob_diff(full.logprobs[:1], results[ref].logprobs[:1]),
    }


if __name__ == "__main__":
    device.ensure_working_device()  # this process computes on the default device: a wrong GPU leaves it first
    print(json.dumps(main(json.loads(Path(sys.argv[1]).read_text()))))
