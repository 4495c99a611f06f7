"""Time to first token through HTTP: an agent's cached turn against the same turn uncached.

Starts ``semantic serve`` on a prepared model (a subprocess on 127.0.0.1 with
a fresh cache directory) and drives it with the official ``openai`` SDK, timing
from the client: request sent → first streamed content chunk. Each trial sends
the agent's next turn twice, in alternating order (A B / B A):

- **cached**: under its ``prompt_cache_key``, so the server starts from the
  agent's own cache and prefills only the new message;
- **uncached**: the same history, anonymous, under a ``cache_salt`` used once,
  so no cached block can match and the whole history is prefilled.

Prints a table (pandas) and the median ratio; ``--json`` writes the numbers.
EXP-009 measures the server against its peers; this is the single-server
check: the same server's cached turn against its uncached one.

    python -m harness.serve_ttft --model smollm2-135m --turns 6
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from harness.servers.processes import free_port

SYSTEM = (
    "You are a coding agent in a Python repository. Tools: read_file(path), run_tests(pattern), "
    "apply_patch(diff). Think step by step, keep answers short, never invent file names. "
)
USER_TURNS = [
    "List the modules under semantic/ and say what each does.",
    "Which test covers the block pool's reference counts?",
    "Run the scheduler tests and summarize any failure.",
    "Propose a patch that makes the saver retry once on EIO.",
    "Now write the unit test for that patch.",
    "Explain the cache file's header in two sentences.",
    "What would break if block_tokens were 128?",
    "Summarize this session in three bullet points.",
]


def _first_token_s(client, model: str, messages: list[dict], max_tokens: int, **extra) -> tuple[float, str, dict]:
    """Client-side seconds to the first content chunk, the whole reply, and its usage."""
    t0 = time.perf_counter()
    first, parts, usage = None, [], None
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                            stream=True, stream_options={"include_usage": True}, **extra)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    return (first or time.perf_counter()) - t0, "".join(parts), {
        "prompt_tokens": usage.prompt_tokens, "cached_tokens": usage.prompt_tokens_details.cached_tokens}


def run(model_dir: Path, model_id: str, turns: int, system_repeats: int, max_tokens: int) -> list[dict]:
    import openai

    port = free_port()
    cache = Path(tempfile.mkdtemp(prefix="serve-ttft-"))
    env = {**os.environ}
    proc = subprocess.Popen([sys.executable, "-m", "semantic.serve", "--model", str(model_dir), "--model-id", model_id,
                             "--port", str(port), "--cache-dir", str(cache / "agents")],
                            stdout=open(cache / "server.log", "wb"), stderr=subprocess.STDOUT, env=env)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
        deadline = time.monotonic() + 300
        while True:
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError((cache / "server.log").read_text()[-3000:])
                time.sleep(0.3)
        history = [{"role": "system", "content": SYSTEM * system_repeats}]
        rows = []
        for turn in range(turns):
            history.append({"role": "user", "content": USER_TURNS[turn % len(USER_TURNS)]})
            sides = ["cached", "uncached"] if turn % 2 == 0 else ["uncached", "cached"]
            got = {}
            for side in sides:
                if side == "cached":
                    got[side] = _first_token_s(client, model_id, history, max_tokens, prompt_cache_key="ttft-agent")
                else:
                    got[side] = _first_token_s(client, model_id, history, max_tokens,
                                               extra_body={"cache_salt": f"never-seen-{turn}-{time.time_ns()}"})
            reply = got["cached"][1]
            rows.append({
                "turn": turn + 1, "prompt_tokens": got["cached"][2]["prompt_tokens"],
                "cached_tokens": got["cached"][2]["cached_tokens"],
                "uncached_cached_tokens": got["uncached"][2]["cached_tokens"],
                "ttft_cached_s": got["cached"][0], "ttft_uncached_s": got["uncached"][0],
                "same_reply": reply == got["uncached"][1],
            })
            history.append({"role": "assistant", "content": reply})
        return rows
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def main(argv: list[str] | None = None) -> int:
    import pandas as pd

    from harness import models

    p = argparse.ArgumentParser(prog="python -m harness.serve_ttft", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="a registered model name (prepared by `make models`)")
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-repeats", type=int, default=24, help="copies of the agent's system text (its length)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--json", type=Path, help="write the rows and the summary here")
    a = p.parse_args(argv)
    variant = models.default_variant(None)
    rows = run(models.prepared_dir(a.model, variant), a.model, a.turns, a.system_repeats, a.max_tokens)
    df = pd.DataFrame(rows)
    df["ratio"] = df.ttft_uncached_s / df.ttft_cached_s
    print(df.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    later = df[df.turn > 1]  # turn 1 has no cache of its own yet
    summary = {
        "model": a.model, "variant": variant, "turns": a.turns,
        "median_ttft_cached_s": float(np.median(later.ttft_cached_s)),
        "median_ttft_uncached_s": float(np.median(later.ttft_uncached_s)),
        "median_ratio": float(np.median(later.ratio)),
        "all_replies_equal": bool(df.same_reply.all()),
    }
    print(json.dumps(summary, indent=1))
    if a.json:
        a.json.write_text(json.dumps({"rows": rows, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
