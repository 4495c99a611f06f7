"""The tiny random-weight models live in ``harness.models.tiny`` (the stress experiment uses them too)."""

from harness.models.tiny import (  # noqa: F401
    VOCAB, byte_tokenizer, tiny_gemma3, tiny_gpt_oss, tiny_lfm2, tiny_llama, tiny_qwen3_next)
