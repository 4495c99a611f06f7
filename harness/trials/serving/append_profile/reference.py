"""The reference: mlx-lm's ``generate_step`` on the appended tokens over a ``KVCache`` prefilled with the prefix."""

from __future__ import annotations

import time

from harness.trials.serving.append_profile.report import ms


def prefilled(model, prefix: list[int]) -> list:
    """mlx-lm's KVCache of ``prefix`` (2048-token steps, as its generate_step prefills)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    for i in range(0, len(prefix), 2048):
        model(mx.array([prefix[i:i + 2048]]), cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def back_to(cache: list, n: int) -> list:
    """``cache`` cut back to its first ``n`` tokens (a KVCache trims by moving its offset)."""
    from mlx_lm.models.cache import trim_prompt_cache

    trim_prompt_cache(cache, cache[0].offset - n)
    return cache


def reference(model, eos, cache, new, max_tokens) -> dict:
    """mlx-lm's generate_step on ``new`` over ``cache`` (a KVCache of the prefix, cut back to it after)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    held = cache[0].offset
    t0 = time.perf_counter()
    first, n = None, 0
    for token, _ in generate_step(mx.array(new), model, prompt_cache=cache, max_tokens=max_tokens):
        first = first or time.perf_counter()
        n += 1
        if int(token) in eos:
            break
    t1 = time.perf_counter()
    back_to(cache, held)
    return {"ttft_ms": ms(first - t0), "last_token_ms": ms(t1 - t0), "generated": n}
