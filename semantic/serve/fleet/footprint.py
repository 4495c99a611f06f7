"""What a model costs a server's RSS, estimated before it loads: the one place ``--models-mb`` is counted from.

``--models-mb`` bounds the process's resident set::

    RSS ≈ RUNTIME_BYTES                      once per process, whatever is loaded
        + Σ tokenizer_bytes(model)            every model loaded once: its tokenizer is kept across unloads
        + Σ loaded_bytes(model)               every loaded model, all given back by its unload:
            = weight files + pool + working_bytes(model)

Measured on a 2-core x86 CPU (mlx 0.32.4, mlx-lm 0.32.2, transformers 5.24, tokenizers 0.23, Python 3.11)
with ``python -m harness.memory.costs MODEL_DIR ... --pool-mb 128``, each figure in a fresh process:

* **Runtime** (:data:`RUNTIME_BYTES`): the RSS with no model loaded after a tiny model loaded, ran a turn
  and unloaded: 100 MB after the server's imports (transformers among them), 111 MB once MLX and BLAS
  have computed (their threads and buffers). Counted 128.
* **Tokenizer** (:func:`tokenizer_bytes`): what loading a model's tokenizer adds, the imports paid. It
  follows ``tokenizer.json``'s size: SmolLM2 (3.4 MB file) 55 MB, Gemma 3 (31.7 MB, a 262k vocabulary)
  378 to 441 MB over four runs, the tests' byte tokenizer (5 KB) under 2 MB. Counted 16 MB plus 14 bytes
  per byte of the file: 64 and 460 MB.
* **A turn's working memory** (:func:`working_bytes`): the peak RSS of a turn over the RSS before it, at
  its largest. Its parts, from the executor's code and MLX's allocations:

  - what turns hold beyond the pool's blocks: a turn runs in the pool's own buffers, and any copy of a
    cache it must make instead is charged to the pool at admission, so what is left (a lent segment's
    spare slots, the heap's and MLX's free memory) is ``sizing.LIVE_COPY`` times the pool's size;
  - a step's largest array: one layer's attention scores over a prefill chunk (MLX's CPU attention
    materialises ``heads × chunk × context × 4`` bytes; a chunk is 2048 tokens,
    ``stepbudget.SOLO_CHUNK``, sliding windows or not) or a decode step's logits (``max_batch`` rows
    of up to 9 positions each, a token and its drafts; a prompt's last chunk computes one row of
    logits, ``runner.lastrow``, or feeds its last token alone), whichever is larger, plus the chunk's MLP and residual-stream activations;
  - MLX's buffer cache between steps (:data:`MLX_CACHE_BYTES`: 32 MB after every turn measured).

  Fresh prompts of 64 / 600 / 1500 / 2048 / 2300 tokens, 128 MB pool: SmolLM2 f32 +44 / 133 / 341 / 468
  (535 in another run) / 206 MB, estimated 598; Gemma 3 f32 (64 / 600 / 1000 / 1500) +76 / 139 / 272 /
  247 MB, estimated 424 (measured while a prompt's last chunk computed every row of logits, and a
  sliding-window model's prefill stopped at every block).

The estimate errs high: the longest prompt the pool holds, a full pool of live caches, the larger
tokenizer measurement, so that RSS stays within ``--models-mb`` for any workload; a typical one sits
below it.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from semantic import defaults
from semantic.decode.promptlookup import SpecConfig
from semantic.runner.stepbudget import SOLO_CHUNK  # a prefill chunk when nothing decodes

from semantic.sizing import LIVE_COPY, RUNTIME_BYTES, TOKENIZER_FIXED, TOKENIZER_PER_FILE_BYTE  # noqa: F401
from semantic.sizing import step_bytes, tokenizer_bytes  # noqa: F401  (the measured constants live there)
from semantic.modelconfig import ModelConfig

MB = 1 << 20
MLX_CACHE_BYTES = 32 * MB        # MLX's buffer cache after a turn (mx.get_cache_memory), every model measured
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".npz")


@dataclass(frozen=True, slots=True)
class Footprint:
    """One model's bytes, estimated before its load."""

    weights: int     # its weight files
    pool: int        # its KV block pool (``--pool-mb``)
    working: int     # a turn's working memory at its largest (:func:`working_bytes`)
    tokenizer: int   # kept after an unload (:func:`tokenizer_bytes`)

    @property
    def loaded(self) -> int:
        """What an unload gives back: weights, pool and working memory (not the kept tokenizer)."""
        return self.weights + self.pool + self.working


def footprint(model_dir: Path, pool_bytes: int, *, chunk: int | None = None,
              max_batch: int = defaults.MAX_BATCH) -> Footprint:
    """``model_dir``'s footprint (a path that is not a directory, e.g. a hub id: its pool and nothing else
    known before its load). ``chunk``: the server's fixed prefill chunk, if it sets one."""
    if not model_dir.is_dir():
        return Footprint(0, pool_bytes, 0, 0)
    weights = sum(f.stat().st_size for f in model_dir.glob("*") if f.suffix in WEIGHT_SUFFIXES)
    return Footprint(weights, pool_bytes, working_bytes(model_dir, pool_bytes, chunk=chunk, max_batch=max_batch),
                     tokenizer_bytes(model_dir))


def working_bytes(model_dir: Path, pool_bytes: int, *, chunk: int | None = None,
                  max_batch: int = defaults.MAX_BATCH) -> int:
    """A turn's working memory at its largest, from the model's config.json (see the module docstring):
    the live copies of the caches, a step's activations (``sizing.step_bytes``) and MLX's buffer cache;
    :data:`MLX_CACHE_BYTES` alone where the config says too little."""
    config = ModelConfig.read(model_dir)
    if config is None or not (config.layers and config.heads and config.vocab and config.hidden):
        return pool_bytes + MLX_CACHE_BYTES
    token_bytes = max(1, config.layers * 2 * config.kv_heads * config.head_dim * _activation_bytes(model_dir))
    longest = max(1, min(config.context, pool_bytes // token_bytes))  # the longest cache the pool holds
    live = int(LIVE_COPY * min(pool_bytes, max_batch * longest * token_bytes))
    step = min(chunk or SOLO_CHUNK, longest)
    return live + step_bytes(config, longest, step, max_batch, SpecConfig().max_draft) + MLX_CACHE_BYTES


def _activation_bytes(model_dir: Path) -> int:
    """4 when the first safetensors file's floating tensors are float32, else 2."""
    for file in sorted(model_dir.glob("*.safetensors")):
        try:
            with open(file, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(min(n, 1 << 26)))
        except (OSError, struct.error, ValueError):
            break
        dtypes = {t.get("dtype") for k, t in header.items() if k != "__metadata__" and isinstance(t, dict)}
        return 4 if "F32" in dtypes and not dtypes & {"BF16", "F16"} else 2
    return 4
