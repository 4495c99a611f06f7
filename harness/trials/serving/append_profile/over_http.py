"""The HTTP part: ``semantic serve`` against ``mlx_lm.server`` on 127.0.0.1, their turns in rotating
order, each timed from the client over a streamed chat completion."""

from __future__ import annotations

import os
import time
from collections import defaultdict
from pathlib import Path

from harness.trials.serving.append_profile.report import progress
from harness.trials.serving.append_profile.turns import conversation

CHECKOUT = Path(__file__).resolve().parents[4]   # this checkout's root: its ``semantic`` is the server's


def http_part(model_dir: Path, trials: int, cached: int, new: int, max_tokens: int, workdir: Path,
              before: Path | None = None) -> dict:
    """Both servers (and, with ``before``, ours from that checkout too), their turns in rotating order."""
    import openai
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    servers = {}
    try:
        _start(servers, model_dir, workdir, before)
        clients = {n: openai.OpenAI(base_url=f"{r.url}/v1", api_key="none", max_retries=0, timeout=600)
                   for n, r in servers.items()}
        samples = defaultdict(list)
        msgs, _ = conversation(tok, cached, new, 0)
        for name, client in clients.items():  # warm: compile, and the first turn's prefix cached
            _chat(client, servers[name].model, msgs, max_tokens, "warm", name)
        names = list(servers)
        for trial in range(trials):
            _, tool = conversation(tok, cached, new, trial + 1)
            k = trial % len(names)
            for name in names[k:] + names[:k]:  # each side first, second, ... in turn
                client, model = clients[name], servers[name].model
                agent = f"append-{trial}"
                reply = _chat(client, model, msgs, max_tokens, agent, name)
                second = msgs + [{"role": "assistant", "content": reply["text"]}, {"role": "user", "content": tool}]
                got = _chat(client, model, second, max_tokens, agent, name)
                got["load"] = os.getloadavg()[0]
                samples[name].append(got)
                progress(f"http trial {trial + 1}/{trials} {name}: TTFT {got['ttft_s']:.3f} s, turn {got['turn_s']:.3f} s")
        return {"samples": dict(samples)}
    finally:
        for r in servers.values():
            r.stop()


def _start(servers: dict, model_dir: Path, workdir: Path, before: Path | None) -> None:
    """Ours, mlx_lm.server and (with ``before``) ours from that checkout, each put in ``servers`` as it
    starts, so that one failing to start leaves the others there to be stopped."""
    from harness.servers import processes
    from harness.servers.targets import MLX_LM, OURS, TARGETS

    sides = [(OURS, OURS, None), (MLX_LM, MLX_LM, None)] + ([(OURS + "@before", OURS, before)] if before else [])
    path = os.environ.get("PYTHONPATH")
    for name, kind, checkout in sides:
        # each of ours imports ``semantic`` from its own checkout
        os.environ["PYTHONPATH"] = str(Path(checkout or CHECKOUT).resolve())
        servers[name] = processes.start(TARGETS[kind], model_dir, processes.free_port(),
                                        workdir / name.replace(".", "_").replace("@", "_"), model_id="model")
    if path is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = path


def _chat(client, model: str, messages: list[dict], max_tokens: int, agent: str, server: str) -> dict:
    """One streamed chat turn timed from the client: first content chunk, last content chunk, stream end."""
    from harness.servers.targets import OURS

    extra = {"prompt_cache_key": agent} if server.startswith(OURS) else {}
    t0 = time.perf_counter()
    first = last = None
    parts, usage = [], None
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                            stream=True, stream_options={"include_usage": True}, extra_body=extra)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            last = time.perf_counter()
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    end = time.perf_counter()
    details = getattr(usage, "prompt_tokens_details", None) if usage else None
    return {"text": "".join(parts), "ttft_s": (first or end) - t0, "last_token_s": (last or end) - t0,
            "turn_s": end - t0, "prompt_tokens": usage.prompt_tokens if usage else None,
            "cached_tokens": getattr(details, "cached_tokens", None) if details else None,
            "completion_tokens": usage.completion_tokens if usage else None}
