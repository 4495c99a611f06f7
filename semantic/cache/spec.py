"""What a model's KV cache looks like, layer by layer, with or without its weights.

A :class:`LayerSpec` is one leaf cache's geometry as data (JSON in every file,
hashed into the fingerprint); what its kind means, how it is held, made, read,
rebuilt and batched, lives in that kind's class (``semantic.kinds``): a new
cache type is a new kind there. A recurrent layer, and a window shorter than a
block, resume only where their cache was snapshotted
(:meth:`LayerSpec.snapshot_only`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as C

from semantic import compat, kinds
from semantic.errors import CacheMismatchError, UnsupportedCacheError
from semantic.modelconfig import ModelConfig
from semantic.kinds import CHUNKED, GLOBAL, RECURRENT, SLIDING  # noqa: F401
from semantic.kinds.base import DTYPES as _DTYPES


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """One leaf cache: its kind (``semantic.kinds``: global, sliding, chunked, recurrent), K/V heads
    and dims and dtype; a window (sliding: ``window`` tokens, the first ``keep`` pinned; chunked:
    the chunk), KV quantization (global), or a recurrent layer's ``arrays``."""

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
        if self.kind not in kinds.KINDS:
            raise ValueError(f"layer kind must be one of {sorted(kinds.KINDS)}, got {self.kind!r}")
        if self.kind != RECURRENT:
            object.__setattr__(self, "arrays", tuple(self.arrays))  # a list from JSON compares unequal to ()
        self._kind.check(self)

    @property
    def _kind(self) -> kinds.Kind:
        return kinds.KINDS[self.kind]

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
        return self._kind.snapshot_only(self, block_tokens)

    @property
    def cache_kind(self) -> str:
        """The mlx-lm class name of this layer's cache."""
        return self._kind.cache_class(self)

    @property
    def windowed(self) -> bool:
        """Whether the cache forgets old tokens (a sliding window, a chunk)."""
        return self._kind.windowed

    def held_ranges(self, total: int) -> list[tuple[int, int]]:
        """Token positions this layer's cache holds after ``total`` tokens (a recurrent
        layer: the last one, where its state stands)."""
        return self._kind.held_ranges(self, total)

    def tokens_held(self, total: int) -> int:
        """How many tokens this layer's cache holds after ``total`` tokens."""
        return sum(b - a for a, b in self.held_ranges(total))

    def ring_index(self, held: int) -> int | None:
        """The write index of a rebuilt rotating cache holding ``held`` tokens (None for others):
        rebuilt rings are unrolled into temporal order, so the next write goes after the newest token."""
        return held if self.kind == SLIDING else None

    @property
    def group(self) -> str:
        """Layers with the same group share block boundaries and token coverage."""
        return self._kind.group(self)

    @property
    def mx_dtype(self):
        return _DTYPES[self.dtype]

    def state_bytes(self) -> int:
        """Bytes of a recurrent layer's arrays (0 for the others: they grow per token)."""
        return self._kind.state_bytes(self)

    def token_bytes(self) -> float:
        """Bytes of K plus V per cached token (quantized: packed + scales + biases; recurrent: 0)."""
        return self._kind.token_bytes(self)

    def bytes_held(self, total: int) -> int:
        """Bytes this layer's cache holds after ``total`` tokens: its state and the K/V of what it holds."""
        return int(self.state_bytes() + self.token_bytes() * self.tokens_held(total))

    def make_cache(self):
        return self._kind.make(self)


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

    def snapshot_groups(self, block_tokens: int) -> frozenset[str]:
        """The groups that resume only from a snapshot under ``block_tokens`` (``LayerSpec.snapshot_only``)."""
        return frozenset(g for g, ix in self.groups().items() if self.layers[ix[0]].snapshot_only(block_tokens))

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
        for i, c in enumerate(caches):
            kind = kinds.for_cache(c)
            if kind is None:
                raise UnsupportedCacheError(
                    f"layer cache {i} is mlx-lm's {type(c).__name__}, which no kind here holds (kinds: "
                    f"{', '.join(sorted(k for kd in kinds.KINDS.values() for k in kd.cache_classes))}, CacheList of "
                    f"those): its state has no layout this server can store and rebuild exactly")
            layers.append(LayerSpec(**kind.spec_fields(c, kv_bits, kv_group_size)))
        return cls(tuple(layers), nesting)

    @classmethod
    def from_config(cls, config: dict[str, Any], dtype: str | None = None) -> "ModelCacheSpec":
        """Geometry from a Hugging Face / mlx-lm config alone, without weights.

        Sliding layers come from ``layer_types`` when present, else from
        Gemma 3's ``sliding_window_pattern`` (every N-th layer global).
        """
        cfg = ModelConfig.from_dict(config).values
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
