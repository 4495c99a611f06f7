"""Tokenizers rebuilt from GGUF vocabularies behave like llama.cpp's."""

from __future__ import annotations

import gguf
import pytest

from harness.models.gguf.tokenizer import CONTROL, NORMAL, USER_DEFINED, build_tokenizer, spm_merges

pytestmark = pytest.mark.compat

BYTE = 6


def _write(path, arch, fields):
    w = gguf.GGUFWriter(str(path), arch)
    w.add_tokenizer_model(fields["model"])
    if "pre" in fields:
        w.add_tokenizer_pre(fields["pre"])
    w.add_token_list(fields["tokens"])
    w.add_token_types(fields["types"])
    if "scores" in fields:
        w.add_token_scores(fields["scores"])
    if "merges" in fields:
        w.add_token_merges(fields["merges"])
    w.add_bos_token_id(fields["bos"])
    w.add_eos_token_id(fields["eos"])
    w.add_add_bos_token(fields["add_bos"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return gguf.GGUFReader(str(path))


@pytest.fixture
def spm_reader(tmp_path):
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "\n\n"]
    types = [CONTROL] * 5 + [USER_DEFINED]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [BYTE] * 256
    normal = ["▁", "a", "b", "c", "ab", "▁a", "▁ab", "abc"]
    tokens += normal
    types += [NORMAL] * len(normal)
    # higher score merges first: "ab" before "▁a", so "▁ab" is built as ▁ + ab
    score = {"ab": -1.0, "▁ab": -2.0, "abc": -3.0, "▁a": -4.0}
    scores = [score.get(t, -100.0) for t in tokens]
    return _write(
        tmp_path / "spm.gguf",
        "gemma3",
        dict(model="llama", tokens=tokens, types=types, scores=scores, bos=2, eos=1, add_bos=True),
    )


def test_spm_tokenizer_merges_by_score_adds_bos_and_falls_back_to_bytes(spm_reader):
    tok, settings = build_tokenizer(spm_reader)
    ids = tok.encode("ab abc").ids
    pieces = [tok.id_to_token(i) for i in ids]
    assert pieces == ["<bos>", "ab", "▁ab", "c"]
    assert settings["bos_token"] == "<bos>" and settings["add_bos_token"] is True
    # "é" is not in the vocabulary: its two UTF-8 bytes come back as byte tokens
    enc = tok.encode("é")
    assert [tok.id_to_token(i) for i in enc.ids[1:]] == ["<0xC3>", "<0xA9>"]
    assert tok.decode(enc.ids, skip_special_tokens=True) == "é"
    # control tokens are special; user-defined ones match verbatim
    turn = tok.encode("<start_of_turn>a\n\nb").ids
    assert [tok.id_to_token(i) for i in turn] == ["<bos>", "<start_of_turn>", "a", "\n\n", "b"]


def test_spm_merges_only_join_normal_tokens():
    tokens = ["<bos>", "a", "b", "ab", "<0x61>"]
    types = [CONTROL, NORMAL, NORMAL, NORMAL, BYTE]
    assert spm_merges(tokens, [0, -5, -5, -1, 0], types) == [("a", "b")]


def _byte_level_alphabet():
    # GPT-2's printable stand-ins for the 256 byte values
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


@pytest.mark.parametrize("pre,digit_pieces", [("smollm", ["1", "2", "3"]), ("default", ["12", "3"])])
def test_gpt2_tokenizer_uses_stored_merges_and_smollm_digit_split(tmp_path, pre, digit_pieces):
    alphabet = _byte_level_alphabet()
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + alphabet + ["Ġh", "Ġhi", "12"]
    types = [CONTROL] * 3 + [NORMAL] * (len(tokens) - 3)
    reader = _write(
        tmp_path / "bpe.gguf",
        "llama",
        dict(model="gpt2", pre=pre, tokens=tokens, types=types, merges=["Ġ h", "Ġh i", "1 2"], bos=1, eos=2, add_bos=False),
    )
    tok, settings = build_tokenizer(reader)
    assert [tok.id_to_token(i) for i in tok.encode("<|im_start|> hi").ids] == ["<|im_start|>", "Ġhi"]
    assert [tok.id_to_token(i) for i in tok.encode("123").ids] == digit_pieces
    assert settings["add_bos_token"] is False and settings["eos_token"] == "<|im_end|>"
    assert tok.decode(tok.encode(" hi 123").ids) == " hi 123"
