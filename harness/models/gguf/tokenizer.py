"""Rebuild a Hugging Face fast tokenizer from the vocabulary inside a GGUF file.

transformers can read GGUF tokenizers only with PyTorch installed, so the
``tokenizers`` library builds one directly, following llama.cpp's behaviour:

- ``gpt2`` vocabularies (SmolLM2): byte-level BPE from the stored merges; the
  ``smollm`` pre-tokenizer also splits every digit on its own.
- ``llama`` vocabularies (Gemma 3, SentencePiece BPE): merges are derived from
  the token scores, spaces become ``▁``, unknown bytes fall back to ``<0xNN>``.

Control tokens become special added tokens; user-defined tokens (Gemma's
newline and space runs, HTML tags) are matched verbatim before BPE, as
llama.cpp does.
"""

from __future__ import annotations

import json
from pathlib import Path

from gguf import GGUFReader
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

NORMAL, CONTROL, USER_DEFINED, BYTE = 1, 3, 4, 6


def _field(reader: GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's score-ordered merging.

    A merge (l, r) exists when l, r and l+r are all normal tokens; merges whose
    result scores higher are applied first, as llama.cpp's SPM tokenizer does.
    """
    vocab = {t: i for i, t in enumerate(tokens) if types[i] == NORMAL}
    found = []
    for piece, pid in vocab.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                found.append((-scores[pid], pid, vocab[left], vocab[right], left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def _bpe_byte_level(reader: GGUFReader, vocab: dict[str, int]) -> Tokenizer:
    """A ``gpt2`` vocabulary: byte-level BPE from the stored merges (``smollm`` also splits every digit)."""
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if _field(reader, "tokenizer.ggml.pre") == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _bpe_sentencepiece(reader: GGUFReader, vocab: dict[str, int], tokens: list[str], types: list[int]) -> Tokenizer:
    """A ``llama`` vocabulary: merges from the scores, spaces as ``▁``, unknown bytes as ``<0xNN>``."""
    scores = list(_field(reader, "tokenizer.ggml.scores"))
    unk = tokens[int(_field(reader, "tokenizer.ggml.unknown_token_id", 0))]
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=spm_merges(tokens, scores, types),
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    norm = [normalizers.Replace(" ", "▁")]
    if _field(reader, "tokenizer.ggml.add_space_prefix", False):
        norm.insert(0, normalizers.Prepend("▁"))
    tok.normalizer = normalizers.Sequence(norm)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return tok


def _special_settings(reader: GGUFReader, tok: Tokenizer, tokens: list[str], vocab: dict[str, int]) -> dict:
    """Prepend BOS where the file asks for it; the special-token settings for tokenizer_config."""

    def name(key: str) -> str | None:
        idx = _field(reader, f"tokenizer.ggml.{key}_token_id")
        return None if idx is None else tokens[int(idx)]

    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", False))
    bos = name("bos")
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
        )
    return {
        "bos_token": bos,
        "eos_token": name("eos"),
        "unk_token": name("unknown"),
        "pad_token": name("padding"),
        "add_bos_token": add_bos,
        "add_eos_token": False,
    }


def build_tokenizer(reader: GGUFReader) -> tuple[Tokenizer, dict]:
    """Return the fast tokenizer and the special-token settings for tokenizer_config."""
    kind = _field(reader, "tokenizer.ggml.model")
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type", [NORMAL] * len(tokens)))
    vocab = {t: i for i, t in enumerate(tokens)}

    if kind == "gpt2":
        tok = _bpe_byte_level(reader, vocab)
    elif kind == "llama":
        tok = _bpe_sentencepiece(reader, vocab, tokens, types)
    else:
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r}")

    tok.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == USER_DEFINED]
    )
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == CONTROL]
    )
    return tok, _special_settings(reader, tok, tokens, vocab)


def write_tokenizer(reader: GGUFReader, out_dir: Path, chat_template: str | None = None) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json."""
    tok, settings = build_tokenizer(reader)
    tok.save(str(out_dir / "tokenizer.json"))
    template = chat_template or _field(reader, "tokenizer.chat_template")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 30,
        **settings,
    }
    if template:
        config["chat_template"] = template
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special = {k: v for k, v in settings.items() if k.endswith("_token") and v is not None}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
