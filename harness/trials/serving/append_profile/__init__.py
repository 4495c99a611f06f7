"""Where a cached append turn's time goes: ~300 new tokens over a ~2K-token cache.

Two parts, both on one prepared model (SmolLM2-135M f32 by default):

- **engine**: in this process, a ``Service`` (the scheduler and engine the
  server runs) against mlx-lm's ``generate_step`` on the same tokens with a
  ``KVCache`` prefilled with the cached prefix. Our side is traced: every
  call of the functions named in ``TRACED`` is a span on its thread, and each
  span is placed before the turn's last token (on the client's critical
  path) or after it (the closing feed step, the extract, the save
  preparation). A few costs MLX's lazy evaluation hides inside other spans
  are timed apart: the prefill's chunking and per-chunk barrier, the
  log-softmax over the vocabulary, the chat template and the tokenizer.
- **http** (``--http``): ``semantic serve`` against ``python -m mlx_lm
  server`` on 127.0.0.1, interleaved A B / B A, timed from the client with
  streamed chat completions: TTFT (first content chunk) and the whole turn
  (the stream's end, after the usage chunk).

Each agent's first turn (``--cached`` tokens: a coding agent's system prompt
and a file it read) is untimed; its second appends ``--new`` tokens (a tool's
output) and is timed. Every sample is a fresh agent, so each timed turn
starts from the same cache.

    python -m harness.trials.serving.append_profile --trials 5 --http --json results/exp_009_serving/long_append_profile.json

Its parts: ``turns`` (the token material), ``engine`` (our service's traced turns, with ``tracing``),
``reference`` (mlx-lm's ``generate_step`` on a prefilled ``KVCache``), ``micro`` (the hidden costs
timed apart), ``over_http`` (both servers from the client), ``report`` (progress lines and the
summary), and ``__main__`` (the flags).
"""
