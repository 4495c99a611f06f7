"""The tiny random-weight models live in ``harness.models.tiny`` (the stress experiment uses them too)."""

from harness.models.tiny import VOCAB, byte_tokenizer, tiny_gemma3, tiny_llama  # noqa: F401
