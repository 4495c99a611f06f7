"""What a model's KV cache looks like, layer by layer, with or without its weights.

:class:`LayerSpec` is the one home of what a layer kind means: which mlx-lm
cache class holds it, which token positions it holds after ``T`` tokens,
and how a rebuilt cache of it is described to ``compat``. A new cache type
is added here (and in ``compat``, which builds it)::

    kind       cache class                         holds after T tokens
    global     KVCache (QuantizedKVCache: kv_bits)  [0, T)
    sliding    RotatingKVCache(window, keep)        [0, keep) + [T - (window - keep), T), all while T <= window
    recurrent  ArraysCache(n)                       n fixed-size arrays that summarise [0, T)

A recurrent layer, and a sliding one whose window is shorter than a block,
can resume only where its cache was snapshotted (:meth:`LayerSpec.snapshot_only`):
nothing in a later cache tells what it held at an earlier position.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as C

from semantic import compat
from semantic.errors import CacheMismatchError, UnsupportedCacheError

GLOBAL, SLIDING, RECURRENT = "global", "sliding", "recurrent"
_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """One layer's cache: global (``KVCache``, or ``QuantizedKVCache`` when
    ``kv_bits`` is set) or sliding (``RotatingKVCache`` of ``window`` tokens,
    the first ``keep`` pinned)."""

    kind: str
    n_kv_heads: int
    head_dim: int
    v_head_dim: int
    dtype: str
    window: int | None = None
    keep: int = 0
    kv_bits: int | None = None
    kv_group_size: int | None = None
    arrays: tuple[tuple[tuple[int, ...], str], ...] = ()  # recurrent: each array's (shape without batch, dtype)

    def __post_init__(self):
        if self.kind not in (GLOBAL, SLIDING, RECURRENT):
            raise ValueError(f"layer kind must be {GLOBAL!r}, {SLIDING!r} or {RECURRENT!r}, got {self.kind!r}")
        if self.kind == RECURRENT:
            self._check_recurrent()
            return
        if self.arrays:
            raise ValueError("only a recurrent layer has state arrays")
        object.__setattr__(self, "arrays", ())  # a list from JSON compares unequal to ()
        # values may be zero-wide (deepseek_v32's indexer cache keeps keys only)
        if min(self.n_kv_heads, self.head_dim) <= 0 or self.v_head_dim < 0:
            raise ValueError(f"heads and head dims must be positive: {self}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.kind == SLIDING:
            if not self.window or self.window <= 0:
                raise ValueError("a sliding layer needs a positive window")
            if not 0 <= self.keep < self.window:
                raise ValueError(f"keep must be in [0, window), got {self.keep}")
            if self.kv_bits is not None:
                raise UnsupportedCacheError("mlx-lm cannot quantize a RotatingKVCache (sliding layer)")
        elif self.window is not None or self.keep:
            raise ValueError("a global layer has no window or keep")
        if (self.kv_bits is None) != (self.kv_group_size is None):
            raise ValueError("kv_bits and kv_group_size go together")
        if self.kv_bits is not None:
            if self.kv_bits not in (2, 3, 4, 5, 6, 8) or self.kv_group_size not in (32, 64, 128):
                raise ValueError(f"unsupported KV quantization {self.kv_bits} bits / group {self.kv_group_size}")
            if self.head_dim % self.kv_group_size or self.v_head_dim % self.kv_group_size:
                raise ValueError(f"head_dim {self.head_dim} is not a multiple of group {self.kv_group_size}")

    def _check_recurrent(self) -> None:
        try:
            arrays = tuple((tuple(int(d) for d in shape), str(dtype)) for shape, dtype in self.arrays)
        except (TypeError, ValueError):
            raise ValueError(f"a recurrent layer's arrays are (shape, dtype) pairs, got {self.arrays!r}") from None
        object.__setattr__(self, "arrays", arrays)
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if not arrays or any(min(shape, default=1) <= 0 or dt not in _DTYPES for shape, dt in arrays):
            raise ValueError(f"a recurrent layer needs arrays of positive shape and known dtype, got {arrays}")
        if self.window is not None or self.keep or self.kv_bits is not None or self.kv_group_size is not None:
            raise ValueError("a recurrent layer has no window, keep or KV quantization")

    def to_dict(self) -> dict:
        """The layer as JSON data; ``arrays`` only for a recurrent layer, so the files and
        fingerprints of the other kinds read as they did before it existed."""
        out = asdict(self)
        if not self.arrays:
            del out["arrays"]
        return out

    def snapshot_only(self, block_tokens: int) -> bool:
        """Whether this layer resumes only at positions where its whole cache was kept (a
        snapshot): a recurrent layer, or a window shorter than a block, which no stored
        block of other positions can rebuild."""
        return self.kind == RECURRENT or (self.kind == SLIDING and self.window - self.keep < block_tokens)

    @property
    def cache_kind(self) -> str:
        """The mlx-lm class name of this layer's cache."""
        if self.kind == RECURRENT:
            return compat.ARRAYS
        if self.kind == SLIDING:
            return compat.ROTATING
        return compat.QUANTIZED if self.kv_bits else compat.KV

    @property
    def windowed(self) -> bool:
        """Whether the cache forgets old tokens (a sliding window)."""
        return self.kind == SLIDING

    def held_ranges(self, total: int) -> list[tuple[int, int]]:
        """Token positions this layer's cache holds after ``total`` tokens (a recurrent
        layer: the last one, where its state stands)."""
        if self.kind == RECURRENT:
            return [(total - 1, total)] if total else []
        if self.kind == GLOBAL or total <= self.window:
            return [(0, total)] if total else []
        keep = [(0, self.keep)] if self.keep else []
        return keep + [(total - (self.window - self.keep), total)]

    def tokens_held(self, total: int) -> int:
        """How many tokens this layer's cache holds after ``total`` tokens."""
        return sum(b - a for a, b in self.held_ranges(total))

    def ring_index(self, held: int) -> int | None:
        """The write index of a rebuilt rotating cache holding ``held`` tokens (None for others).

        Rebuilt rings are unrolled into temporal order, so the next write goes after the newest token.
        """
        return held if self.kind == SLIDING else None

    def cache_state(self, keys, values, total: int, held: int) -> compat.LayerState:
        """What ``compat.build_layer`` needs to rebuild this layer's cache after ``total``
        tokens from its ``held`` tokens (``keys``/``values`` in temporal order)."""
        if self.kind == SLIDING:
            return compat.LayerState(compat.ROTATING, keys, values, total, self.keep, self.window, idx=held)
        kind = compat.QUANTIZED if self.kv_bits else compat.KV
        return compat.LayerState(kind, keys, values, total, group_size=self.kv_group_size, bits=self.kv_bits)

    @property
    def group(self) -> str:
        """Layers with the same group share block boundaries and token coverage."""
        if self.kind == RECURRENT:
            return RECURRENT
        if self.kind == SLIDING:
            return f"sliding-w{self.window}-k{self.keep}"
        return f"global-q{self.kv_bits}g{self.kv_group_size}" if self.kv_bits else "global"

    @property
    def mx_dtype(self):
        return _DTYPES[self.dtype]

    def state_bytes(self) -> int:
        """Bytes of a recurrent layer's arrays (0 for the others: they grow per token)."""
        return sum(math.prod(shape) * _DTYPES[dt].size for shape, dt in self.arrays)

    def token_bytes(self) -> float:
        """Bytes of K plus V per cached token (quantized: packed + scales + biases; recurrent: 0)."""
        if self.kind == RECURRENT:
            return 0.0
        width = self.mx_dtype.size
        if not self.kv_bits:
            return self.n_kv_heads * (self.head_dim + self.v_head_dim) * width
        per = lambda d: d * self.kv_bits / 8 + 2 * (d // self.kv_group_size) * width  # noqa: E731
        return self.n_kv_heads * (per(self.head_dim) + per(self.v_head_dim))

    def make_cache(self):
        if self.kind == RECURRENT:
            return compat.new_arrays(len(self.arrays))
        if self.kind == SLIDING:
            return C.RotatingKVCache(max_size=self.window, keep=self.keep)
        if self.kv_bits:
            return C.QuantizedKVCache(group_size=self.kv_group_size, bits=self.kv_bits)
        return C.KVCache()


@dataclass(frozen=True, slots=True)
class ModelCacheSpec:
    """The per-layer cache geometry of one model (see :class:`LayerSpec`).

    ``layers`` are the leaf caches. A model whose cache list nests (mlx-lm's
    ``CacheList``: falcon_h1's recurrent state beside its attention in one
    layer, deepseek_v32's latent and indexer caches) says how in ``nesting``,
    one entry per model cache: 0 a leaf, ``k`` a ``CacheList`` of the next ``k``::

        model caches   [ CacheList(Arrays, KV), CacheList(Arrays, KV) ]
        nesting        (2, 2)
        layers         [ recurrent, global, recurrent, global ]
    """

    layers: tuple[LayerSpec, ...]
    nesting: tuple[int, ...] = ()  # () : every model cache is one leaf

    def __post_init__(self):
        if not self.layers:
            raise ValueError("a cache spec needs at least one layer")
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "nesting", tuple(int(k) for k in self.nesting))
        if self.nesting and (sum(max(k, 1) for k in self.nesting) != len(self.layers) or min(self.nesting) < 0):
            raise ValueError(f"nesting {self.nesting} does not cover {len(self.layers)} layers")

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def _uniform(self, field: str):
        values = {getattr(l, field) for l in self.layers}
        if len(values) != 1:
            raise ValueError(f"layers differ in {field}: {sorted(values)}")
        return values.pop()

    @property
    def n_kv_heads(self) -> int:
        return self._uniform("n_kv_heads")

    @property
    def head_dim(self) -> int:
        return self._uniform("head_dim")

    @property
    def dtype(self) -> str:
        return self._uniform("dtype")

    @property
    def quantized(self) -> bool:
        return any(l.kv_bits for l in self.layers)

    def groups(self) -> dict[str, tuple[int, ...]]:
        """Layer indices per group, in first-seen order."""
        out: dict[str, list[int]] = {}
        for i, l in enumerate(self.layers):
            out.setdefault(l.group, []).append(i)
        return {g: tuple(ix) for g, ix in out.items()}

    def make_cache(self) -> list:
        """Fresh, empty mlx-lm cache objects, one per layer."""
        return compat.nest([l.make_cache() for l in self.layers], self.nesting)

    def token_bytes(self) -> float:
        return sum(l.token_bytes() for l in self.layers)

    def state_bytes(self) -> int:
        """Bytes of one snapshot of every recurrent layer."""
        return sum(l.state_bytes() for l in self.layers)

    @property
    def recurrent(self) -> bool:
        return any(l.kind == RECURRENT for l in self.layers)

    def to_dict(self) -> dict:
        out = {"layers": [l.to_dict() for l in self.layers]}
        if self.nesting:  # only when there is any, so flat specs read and hash as before
            out["nesting"] = list(self.nesting)
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "ModelCacheSpec":
        try:
            return cls(tuple(LayerSpec(**l) for l in data["layers"]), tuple(data.get("nesting", ())))
        except (KeyError, TypeError) as exc:
            raise CacheMismatchError(f"not a cache spec: {exc}") from exc

    def fingerprint(self) -> str:
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def require_same(self, other: "ModelCacheSpec", what: str = "cache") -> None:
        """Raise :class:`CacheMismatchError` unless ``other`` is this spec."""
        if other != self:
            diff = next(
                (f"layer {i}: {a} != {b}" for i, (a, b) in enumerate(zip(self.layers, other.layers)) if a != b),
                f"{other.n_layers} layers != {self.n_layers}",
            )
            raise CacheMismatchError(f"{what} was built for another cache spec ({diff})")

    @classmethod
    def from_model(cls, model, kv_bits: int | None = None, kv_group_size: int = 64) -> "ModelCacheSpec":
        """Read the geometry from a loaded model with a one-token probe.

        ``kv_bits`` makes the global layers ``QuantizedKVCache`` (mlx-lm cannot
        quantize sliding layers).
        """
        caches = model.make_cache() if hasattr(model, "make_cache") else [C.KVCache() for _ in model.layers]
        mx.eval(model(mx.array([[0]]), cache=caches))
        caches, nesting = compat.flatten(caches)
        layers = []
        for c in caches:
            if compat.is_arrays(c):
                arrays = compat.read_arrays(c)
                dims = tuple((tuple(a.shape[1:]), _dtype_name(a.dtype)) for a in arrays)
                layers.append(LayerSpec(RECURRENT, 0, 0, 0, _dtype_name(arrays[0].dtype), arrays=dims))
                continue
            st = compat.read_layer(c)
            _, heads, _, dim = st.keys.shape
            common = dict(n_kv_heads=heads, head_dim=dim, v_head_dim=st.values.shape[-1], dtype=_dtype_name(st.keys.dtype))
            if st.kind == compat.ROTATING:
                layers.append(LayerSpec(SLIDING, window=st.max_size, keep=st.keep, **common))
            elif st.kind == compat.KV:
                q = dict(kv_bits=kv_bits, kv_group_size=kv_group_size) if kv_bits else {}
                layers.append(LayerSpec(GLOBAL, **common, **q))
            else:
                raise UnsupportedCacheError(f"unexpected {st.kind} from make_cache")
        return cls(tuple(layers), nesting)

    @classmethod
    def from_config(cls, config: dict[str, Any], dtype: str | None = None) -> "ModelCacheSpec":
        """Geometry from a Hugging Face / mlx-lm config alone, without weights.

        Sliding layers come from ``layer_types`` when present, else from
        Gemma 3's ``sliding_window_pattern`` (every N-th layer global).
        """
        cfg = {**config, **config.get("text_config", {})}
        n = int(cfg["num_hidden_layers"])
        heads = int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
        dtype = dtype or cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
        window = cfg.get("sliding_window")
        kinds = cfg.get("layer_types")
        if kinds is None:
            pattern = cfg.get("sliding_window_pattern")
            if window and pattern is None and str(cfg.get("model_type", "")).startswith("gemma3"):
                pattern = 6
            kinds = ["full_attention" if not (window and pattern) or i % pattern == pattern - 1 else "sliding_attention" for i in range(n)]
        if len(kinds) != n:
            raise ValueError(f"layer_types has {len(kinds)} entries for {n} layers")
        layers = tuple(
            LayerSpec(SLIDING, heads, head_dim, head_dim, dtype, window=int(window))
            if k == "sliding_attention"
            else LayerSpec(GLOBAL, heads, head_dim, head_dim, dtype)
            for k in kinds
        )
        return cls(layers)


# the same as LayerSpec.held_ranges, for callers that pass the layer as data
held_ranges = LayerSpec.held_ranges


def spec_dtype(name: str):
    """The mx dtype a spec names."""
    return _DTYPES[name]


def _dtype_name(dt) -> str:
    for name, value in _DTYPES.items():
        if value == dt:
            return name
    raise UnsupportedCacheError(f"unsupported cache dtype {dt}")
