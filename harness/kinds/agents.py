"""Pieces shared by the agent experiments (EXP-007, EXP-008) and their child processes.

A conversation is a list of chat messages, rendered by the model's chat
template each turn, as a client would send it. Text of a given token length
comes from the built-in history corpus, read from a per-user offset so that
users' histories differ.
"""

from __future__ import annotations

from pathlib import Path

from harness.kinds.common import HISTORY
from semantic import AgentCacheStore, BlockPool, ConcurrentScheduler, ModelCacheSpec

WORDS = HISTORY.split()


def text_of_tokens(tokenizer, n_tokens: int, offset: int = 0, prefix: str = "") -> str:
    """About ``n_tokens`` tokens of English (``prefix`` first), from word ``offset`` of the corpus, cycling."""
    if n_tokens <= 0:
        return prefix
    words, i = [prefix] if prefix else [], offset
    # grow by an estimate, then trim word by word: tokenizing is cheap next to a prefill
    while len(tokenizer.encode(" ".join(words), add_special_tokens=False)) < n_tokens:
        words.extend(WORDS[(i + j) % len(WORDS)] for j in range(32))
        i += 32
    while len(words) > 1 and len(tokenizer.encode(" ".join(words[:-1]), add_special_tokens=False)) >= n_tokens:
        words.pop()
    return " ".join(words)


def system_prompt(tokenizer, n_tokens: int) -> dict:
    """The shared system prompt with tool definitions, about ``n_tokens`` long."""
    head = ("You are a careful research agent. Tools: search(query) returns passages; "
            "calculator(expression) returns a number; notes(text) stores a note. Reference material:")
    return {"role": "system", "content": text_of_tokens(tokenizer, n_tokens, 0, head)}


def user_history(tokenizer, user: int, n_tokens: int) -> list[dict]:
    """A user's earlier exchange (``n_tokens`` about evenly split between a question and an answer)."""
    if n_tokens <= 0:
        return []
    q = text_of_tokens(tokenizer, n_tokens // 2, 97 * (user + 1), f"User {user} shares their notes:")
    a = text_of_tokens(tokenizer, n_tokens - n_tokens // 2, 131 * (user + 1) + 50, "Summary:")
    return [{"role": "user", "content": q}, {"role": "assistant", "content": a}]


def question(tokenizer, user: int, turn: int, n_tokens: int) -> dict:
    return {"role": "user", "content": text_of_tokens(tokenizer, n_tokens, 61 * user + 17 * turn, f"Question {turn}:")}


def open_scheduler(loaded, cache_dir: Path, blocks: int, max_batch: int = 8, write_behind: bool = True,
                   block_tokens: int = 256, ram_budget_bytes: int | None = None):
    """A scheduler over a fresh pool and a store in ``cache_dir`` (files there are found: a restart);
    ``ram_budget_bytes`` bounds its resident caches (None: the pool does)."""
    spec = ModelCacheSpec.from_model(loaded.model)
    pool = BlockPool(spec, blocks, block_tokens)
    store = AgentCacheStore(cache_dir, spec, loaded.fingerprint, disk_budget_bytes=1 << 40, pool=pool)
    # no stop tokens: every turn generates exactly max_tokens, so turns compare step for step
    return ConcurrentScheduler(loaded.model, loaded.tokenizer, store, max_batch=max_batch,
                               write_behind=write_behind, stop_tokens=[], ram_budget_bytes=ram_budget_bytes)
