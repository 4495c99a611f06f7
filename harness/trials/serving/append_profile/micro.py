"""Costs MLX's lazy evaluation hides inside other spans, timed apart: the prefill's chunking and
per-chunk barrier, the log-softmax over the vocabulary, the chat template and the tokenizer."""

from __future__ import annotations

import statistics
import time

from harness.trials.serving.append_profile.reference import back_to, prefilled
from harness.trials.serving.append_profile.report import ms, progress


def micro(model, tok, prefix, appended, msgs, tool, chunk: int) -> dict:
    """Costs hidden inside other spans, each the median of a few runs."""
    import mlx.core as mx

    new = appended[len(prefix):]
    cache = prefilled(model, prefix)

    def prefill(step: int, barrier: bool, clear: bool) -> float:
        back_to(cache, len(prefix))
        t0 = time.perf_counter()
        for i in range(0, len(new), step):
            logits = model(mx.array([new[i:i + step]]), cache=cache)
            if i + step < len(new):
                if barrier:
                    mx.eval([c.state for c in cache])
                if clear:
                    mx.clear_cache()
        mx.eval(logits[:, -1, :], [c.state for c in cache])
        return time.perf_counter() - t0

    def median(f, n=3) -> float:
        f()
        return ms(statistics.median(f() for _ in range(n)))

    progress("micro-benchmarks")

    row = mx.random.normal((1, model.args.vocab_size))
    mx.eval(row)

    def logsoftmax():
        t0 = time.perf_counter()
        mx.eval(row - mx.logsumexp(row, axis=-1, keepdims=True))
        return time.perf_counter() - t0

    second = msgs + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": tool}]
    text = tok.apply_chat_template(second, add_generation_prompt=True, tokenize=False)

    def template():
        t0 = time.perf_counter()
        tok.apply_chat_template(second, add_generation_prompt=True, tokenize=False)
        return time.perf_counter() - t0

    def encode():
        t0 = time.perf_counter()
        tok.encode(text, add_special_tokens=False)
        return time.perf_counter() - t0

    return {
        f"prefill {len(new)} tokens in {chunk}-token chunks, eval + clear_cache between (ours)": median(lambda: prefill(chunk, True, True)),
        f"prefill in {chunk}-token chunks, eval between, no clear_cache": median(lambda: prefill(chunk, True, False)),
        f"prefill in {chunk}-token chunks, no barrier (one graph)": median(lambda: prefill(chunk, False, False)),
        f"prefill in one {len(new)}-token chunk (mlx-lm's 2048 step)": median(lambda: prefill(2048, False, False)),
        "log-softmax over the vocabulary (one row)": median(logsoftmax, 10),
        "chat template render (second turn)": median(template, 5),
        f"tokenize the second turn ({len(appended)} tokens)": median(encode, 5),
    }
