"""An MLX model directory's quantized layers, dequantized once into float32.

MLX's CPU quantized matmul does not use BLAS (about 3 GFLOP/s here); a
float32 matmul on OpenBLAS runs at 100+. This writes the same model with every
affine-quantized ``weight`` replaced by exactly ``q * scale + bias`` computed
in float32 (``mx.dequantize`` with float32 scales and biases), every other
floating tensor cast to float32, and the ``quantization`` entries dropped from
``config.json``. Tied embeddings stay tied: ``embed_tokens`` is dequantized
and no ``lm_head`` is written, so mlx-lm ties them as before.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

QUANT_KEYS = ("quantization", "quantization_config")


class DequantizeError(ValueError):
    """A model directory this module cannot turn into a float32 one."""


@dataclass(slots=True)
class DequantizeReport:
    """What :func:`dequantize_dir` changed."""

    dequantized: dict[str, int] = field(default_factory=dict)  # module path -> bits it had
    cast: list[str] = field(default_factory=list)               # tensors cast to float32 as they were


def _layer_quant(quant: dict, module: str) -> dict:
    """A module's ``group_size``/``bits``: its own entry in mlx-lm's config, else the defaults."""
    own = quant.get(module)
    q = own if isinstance(own, dict) else quant
    if q.get("mode", "affine") != "affine":
        raise DequantizeError(f"{module}: quantization mode {q.get('mode')!r} is not affine")
    try:
        return {"group_size": int(q["group_size"]), "bits": int(q["bits"])}
    except (KeyError, TypeError, ValueError):
        raise DequantizeError(f"{module}: no group_size/bits in config.json's quantization") from None


def dequantize_dir(src: Path, dst: Path) -> DequantizeReport:
    """Write the float32 variant of the model in ``src`` to ``dst`` (created).

    Args:
        src: an MLX model directory (``config.json``, ``*.safetensors``, tokenizer files).
        dst: where to write; must not exist yet.

    Returns:
        Which modules were dequantized and which tensors were only cast.
    """
    config = json.loads((src / "config.json").read_text())
    quant = next((config[k] for k in QUANT_KEYS if isinstance(config.get(k), dict)), {})
    weights: dict[str, mx.array] = {}
    for f in sorted(src.glob("*.safetensors")):
        weights.update(mx.load(str(f)))
    if not weights:
        raise DequantizeError(f"{src}: no *.safetensors")

    report = DequantizeReport()
    out: dict[str, mx.array] = {}
    for key, value in weights.items():
        module, _, part = key.rpartition(".")
        if part in ("scales", "biases") and f"{module}.weight" in weights and f"{module}.scales" in weights:
            continue  # folded into the module's weight below
        if part == "weight" and f"{module}.scales" in weights:
            q = _layer_quant(quant, module)
            scales = weights[f"{module}.scales"].astype(mx.float32)
            biases = weights[f"{module}.biases"].astype(mx.float32)
            out[key] = mx.dequantize(value, scales, biases, group_size=q["group_size"], bits=q["bits"])
            report.dequantized[module] = q["bits"]
        elif mx.issubdtype(value.dtype, mx.floating) and value.dtype != mx.float32:
            out[key] = value.astype(mx.float32)
            report.cast.append(key)
        else:
            out[key] = value
        mx.eval(out[key])

    dst.mkdir(parents=True)
    mx.save_safetensors(str(dst / "model.safetensors"), out, metadata={"format": "mlx"})
    for k in QUANT_KEYS:
        config.pop(k, None)
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "prepared.json",
                                                                       "model.safetensors.index.json",
                                                                       ".fingerprint.json"):
            shutil.copy2(f, dst / f.name)
    return report
