"""A tiny random-weight model for every text model type mlx-lm ships.

``CONFIGS[model_type]`` is a tiny config built from that architecture's own ``ModelArgs``
fields (:mod:`harness.models.zoo_configs`); :func:`write_tiny` writes a directory the real
``mlx_lm.load`` reads (config, seeded random weights in the layout ``load`` expects, the byte
tokenizer of :mod:`harness.models.tiny`); :func:`probe` loads one, runs a prompt and a few
decode steps, and reports the caches ``make_prompt_cache`` built.

    python -m harness.models.zoo list [--md FILE] [TYPE ...]
    python -m harness.models.zoo write TYPE DIR
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from harness.models.zoo_configs import BASE, OVERRIDES, SKIP, TEXT_ARGS

# helper modules in mlx_lm/models that are no model type
_HELPERS = {"activations", "base", "bitlinear_layers", "cache", "gated_delta", "mla", "pipeline",
            "rope_utils", "ssm", "switch_layers", "__init__"}

HYBRIDS = ["qwen3_next", "qwen3_5", "qwen3_5_moe", "lfm2", "lfm2_moe", "nemotron_h", "granitemoehybrid",
           "falcon_h1", "jamba", "mamba", "mamba2", "rwkv7", "recurrent_gemma", "plamo2", "kimi_linear",
           "baichuan_m1", "bailing_moe_linear", "bailing_hybrid", "olmo_hybrid", "kimi_k3"]


# non-hybrid types whose caches are worth spelling out: sliding/chunked/shared KV, MLA, CacheList, loops
OTHER_DETAIL = ["gpt_oss", "gemma4_text", "gemma3n", "gemma3_text", "llama4", "deepseek_v3", "kimi_k25",
                "glm4_moe_lite", "deepseek_v32", "glm_moe_dsa", "longcat_flash", "longcat_flash_ngram",
                "minimax_m3_vl", "deepseek_v41", "iquestloopcoder", "nemotron-nas", "afm7", "minimax", "glm4_moe"]


def model_types() -> list[str]:
    """Every model module mlx-lm ships (its file names), helpers left out."""
    import mlx_lm.models as models

    d = Path(models.__file__).parent
    return sorted(p.stem for p in d.glob("*.py") if p.stem not in _HELPERS)


def _module(model_type: str):
    from mlx_lm.utils import MODEL_REMAPPING

    return importlib.import_module(f"mlx_lm.models.{MODEL_REMAPPING.get(model_type, model_type)}")


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def tiny_config(model_type: str) -> dict:
    """BASE kept to the type's ``ModelArgs`` fields, plus its OVERRIDES; ``text_config`` nested."""
    if model_type in SKIP:
        raise ValueError(SKIP[model_type])
    fields = _fields(_module(model_type).ModelArgs)
    cfg = {k: v for k, v in BASE.items() if k in fields}
    if "text_config" in fields:
        cfg.pop("text_config", None)
        spec = TEXT_ARGS.get(model_type)
        if spec:
            mod, cls = spec.split(":")
            text_fields = _fields(getattr(importlib.import_module(f"mlx_lm.models.{mod}"), cls))
        else:
            text_fields = set(BASE)
        cfg["text_config"] = {k: v for k, v in BASE.items() if k in text_fields}
        if spec:
            cfg["text_config"]["model_type"] = spec.split(":")[0]
    cfg = _merge(cfg, OVERRIDES.get(model_type, {}))
    return {"model_type": model_type, **cfg}


def _build_configs() -> dict[str, dict]:
    out = {}
    for mt in model_types():
        try:
            out[mt] = tiny_config(mt)
        except BaseException:  # noqa: BLE001 - a module that will not import (olmo exits)
            continue
    return out


CONFIGS: dict[str, dict] = _build_configs()


def build(model_type: str, seed: int = 0):
    """The real mlx-lm model class on the tiny config, floating matrices drawn N(0, 0.02²) from
    seeded ``mx.random`` (vectors, norms and SSM constants keep the model's own init)."""
    from mlx_lm.utils import _get_classes

    config = CONFIGS[model_type] if model_type in CONFIGS else tiny_config(model_type)
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(seed)  # before construction too: Linear biases draw from mx.random
    model = model_cls(args_cls.from_dict(json.loads(json.dumps(config))))
    new = []
    for k, v in tree_flatten(model.parameters()):
        if mx.issubdtype(v.dtype, mx.floating) and v.ndim >= 2:
            v = (mx.random.normal(v.shape) * 0.02).astype(v.dtype)
        new.append((k, v))
    if model_type in PREPARE:
        new = list(PREPARE[model_type](dict(new)).items())
    model.load_weights(new)
    mx.eval(model.parameters())
    return model, config


def _unit_rows(key):
    """baichuan_m1's ``sanitize`` L2-normalizes ``lm_head`` rows: draw them normalized already."""
    def fn(w):
        v = w[key].astype(mx.float32)
        w[key] = (v / mx.linalg.norm(v, axis=-1, keepdims=True)).astype(w[key].dtype)
        return w
    return fn


# per-type edits of the drawn weights, so they are a fixed point of the model's ``sanitize``
PREPARE = {"baichuan_m1": _unit_rows("lm_head.weight")}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].shape == b[k].shape and a[k].dtype == b[k].dtype and bool(mx.allclose(a[k], b[k], rtol=1e-5, atol=1e-7))
        for k in a)


def saved_weights(model) -> dict:
    """The weights to save: the model's own parameters, in the layout ``mlx_lm.load`` expects after
    ``sanitize``. Every type here passes them through its ``sanitize`` unchanged (``probe`` checks it
    as ``weights_roundtrip``); baichuan_m1, whose ``sanitize`` renormalizes ``lm_head``, draws them
    normalized (:data:`PREPARE`)."""
    return dict(tree_flatten(model.parameters()))


def write_tiny(model_type: str, path, seed: int = 0) -> Path:
    """A directory the real ``mlx_lm.load`` reads: ``config.json``, ``model.safetensors`` and
    the byte tokenizer with :data:`~harness.models.tiny.CHAT_TEMPLATE`.

    Its end-of-turn token is the newline the template closes every message with (byte 10),
    as a real template renders its model's end-of-turn token (ChatML's ``<|im_end|>``): a
    reply that stops there reads back as generated. Byte 255, the in-process models' stop,
    decodes to a replacement character that a reply's own bytes can hold too."""
    from harness.models.tiny import CHAT_TEMPLATE, _byte_to_char, byte_tokenizer

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model, config = build(model_type, seed)
    mx.save_safetensors(str(path / "model.safetensors"), saved_weights(model))
    (path / "config.json").write_text(json.dumps({**config, "eos_token_id": 10}, indent=1))
    hf = byte_tokenizer()._tokenizer
    hf.eos_token = _byte_to_char(10)
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(str(path))
    return path


_KNOWN = {"KVCache", "RotatingKVCache", "ChunkedKVCache", "QuantizedKVCache", "ArraysCache", "CacheList"}


def describe_cache(c) -> dict:
    """Class name; CacheList children; ArraysCache array shapes/dtypes; rotating window size."""
    name = type(c).__name__
    d = {"kind": name}
    if hasattr(c, "caches") and name == "CacheList":
        d["children"] = [describe_cache(x) for x in c.caches]
    elif hasattr(c, "cache") and isinstance(getattr(c, "cache"), list):
        d["arrays"] = [None if a is None else f"{tuple(a.shape)}:{str(a.dtype).split('.')[-1]}" for a in c.cache]
    if getattr(c, "max_size", None) is not None:
        d["max_size"] = c.max_size
    if name not in _KNOWN:  # a model's own cache class (deepseek_v41's LayerCache): its state's shapes
        try:
            d["state"] = [None if a is None else (f"{tuple(a.shape)}:{str(a.dtype).split('.')[-1]}"
                                                  if hasattr(a, "shape") else repr(a)) for a in c.state]
        except Exception:  # noqa: BLE001
            pass
    if getattr(c, "keys", None) is not None and hasattr(c.keys, "shape"):  # KV buffers (MLA: latent dims)
        d["kv"] = [f"{tuple(a.shape)}:{str(a.dtype).split('.')[-1]}" for a in (c.keys, c.values) if a is not None]
        d["offset"] = getattr(c, "offset", None)
    return d


def short(d: dict) -> str:
    s = d["kind"]
    if "children" in d:
        s += "(" + ",".join(short(x) for x in d["children"]) + ")"
    if "arrays" in d:
        s += f"[{len(d['arrays'])}]"
        if any(a is None for a in d["arrays"]):
            s += "!None"
    if "max_size" in d:
        s += f"/{d['max_size']}"
    return s


def _finite(logits) -> bool:
    """No NaN, no +inf, and a finite maximum in every row (-inf is allowed: some models mask ids)."""
    return bool(mx.all(~mx.isnan(logits) & (logits < mx.inf))) and bool(mx.all(mx.isfinite(logits.max(-1))))


def _persist_check(model, cache, logits) -> str:
    """``save_prompt_cache`` then ``load_prompt_cache``: does the reloaded cache give the same next logits?"""
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    try:
        with tempfile.TemporaryDirectory() as tmp:
            f = str(Path(tmp) / "c.safetensors")
            save_prompt_cache(f, cache)
            loaded = load_prompt_cache(f)
        nxt = mx.argmax(logits[:, -1:, :], axis=-1)
        a, b = model(nxt, cache=cache), model(nxt, cache=loaded)
        return "ok" if bool(mx.allclose(a, b, atol=1e-4, rtol=1e-4)) else "logits differ after reload"
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {str(e)[:100]}"


def probe(model_type: str, seed: int = 0, prompt_len: int = 20, decode: int = 3) -> dict:
    """Load through ``mlx_lm.load``, run a ``prompt_len``-token prompt and ``decode`` steps with
    ``make_prompt_cache``, then ``stream_generate`` (what ``mlx_lm.server`` runs)."""
    import mlx_lm
    from mlx_lm.generate import stream_generate
    from mlx_lm.models.cache import make_prompt_cache

    out = {"type": model_type, "ok": False}
    t0 = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            write_tiny(model_type, tmp, seed)
            model, tok = mlx_lm.load(tmp)
        out["loads"] = True
        built, _ = build(model_type, seed)
        out["weights_roundtrip"] = _same(dict(tree_flatten(built.parameters())),
                                         dict(tree_flatten(model.parameters())))
        layers = getattr(model, "layers", None)
        out["n_layers"] = len(layers) if layers is not None else None
        cache = make_prompt_cache(model)
        prompt = mx.array([(7 * i + 3) % 250 for i in range(prompt_len)])[None]
        logits = model(prompt, cache=cache)
        finite = _finite(logits)
        out["masked_neg_inf"] = bool(mx.any(logits == -mx.inf))
        for _ in range(decode):
            nxt = mx.argmax(logits[:, -1:, :], axis=-1)
            logits = model(nxt, cache=cache)
            finite = finite and _finite(logits)
        out["finite"] = finite
        out["logits_shape"] = tuple(logits.shape)
        out["n_caches"] = len(cache)
        out["caches"] = [describe_cache(c) for c in cache]
        out["offset"] = [getattr(c, "offset", None) for c in cache]
        out["persist"] = _persist_check(model, cache, logits)
        try:
            toks = [r.token for r in stream_generate(model, tok, prompt[0].tolist(), max_tokens=4)]
            out["generate"] = f"ok {len(toks)} tok"
        except Exception as e:  # noqa: BLE001
            out["generate"] = f"{type(e).__name__}: {str(e)[:120]}"
        out["ok"] = finite
        if not finite:
            out["err"] = "non-finite logits"
    except BaseException as e:  # noqa: BLE001 - report any failure (SystemExit from olmo too)
        out["err"] = f"{type(e).__name__}: {str(e)[:200]}"
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out


def cache_summary(p: dict) -> str:
    """Distinct cache kinds with counts, e.g. ``ArraysCache[2]x2 KVCache x2``."""
    from collections import Counter

    cnt = Counter(short(c) for c in p.get("caches", []))
    return " ".join(f"{k}x{n}" for k, n in cnt.items())


def table(rows: list[dict]) -> str:
    lines = ["| model type | loads+runs | caches | n caches / n layers | generate | save/load_prompt_cache | note |",
             "|---|---|---|---|---|---|---|"]
    for p in rows:
        note = p.get("err", "")
        if p.get("loads") and not p.get("weights_roundtrip", True):
            note = (note + "; " if note else "") + "weights changed by load"
        lines.append(f"| {p['type']} | {'yes' if p['ok'] else 'NO'} | {cache_summary(p)} | "
                     f"{p.get('n_caches', '-')}/{p.get('n_layers', '-')} | {p.get('generate', '-')} | "
                     f"{p.get('persist', '-').replace('|', '/')} | {note.replace('|', '/')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("list", "write", "probe"):
        print(__doc__)
        return 2
    if argv[0] == "write":
        print(write_tiny(argv[1], argv[2]))
        return 0
    md = None
    if "--md" in argv:
        i = argv.index("--md")
        md = argv[i + 1]
        del argv[i:i + 2]
    types = argv[1:] or model_types()
    rows = []
    for mt in types:
        p = probe(mt)
        rows.append(p)
        if argv[0] == "probe":
            print(json.dumps(p, default=str))
        else:
            print(f"{mt:24s} {'ok' if p['ok'] else 'FAIL':4s} {cache_summary(p)[:70]:70s} "
                  f"{p.get('n_caches', '-')}/{p.get('n_layers', '-')} {p.get('err', '')[:100]}", flush=True)
    if md:
        Path(md).write_text(summary(rows) + "\n\n" + table(rows) + "\n\n" + hybrid_details(rows) + "\n")
    return 0


def hybrid_details(rows: list[dict]) -> str:
    """Per-cache detail for the hybrid / recurrent types: class, ArraysCache array shapes after the prompt."""
    out = ["## Cache detail (hybrids first): after a 20-token prompt and 3 decode steps", "",
           "ArraysCache arrays are listed as shape:dtype (batch 1); `None` = an entry never written.", ""]
    by = {p["type"]: p for p in rows}
    for mt in HYBRIDS + OTHER_DETAIL:
        p = by.get(mt)
        if p is None:
            continue
        out.append(f"- **{mt}** ({p.get('n_caches', '-')} caches / {p.get('n_layers', '-')} layers)"
                   + ("" if p["ok"] else f": FAIL {p.get('err')}"))
        for i, c in enumerate(p.get("caches", [])):
            out.append(f"  - [{i}] {_detail(c)}")
    return "\n".join(out)


def _detail(d: dict) -> str:
    s = d["kind"]
    if "children" in d:
        s += "(" + ", ".join(_detail(x) for x in d["children"]) + ")"
    if "arrays" in d:
        s += "[" + ", ".join(str(a) for a in d["arrays"]) + "]"
    if "max_size" in d:
        s += f" max_size={d['max_size']}"
    if "state" in d:
        s += " state " + str(d["state"])
    if "kv" in d:
        s += f" keys/values {' '.join(d['kv'])} offset={d['offset']}"
    return s


def summary(rows: list[dict]) -> str:
    ok = [p for p in rows if p["ok"]]
    bad = [p for p in rows if not p["ok"]]
    gen_bad = [p for p in ok if not p.get("generate", "").startswith("ok")]
    persist_bad = [p for p in ok if p.get("persist") != "ok"]
    out = [f"# mlx-lm model zoo probe (mlx-lm {_mlx_lm_version()})", "",
           f"- types: {len(rows)}", f"- load and run with finite logits: {len(ok)}",
           f"- fail: {len(bad)}", f"- run but stream_generate fails: {len(gen_bad)}",
           f"- run but save_prompt_cache/load_prompt_cache round trip fails: {len(persist_bad)}", ""]
    for p in bad:
        out.append(f"- FAIL {p['type']}: {p.get('err', '?')}")
    for p in gen_bad:
        out.append(f"- GENERATE {p['type']}: {p.get('generate')}")
    for p in persist_bad:
        out.append(f"- PERSIST {p['type']}: {p.get('persist')}")
    out += ["", "Cache-layout traps (found by this probe):", ""]
    mismatch = [f"{p['type']} {p['n_caches']}/{p['n_layers']}" for p in ok
                if p.get("n_layers") is not None and p["n_caches"] != p["n_layers"]]
    out.append("- caches != layers: " + ", ".join(mismatch))
    no_off = [p["type"] for p in ok if p.get("offset") and p["offset"][0] is None]
    out.append("- cache[0] has no `offset` (ArraysCache / CacheList first): " + ", ".join(no_off))
    own = sorted({f"{p['type']} ({c['kind']})" for p in ok for c in p["caches"] if c["kind"] not in _KNOWN})
    out.append("- a model-own cache class, not from mlx_lm.models.cache: " + ", ".join(own))
    neg = [p["type"] for p in ok if p.get("masked_neg_inf")]
    out.append("- logits with -inf entries (masked ids): " + ", ".join(neg))
    return "\n".join(out)


def _mlx_lm_version() -> str:
    import mlx_lm

    return getattr(mlx_lm, "__version__", "?")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
