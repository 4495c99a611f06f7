"""The served side of one model's support check: ``python -m harness.matrix.agent MODEL CACHE PHASE [--no-echo]``.

It opens a :class:`semantic.Service` on the model directory (the real
``mlx_lm.load``, the default block store in ``CACHE``) and plays a script of
chat turns, one JSON line per turn on stdout: the ids the turn was given, the
tokens and logprobs it generated, and the tokens its cache covered. The
checker (``harness.matrix.check``) compares each with mlx-lm's own
``generate_step`` on the same ids, in another process.

Phases:
    live     agent ``a``: a first turn, an append, a regenerate, an edit of the last
             message, an append on the edit, a return to the first branch; agent ``b``
             on the same system prompt; three agents of different lengths in one
             batch. Then ``saved`` once every save is on disk, and it waits to be
             SIGKILLed.
    restart  a new process over the same directory: agent ``a`` appends to its
             last turn, from disk.
"""

from __future__ import annotations

import json
import sys
import time

SYSTEM = ("You are a careful coding agent. Read the files you are given, keep answers short, and cite the "
          "lines you change. Tools: read_file(path), write_file(path, text), run(cmd). ") * 4
MAX_TOKENS = 10


def _msg(role: str, text: str) -> dict:
    return {"role": role, "content": text}


class Script:
    """Turns of named agents through one service; prints what each turn did."""

    def __init__(self, service):
        self.service = service
        self.last: dict[str, list[dict]] = {}  # agent -> its messages with the last reply

    def turn(self, name: str, agent: str, messages: list[dict], *, submit_only: bool = False):
        from semantic.service import TurnRequest

        prepared = self.service.prepare(TurnRequest(messages=messages, agent=agent, max_tokens=MAX_TOKENS))
        future = self.service.submit(prepared.request)
        if submit_only:
            return name, agent, messages, prepared, future
        return self.finish(name, agent, messages, prepared, future)

    def finish(self, name, agent, messages, prepared, future):
        done = future.result(300)
        eos = self.service.eos
        text = self.service.tokenizer.decode([t for t in done.token_ids if t not in eos])
        self.service.remember(prepared, done, text, [])
        self.last[agent] = messages + [_msg("assistant", text)]
        print(json.dumps({"turn": name, "agent": agent, "ids": list(done.request.ids), "tokens": done.token_ids,
                          "logprobs": done.logprobs, "cached": done.cached_tokens,
                          "boundaries": list(done.request.boundaries), "finish": done.finish_reason}), flush=True)
        return messages + [_msg("assistant", text)]


def live(service) -> None:
    s = Script(service)
    base = [_msg("system", SYSTEM), _msg("user", "Open main.py and tell me what the entry point does.")]
    t1 = s.turn("first", "a", base)
    ask2 = t1 + [_msg("user", "Now add a --verbose flag to it.")]
    t2 = s.turn("append", "a", ask2)
    s.turn("regenerate", "a", ask2)
    edit = t1 + [_msg("user", "Now add a --quiet flag to it instead.")]
    t3 = s.turn("edit", "a", edit)
    s.turn("append_after_edit", "a", t3 + [_msg("user", "And document it in the README.")])
    s.turn("branch", "a", t2 + [_msg("user", "Also print the version.")])
    s.turn("second_agent", "b", [_msg("system", SYSTEM), _msg("user", "List the tests.")])
    batch = [s.turn(f"batch_{i}", f"c{i}", [_msg("system", SYSTEM[: 60 + 170 * i]), _msg("user", "Hi " * (1 + 5 * i))],
                    submit_only=True) for i in range(3)]
    for args in batch:
        s.finish(*args)
    for agent in ("a", "b", "c0", "c1", "c2"):
        if not service.wait_saved(service.agent_id("", agent), 120):
            print(json.dumps({"error": f"agent {agent}'s cache was not saved"}), flush=True)
    print(json.dumps({"saved": True, "last": s.last["a"]}), flush=True)
    time.sleep(600)  # the checker SIGKILLs this process now


def restart(service, last: list[dict]) -> None:
    Script(service).turn("restart", "a", last + [_msg("user", "Thanks. One more check, please.")])


def main(argv: list[str]) -> None:
    from semantic.service import Service

    model, cache, phase = argv[:3]
    service = Service.open(model, cache_dir=cache, pool_bytes=64 << 20, disk_budget_bytes=1 << 30,
                           echo_history="--no-echo" not in argv)
    try:
        if phase == "live":
            live(service)
        else:
            restart(service, json.loads(sys.stdin.readline()))
    finally:
        service.close(60)


if __name__ == "__main__":
    main(sys.argv[1:])
