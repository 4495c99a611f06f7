"""Constrained decoding: a grammar a sequence's tokens must follow, as a per-step token mask (llguidance).

A :class:`Grammar` is plain data a :class:`~semantic.request.Request` carries
(llguidance's grammar text: from a JSON schema or a Lark grammar). The executor
turns it into a :class:`Constraint` (an ``LLMatcher`` over the model's
vocabulary) when the request starts; the step loop then, for that row only::

    before sampling   logits = where(allowed tokens, logits, -inf)    (other rows untouched: bit for bit)
    after reading     matcher.consume_token(token); a finished grammar ends the sequence ("stop")

llguidance computes each mask in Rust with the GIL released, a few tens of
microseconds for a JSON schema over a 50K vocabulary; its MLX helper is a
Metal kernel, so the mask is applied here with ``mx.where`` on every device.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from weakref import WeakKeyDictionary

import numpy as np

from semantic.errors import InvalidRequestError


@dataclass(frozen=True, slots=True)
class Grammar:
    """An llguidance grammar (its JSON or Lark text) and what it was made from, for messages."""

    text: str
    source: str  # "json_schema", "json_object", "lark", ...

    @classmethod
    def json_schema(cls, schema: dict, source: str = "json_schema") -> "Grammar":
        """Output that is one JSON value matching ``schema``.

        Raises:
            InvalidRequestError: ``schema`` is not a JSON object.
        """
        import llguidance

        if not isinstance(schema, dict):
            raise InvalidRequestError(f"a JSON schema must be an object, got {type(schema).__name__}")
        try:
            # fixed separators, no free whitespace: a model cannot pad the output forever, and it reads like json.dumps
            options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
            return cls(llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=options), source)
        except (ValueError, TypeError) as exc:
            raise InvalidRequestError(f"unusable JSON schema: {exc}"[:300]) from None

    @classmethod
    def lark(cls, grammar: str, source: str = "lark") -> "Grammar":
        import llguidance

        return cls(llguidance.LLMatcher.grammar_from_lark(grammar), source)


_TOKENIZERS: WeakKeyDictionary = WeakKeyDictionary()  # tokenizer wrapper -> {vocab size: LLTokenizer}
_LOCK = threading.Lock()


def ll_tokenizer(tokenizer, vocab_size: int):
    """llguidance's view of ``tokenizer`` (an mlx-lm TokenizerWrapper) over ``vocab_size`` ids, built once."""
    import llguidance.hf

    with _LOCK:
        per = _TOKENIZERS.setdefault(tokenizer, {})
        if vocab_size not in per:
            hf = getattr(tokenizer, "_tokenizer", tokenizer)
            eos = list(getattr(tokenizer, "eos_token_ids", ()) or ()) or None
            per[vocab_size] = llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size, eos_token=eos)
        return per[vocab_size]


def check(grammar: Grammar, tokenizer, vocab_size: int) -> None:
    """Refuse a grammar llguidance cannot use with this tokenizer, before anything is queued.

    Raises:
        InvalidRequestError: naming what is wrong with it.
    """
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(grammar.text, ll_tokenizer(tokenizer, vocab_size))
    if error and not error.startswith("WARNING"):
        raise InvalidRequestError(f"the {grammar.source} cannot be used for decoding: {error}"[:400])


class Constraint:
    """One sequence's grammar state: which tokens may come next, advanced by each token read."""

    def __init__(self, grammar: Grammar, tokenizer, vocab_size: int):
        import llguidance

        self.vocab_size = vocab_size
        self.matcher = llguidance.LLMatcher(ll_tokenizer(tokenizer, vocab_size), grammar.text, log_level=0)
        if self.matcher.is_error():
            raise InvalidRequestError(f"the {grammar.source} cannot be used for decoding: {self.matcher.get_error()}"[:400])
        self._bits = np.zeros((vocab_size + 31) // 32, dtype=np.int32)

    def allowed(self) -> np.ndarray:
        """A bool per token id: may it come next."""
        self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        return np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self.vocab_size].astype(bool)

    def advance(self, token: int) -> bool:
        """Consume the token just read; True when the grammar is complete (the sequence ends here)."""
        self.matcher.consume_token(int(token))
        return self.matcher.is_stopped()
