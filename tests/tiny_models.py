"""The tiny random-weight models live in ``harness.tiny_models`` (the stress experiment uses them too)."""

from harness.tiny_models import VOCAB, byte_tokenizer, tiny_gemma3, tiny_llama  # noqa: F401
