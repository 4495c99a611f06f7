"""The token material of a profiled turn: a coding agent that read a file, then a tool's output appended."""

from __future__ import annotations

from pathlib import Path

import semantic

SOURCE = Path(semantic.__file__).parent   # the installed package: the files exist wherever the harness runs
SYSTEM = ("You are a coding agent in a Python repository. Tools: read_file(path), run_tests(pattern), "
          "apply_patch(diff). Keep answers short and never invent file names.")
# what the agent read (its first turn) and what a tool answered (the append): the project's own source
READ_FILE = SOURCE / "sched" / "scheduler.py"
TOOL_OUTPUT = SOURCE / "sched" / "planner.py"


def conversation(tokenizer, cached: int, new: int, trial: int) -> tuple[list[dict], str]:
    """A first turn's messages of about ``cached`` tokens, and a tool output of about ``new`` tokens
    (its first line names the trial, so no two samples' appends are equal)."""
    source = READ_FILE.read_text()
    lo, hi = 0, len(source)
    while hi - lo > 64:  # the longest prefix of the file that keeps the turn within ``cached`` tokens
        mid = (lo + hi) // 2
        msgs = _first_turn(source[:mid])
        n = len(tokens_of(tokenizer, msgs))
        lo, hi = (mid, hi) if n <= cached else (lo, mid)
    tool = TOOL_OUTPUT.read_text()
    ids = tokenizer.encode(tool, add_special_tokens=False)[: new - 12]
    return _first_turn(source[:lo]), f"run_tests #{trial}:\n" + tokenizer.decode(ids)


def tokens_of(tokenizer, messages: list[dict]) -> list[int]:
    """The chat template's token ids (rendered, then encoded: tokenizers differ in what ``tokenize=True`` gives)."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def _first_turn(text: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": "read_file('semantic/sched/scheduler.py') returned:\n" + text}]
