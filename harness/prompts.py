"""Prompts from the built-in history text: plain token ids, and chat conversations of a given length; the
prefix rendered prompts share.

A conversation is a list of chat messages, rendered by the model's chat
template each turn, as a client would send it. Text of a given token length
comes from the history corpus, read from a per-user offset so that users'
histories differ.
"""

from __future__ import annotations

from pathlib import Path

from semantic.cache.reuse import common_prefix

HISTORY = (Path(__file__).parent / "data" / "history.txt").read_text()
WORDS = HISTORY.split()


def history_ids(tokenizer, n: int) -> list[int]:
    """The first ``n`` tokens of a fixed English text (BOS included where the model has one)."""
    ids = tokenizer.encode(HISTORY)
    if n > len(ids):
        raise ValueError(f"history_tokens={n}, but the built-in history text has only {len(ids)} tokens")
    return ids[:n]


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


def shared_prefix(seqs: list[list[int]]) -> int:
    """How many leading tokens every sequence (rendered prompt) shares; 0 of none."""
    return min((common_prefix(seqs[0], s) for s in seqs[1:]), default=len(seqs[0])) if seqs else 0
