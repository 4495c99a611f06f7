"""A model's config, read one way wherever it is read: from ``config.json``, a config dict, or a loaded model.

A multimodal wrapper (Qwen3.5, Gemma 3's vision build) nests its language model's values under
``text_config``; those are the ones a text server runs, so they win over the top level's::

    {"model_type": "qwen3_5", "text_config": {"max_position_embeddings": 262144, ...}, "vocab_size": ...}
    read as    {**top level, **text_config}

Every reader of a model's shape goes through :class:`ModelConfig`: the context the server offers
(``service``), the memory a model needs (``sizing``, ``serve.fleet.footprint``), a cache's geometry
without weights (``cache.spec``), the vocabulary (``runner.executor``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

DEFAULT_CONTEXT = 4096   # when the config names no context length


def _as_dict(x) -> dict:
    """A config section as a plain dict: a dict, a dataclass or an object with attributes (mlx-lm's
    ``ModelArgs``), else empty."""
    if isinstance(x, Mapping):
        return dict(x)
    if x is None:
        return {}
    try:
        return dict(vars(x))
    except TypeError:
        return {}


@dataclass(frozen=True)
class ModelConfig:
    """The text model's config values (``text_config`` over the top level: the module doc)."""

    values: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, doc: Mapping | None) -> "ModelConfig":
        top = _as_dict(doc)
        return cls({**top, **_as_dict(top.get("text_config"))})

    @classmethod
    def of_model(cls, model) -> "ModelConfig":
        """A loaded model's: its ``args`` (mlx-lm's ``ModelArgs``)."""
        return cls.from_dict(_as_dict(getattr(model, "args", None)))

    @classmethod
    def read(cls, model_dir: Path) -> "ModelConfig | None":
        """``model_dir/config.json``'s, or None when there is none that parses as an object."""
        try:
            doc = json.loads((Path(model_dir) / "config.json").read_text())
        except (OSError, ValueError):
            return None
        return cls.from_dict(doc) if isinstance(doc, dict) else None

    def get(self, key: str, default=None):
        value = self.values.get(key)
        return default if value is None else value

    def int(self, key: str, default: int | None = None) -> int | None:
        """``key`` as an int (``default`` when absent or not a number)."""
        try:
            return int(self.values[key])
        except (KeyError, TypeError, ValueError):
            return default

    @property
    def context(self) -> int:
        """The context length the model was trained for (:data:`DEFAULT_CONTEXT` when unnamed)."""
        return self.int("max_position_embeddings") or DEFAULT_CONTEXT

    @property
    def layers(self) -> int | None:
        return self.int("num_hidden_layers")

    @property
    def heads(self) -> int | None:
        return self.int("num_attention_heads")

    @property
    def kv_heads(self) -> int | None:
        return self.int("num_key_value_heads") or self.heads

    @property
    def hidden(self) -> int | None:
        return self.int("hidden_size")

    @property
    def head_dim(self) -> int | None:
        if self.int("head_dim"):
            return self.int("head_dim")
        return math.ceil(self.hidden / self.heads) if self.hidden and self.heads else None

    @property
    def intermediate(self) -> int | None:
        return self.int("intermediate_size") or (4 * self.hidden if self.hidden else None)

    @property
    def vocab(self) -> int | None:
        return self.int("vocab_size")
