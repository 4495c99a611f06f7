"""The one place that knows how mlx-lm versions differ.

Supported: mlx-lm 0.30.4 (the oldest this project pins) and 0.32.x. Differences are
detected by feature, not by version string:

    |                          | 0.30.4                       | 0.32.x                         |
    |--------------------------|------------------------------|--------------------------------|
    | KVCache.state            | (k, v) sliced to offset      | (k, v, offset), full buffer    |
    | meta_state / from_state  | strings / (state, meta)      | none / (state)                 |
    | presence/frequency pen.  | not in make_logits_processors| make_logits_processors         |
    | model path of a hub id   | utils._download              | utils._download                |
    | recurrent state          | ArraysCache, MambaCache(2)   | ArraysCache (state + padding)  |
    | ChunkedKVCache trim      | by buffer size (broken)      | by tokens held                 |
    | recurrent row lengths    | ArraysCache.lengths; mask    | ArraysCache.lengths; mask      |
    |                          | ignores them under left pad  | takes both                     |
    | Mamba-2 scan and lengths | ignored (falcon_h1, mamba2,  | honoured (nemotron_h: never;   |
    |                          | granitemoehybrid, plamo2)    | batchprobe.replay_problem asks)|

Everything above this module speaks :class:`LayerState`, which is the same
under both versions.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from importlib.metadata import version as _dist_version
from typing import Any, Sequence

import mlx.core as mx
from mlx_lm import sample_utils as _sample_utils
from mlx_lm.models import cache as C

from semantic.errors import UnsupportedCacheError

MLX_VERSION = _dist_version("mlx")
MLX_LM_VERSION = _dist_version("mlx-lm")

# 0.30.4 caches carry string meta_state beside state; 0.32 folds it into state.
HAS_META_STATE = hasattr(C._BaseCache, "meta_state")

KV, ROTATING, QUANTIZED = "KVCache", "RotatingKVCache", "QuantizedKVCache"
ARRAYS = "ArraysCache"  # recurrent state: n arrays, no token axis (read_arrays / build_arrays)
CHUNKED = "ChunkedKVCache"  # llama4's chunked attention: ``idx`` is its start_position
# 0.30.4's ChunkedKVCache trims by its buffer's size, zero padding included, and breaks on a chunked
# prefill (its own generate_step too); the fix trims by the tokens it holds
CHUNKED_TRIMS_TOKENS = "self.offset - self.start_position" in inspect.getsource(C.ChunkedKVCache.maybe_trim_front)


@dataclass(slots=True)
class LayerState:
    """One layer's cache in version-independent form.

    ``keys``/``values`` hold only the valid part of the buffer, in buffer
    order: ``[..., :offset, :]`` for KVCache and QuantizedKVCache (each a
    tuple ``(packed, scales, biases)`` there), and ``[..., :min(len, offset), :]``
    for RotatingKVCache, whose ring order is given by ``idx`` and ``keep``.
    """

    kind: str
    keys: Any
    values: Any
    offset: int
    keep: int = 0
    max_size: int | None = None
    idx: int = 0
    group_size: int | None = None
    bits: int | None = None

    def __post_init__(self):
        if self.kind not in (KV, ROTATING, QUANTIZED, CHUNKED):
            raise UnsupportedCacheError(f"unknown cache kind {self.kind!r}")
        if self.offset < 0:
            raise ValueError(f"offset must be >= 0, got {self.offset}")
        if self.kind == ROTATING and (self.max_size is None or self.max_size <= 0):
            raise ValueError("RotatingKVCache state needs a positive max_size")
        if self.kind == QUANTIZED and (self.group_size is None or self.bits is None):
            raise ValueError("QuantizedKVCache state needs group_size and bits")


def _trim(x, n: int):
    if isinstance(x, (tuple, list)):
        return tuple(a[..., :n, :] for a in x)
    return x[..., :n, :]


def _buffer_len(x) -> int:
    return (x[0] if isinstance(x, (tuple, list)) else x).shape[2]


def read_layer(cache: Any) -> LayerState:
    """Read a live mlx-lm cache object without copying its arrays."""
    kind = type(cache).__name__
    if kind not in (KV, ROTATING, QUANTIZED, CHUNKED):
        raise UnsupportedCacheError(f"cannot extract a {kind}; supported: {KV}, {ROTATING}, {QUANTIZED}, {CHUNKED}")
    if cache.keys is None:
        return LayerState(kind, None, None, 0, **_meta(cache, kind, idx=0))
    if kind == CHUNKED:  # the buffer holds [start_position, offset) from its front
        valid = cache.offset - cache.start_position
        return LayerState(kind, _trim(cache.keys, valid), _trim(cache.values, valid), int(cache.offset),
                          max_size=int(cache.chunk_size), idx=int(cache.start_position))
    # Attributes are named alike in both versions; state differs, so read attributes.
    valid = cache.offset if kind != ROTATING else min(_buffer_len(cache.keys), cache.offset)
    return LayerState(
        kind,
        _trim(cache.keys, valid),
        _trim(cache.values, valid),
        int(cache.offset),
        **_meta(cache, kind, idx=int(getattr(cache, "_idx", 0))),
    )


def read_arrays(cache: Any) -> tuple:
    """A live ``ArraysCache``'s arrays, each a new array object: a layer that later
    writes into its cache's arrays in place never changes what was read. Only the
    arrays are read: ``left_padding``/``lengths`` are a batch's bookkeeping, and the
    ``state`` property's layout differs between versions."""
    if not is_arrays(cache):
        raise UnsupportedCacheError(f"not an {ARRAYS}: {type(cache).__name__}")
    if any(a is None for a in cache.cache):
        missing = [i for i, a in enumerate(cache.cache) if a is None]
        raise UnsupportedCacheError(f"{ARRAYS} arrays {missing} are unset after a prompt: no state to keep")
    if not all(isinstance(a, mx.array) for a in cache.cache):  # 0.30.4's kimi_linear nests tuples there
        odd = [f"{i}: {type(a).__name__}" for i, a in enumerate(cache.cache) if not isinstance(a, mx.array)]
        raise UnsupportedCacheError(f"{ARRAYS} entries {odd} are not arrays: this mlx-lm's layout of the state "
                                    f"has no fixed form to store (mlx-lm 0.32 keeps arrays)")
    return tuple(mx.contiguous(a[...]) for a in cache.cache)


def is_arrays(cache: Any) -> bool:
    """Whether ``cache`` is a recurrent state (0.30.4's ``MambaCache`` is an ``ArraysCache`` too)."""
    return isinstance(cache, C.ArraysCache)


def new_arrays(n: int) -> Any:
    """An empty recurrent cache of ``n`` arrays, of the class the models of this mlx-lm make:
    0.30.4's Mamba-style layers test for ``MambaCache`` (two arrays), 0.32 has only ``ArraysCache``."""
    mamba = getattr(C, "MambaCache", None)
    return mamba() if mamba is not None and n == 2 else C.ArraysCache(n)


def build_arrays(arrays: Sequence) -> Any:
    """A fresh recurrent cache holding new array objects over ``arrays`` (never the
    caller's own: a stored snapshot stays as it was while the cache runs on)."""
    cache = new_arrays(len(arrays))
    cache.cache = [a[...] for a in arrays]
    return cache


def live_arrays(cache: Any) -> list:
    """A batch recurrent cache's arrays themselves, not copies: a kept reference stays as it was, since the
    models of both versions assign new arrays to a cache's slots and never write into the old ones."""
    assert all(a is not None for a in cache.cache), "a batch recurrent cache is set by its rows' prefill"
    return list(cache.cache)


def set_live_arrays(cache: Any, arrays: Sequence) -> None:
    cache.cache = list(arrays)


def limit_rows(cache: Any, lengths: Sequence[int] | None) -> None:
    """Let the next forward pass move row ``i`` of a recurrent cache by its first ``lengths[i]`` inputs only
    (None: by all). mlx-lm's own right padding, ``ArraysCache.lengths``, in both versions; the layers
    count it down as they run, so it is set before every pass that needs it and cleared after. 0.30.4's
    mask reads it only while ``left_padding`` is None, which a prefilled row's cache always is."""
    assert lengths is None or cache.left_padding is None, "lengths mask right padding of prefilled rows"
    cache.lengths = None if lengths is None else mx.array(list(lengths))


def flatten(caches: Sequence) -> tuple[list, tuple[int, ...]]:
    """A model's caches as leaves, and their nesting (``ModelCacheSpec.nesting``: () when flat)."""
    leaves, nesting = [], []
    for c in caches:
        if isinstance(c, C.CacheList):
            kids, inner = flatten(c.caches)
            if any(inner):
                raise UnsupportedCacheError("a CacheList inside a CacheList")
            leaves.extend(kids)
            nesting.append(len(kids))
        else:
            leaves.append(c)
            nesting.append(0)
    return leaves, tuple(nesting) if any(nesting) else ()


def nest(leaves: Sequence, nesting: Sequence[int]) -> list:
    """The model's cache list from its leaves (the inverse of :func:`flatten`)."""
    if not nesting:
        return list(leaves)
    out, i = [], 0
    for k in nesting:
        out.append(C.CacheList(*leaves[i : i + k]) if k else leaves[i])
        i += max(k, 1)
    assert i == len(leaves), (i, len(leaves))
    return out


def cache_offset(caches: Sequence) -> int | None:
    """How many tokens a model's caches hold, from its first positional layer (None: all are recurrent)."""
    for c in flatten(caches)[0]:
        if not is_arrays(c):
            return int(c.offset) if not isinstance(c.offset, mx.array) else int(c.offset.item())
    return None


def _meta(cache, kind: str, idx: int) -> dict:
    if kind == CHUNKED:
        return {"max_size": int(cache.chunk_size), "idx": idx}
    if kind == ROTATING:
        return {"keep": int(cache.keep), "max_size": int(cache.max_size), "idx": idx}
    if kind == QUANTIZED:
        return {"group_size": int(cache.group_size), "bits": int(cache.bits)}
    return {}


def build_layer(state: LayerState) -> Any:
    """Rebuild the real mlx-lm cache object through its ``from_state``."""
    cls = getattr(C, state.kind)
    if state.kind == CHUNKED:
        obj = cls(state.max_size)
        if state.keys is not None:  # attributes alike in both versions; the state tuple is not
            obj.keys, obj.values = _new_object(state.keys), _new_object(state.values)
            obj.offset, obj.start_position = state.offset, state.idx
        return obj
    if state.keys is None:
        if state.kind == ROTATING:
            return cls(max_size=state.max_size, keep=state.keep)
        if state.kind == QUANTIZED:
            return cls(group_size=state.group_size, bits=state.bits)
        return cls()
    # new array objects over the same data: a cache writes into its buffers in place (a full
    # rotating window, from its first decode), which must never reach the arrays a block holds
    k, v = _new_object(state.keys), _new_object(state.values)
    if state.kind == QUANTIZED:
        k, v = tuple(k), tuple(v)
    if HAS_META_STATE:
        meta = {
            KV: "",
            ROTATING: (state.keep, state.max_size, state.offset, state.idx),
            QUANTIZED: (state.offset, state.group_size, state.bits),
        }[state.kind]
        obj = cls.from_state((k, v), tuple(map(str, meta)) if meta else meta)
    else:
        full = {
            KV: (k, v, state.offset),
            ROTATING: (k, v, state.offset, state.keep, state.max_size, state.idx),
            QUANTIZED: (k, v, state.offset, state.group_size, state.bits),
        }[state.kind]
        obj = cls.from_state(full)
    if state.kind == KV:
        obj.offset = state.offset  # 0.30.4's setter derives it from the shape
    return obj


def _new_object(x):
    return tuple(p[...] for p in x) if isinstance(x, (tuple, list)) else x[...]


def temporal_rotating(state: LayerState, cut: bool = True) -> LayerState:
    """The same rotating cache, unrolled into temporal order and cut to the window (with ``cut``
    False, not cut: what a multi-token call left beyond the window too).

    A RotatingKVCache buffer is a ring: ``keep`` pinned slots, then slots that
    are overwritten in turn at ``idx``. After a long multi-token prefill the
    buffer can also be longer than ``max_size`` (mlx-lm trims it lazily)::

        ring (offset > len):   [ k0 k1 | t6 t7 t8 t3 t4 t5 ]   keep=2, idx=5
                                 pinned   newer ^idx older
        temporal:              [ k0 k1 | t3 t4 t5 t6 t7 t8 ]   idx = len = 8

    The unrolled form keeps ``keep`` pinned tokens plus the newest
    ``max_size - keep``; the next update sees exactly the same tokens either
    way. mlx-lm 0.30.4 can only batch this form: its BatchRotatingKVCache.merge
    fails on an over-long buffer, so every rebuilt rotating cache uses it.
    """
    assert state.kind == ROTATING, state.kind
    if state.keys is None:
        return state
    keep, idx, n = state.keep, state.idx, _buffer_len(state.keys)

    def unroll(x):
        if idx == n:
            order = x
        elif idx < state.offset:
            order = mx.concatenate([x[..., :keep, :], x[..., idx:, :], x[..., keep:idx, :]], axis=2)
        else:
            order = x[..., :idx, :]
        if cut and order.shape[2] > state.max_size:
            tail = order.shape[2] - (state.max_size - keep)
            order = mx.concatenate([order[..., :keep, :], order[..., tail:, :]], axis=2)
        return order

    keys, values = unroll(state.keys), unroll(state.values)
    return LayerState(ROTATING, keys, values, state.offset, keep, state.max_size, keys.shape[2])


def _rotating_extract_clamped(self, idx):
    """BatchRotatingKVCache.extract of mlx-lm 0.30.4, with one fix.

    Upstream slices ``keys[:, :, padding:_idx]``, but once the ring rotates
    ``left_padding`` keeps decreasing below zero, and a negative start slices
    from the end: a finished sequence keeps only its newest few tokens of
    the window. Clamping the padding at zero keeps the whole window; this is
    the fix mlx-lm 0.32 ships (`max(0, left_padding)`), backported.
    """
    cache = C.RotatingKVCache(self.max_size)
    padding = max(0, self.left_padding[idx].item())
    cache.keys = self.keys[idx : idx + 1]
    cache.values = self.values[idx : idx + 1]
    cache._idx = self._idx
    if self.rotated:
        cache.keys = mx.roll(cache.keys, -self._idx, axis=2)
        cache.values = mx.roll(cache.values, -self._idx, axis=2)
        cache._idx = self.max_size
    cache.keys = mx.contiguous(cache.keys[:, :, padding : cache._idx])
    cache.values = mx.contiguous(cache.values[:, :, padding : cache._idx])
    cache.offset = self.offset[idx].item()
    cache._idx = cache.keys.shape[2]
    return cache


if HAS_META_STATE and hasattr(C, "BatchRotatingKVCache"):
    C.BatchRotatingKVCache.extract = _rotating_extract_clamped

# ---------------------------------------------------------------- batching (semantic.runner.steploop)


def cache_arrays(cache: Any) -> list:
    """The arrays a live cache holds (what to ``mx.eval`` after a forward pass)."""
    if isinstance(cache, C.CacheList):
        return [a for c in cache.caches for a in cache_arrays(c)]
    if is_arrays(cache):
        return [a for a in cache.cache if a is not None]
    out = []
    for x in (cache.keys, cache.values):
        if x is not None:
            out.extend(x if isinstance(x, (tuple, list)) else [x])
    return out


def _quantized_sdpa_batched_mask(queries, q_keys, q_values, scale, mask, group_size=64, bits=8):
    """0.30.4's quantized attention, with 0.32's fix for a per-row (batched) mask.

    With grouped-query attention the scores gain a repeat axis; 0.30.4 does not
    give the mask one, so a ``(B, 1, N, S)`` mask of a batch broadcasts
    against the wrong axes. 0.32 adds it (``expand_dims(mask, -3)``); backported.
    """
    n_repeats = queries.shape[1] // q_keys[0].shape[-3]
    if mask is not None and not isinstance(mask, str) and n_repeats > 1 and mask.ndim > 3:
        mask = mx.expand_dims(mask, -3)
    return _QSDPA_0304(queries, q_keys, q_values, scale=scale, mask=mask, group_size=group_size, bits=bits)


from mlx_lm.models import base as _base  # noqa: E402

if "expand_dims(mask, -3)" not in inspect.getsource(_base.quantized_scaled_dot_product_attention):
    _QSDPA_0304 = _base.quantized_scaled_dot_product_attention
    _base.quantized_scaled_dot_product_attention = _quantized_sdpa_batched_mask


# ---------------------------------------------------------------- loading


def tool_parser_names() -> list[str]:
    """The tool-call formats this mlx-lm can parse (``mlx_lm.tool_parsers`` modules; 0.30.4 has fewer)."""
    import pkgutil

    import mlx_lm.tool_parsers

    return sorted(m.name for m in pkgutil.iter_modules(mlx_lm.tool_parsers.__path__))


def load(path, tokenizer=None):
    """``mlx_lm.load``, or, given the tokenizer an earlier load of the same directory made, its weights only
    (the tokenizer is most of a small model's load: 3.6 s of Gemma 3 270M's 4.8 s here). Both versions
    split ``load`` into ``load_model`` and ``load_tokenizer``."""
    import mlx_lm
    from mlx_lm import utils

    if tokenizer is None:
        model, tokenizer = mlx_lm.load(str(path))
    else:
        model, _ = utils.load_model(path)
    _evaluate_constants(model)
    return model, tokenizer


def _evaluate_constants(model) -> None:
    """Evaluate the arrays a model keeps outside its parameters (bailing_moe_linear's ``_slope``, computed
    lazily in ``__init__``): left lazy, their graph names the loading thread's stream, and the first step on
    the scheduler's thread fails with "There is no Stream(cpu, 0) in current thread"."""
    import mlx.core as mx

    # a module is a dict: private arrays sit among its items, outside ``parameters()``
    arrays = [v for m in model.modules() for v in (*vars(m).values(), *m.values()) if isinstance(v, mx.array)]
    if arrays:
        mx.eval(arrays)


def check_model_dir(path) -> None:
    """What ``mlx_lm.load`` would refuse in a local model directory's config, found without loading it
    (both versions map a config to its module with ``_get_classes``). Raises ValueError saying what."""
    import json

    from mlx_lm import utils

    config = path / "config.json"
    try:
        doc = json.loads(config.read_text())
    except OSError:
        raise ValueError(f"{path} has no readable config.json: not a model directory") from None
    except ValueError as exc:
        raise ValueError(f"{config} is not JSON ({exc})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("model_type"), str):
        raise ValueError(f"{config} names no model_type")
    utils._get_classes(doc)  # "Model type X not supported."


def model_path(path_or_repo: str):
    """The local directory ``mlx_lm.load`` reads for a path or hub id (both versions name it ``_download``)."""
    from pathlib import Path

    from mlx_lm import utils

    p = Path(path_or_repo).expanduser()
    return p if p.is_dir() else Path(utils._download(path_or_repo))


# ---------------------------------------------------------------- sampling

_LP_PARAMS = inspect.signature(_sample_utils.make_logits_processors).parameters
# 0.30.4's make_logits_processors has only logit_bias and repetition_penalty.
HAS_ADDITIVE_PENALTIES = "presence_penalty" in _LP_PARAMS


def make_logits_processors(
    repetition_penalty: float | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    context_size: int = 20,
) -> list:
    """mlx-lm's penalty processors; under 0.30.4 the additive two are built here
    as 0.32 builds them (subtract the penalty per occurrence in the context)."""
    if HAS_ADDITIVE_PENALTIES:
        return _sample_utils.make_logits_processors(
            repetition_penalty=repetition_penalty, repetition_context_size=context_size,
            presence_penalty=presence_penalty, presence_context_size=context_size,
            frequency_penalty=frequency_penalty, frequency_context_size=context_size,
        )
    out = _sample_utils.make_logits_processors(
        repetition_penalty=repetition_penalty, repetition_context_size=context_size
    )
    if presence_penalty:
        def presence(tokens, logits, p=presence_penalty):
            if len(tokens) > 0:
                logits[:, tokens[-context_size:]] -= p
            return logits
        out.append(presence)
    if frequency_penalty:
        def frequency(tokens, logits, p=frequency_penalty):
            if len(tokens) > 0:
                logits = logits.at[:, tokens[-context_size:]].subtract(p)
            return logits
        out.append(frequency)
    return out
