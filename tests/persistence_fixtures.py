"""Cache files committed to tests/data/, one set per supported mlx-lm version.

Each is a tiny model's cache after a generation, written by the mlx-lm
version that runs this module; tests/semantic/cachefile/test_cachefile_versions.py
loads every one under whichever version runs the tests. The tiny models'
weights are the same under mlx 0.30.3 and 0.32 (same seed, same init); the
weights' fingerprint is in each file, so a change there fails loudly.

    .venv/bin/python -m tests.persistence_fixtures          # mlx-lm 0.32.x
    .venv-compat/bin/python -m tests.persistence_fixtures   # mlx-lm 0.30.4
"""

from __future__ import annotations

from pathlib import Path

from semantic import Request, cachefile, compat
from tests.cache_helpers import make_executor, generate, history, run, weights_fingerprint
from tests.tiny_models import tiny_gemma3, tiny_llama

DATA = Path(__file__).parent / "data"

# name: (model builder, kv_bits, history length, generated tokens, first format version)
FIXTURES = {
    "tiny-gemma3": (tiny_gemma3, None, 37, 6, 1),       # window 8: the ring wrapped
    "tiny-llama-q8": (tiny_llama, 8, 21, 6, 1),         # QuantizedKVCache, 8 bits
    # through submit_history, which pools the window at every block boundary of the prefill: the
    # window edge [35, 36) references the pooled block [32, 36), stored whole (stored_from)
    "tiny-gemma3-edge": (tiny_gemma3, None, 37, 6, 2),
}


def fixture_path(name: str, mlx_lm_version: str = compat.MLX_LM_VERSION) -> Path:
    return DATA / f"cache-v{cachefile.FORMAT_VERSION}-{name}-mlx-lm-{mlx_lm_version}.safetensors"


def expected(version: int) -> set[str]:
    """The fixtures written in format ``version``."""
    return {name for name, f in FIXTURES.items() if f[4] <= version}


def model_for(name: str):
    """(model, kv_bits) that a fixture named ``name`` was written with."""
    build, kv_bits = FIXTURES[name][:2]
    return build(), kv_bits


def write() -> list[Path]:
    paths = []
    for name, (build, kv_bits, n, gen, _) in FIXTURES.items():
        model = build()
        executor = make_executor(model, kv_bits)
        if name.endswith("-edge"):
            uid = executor.submit(Request(name, history(n), gen))
            done = run(executor)[uid]
            assert cachefile.prepare(done.blocks).stored_from, "the fixture must reference a pooled edge block"
        else:
            done = generate(executor, name, history(n), gen)
        path = fixture_path(name)
        cachefile.save(path, done.blocks, model_fingerprint=weights_fingerprint(model), agent_id=name)
        paths.append(path)
    cachefile.settle()
    return paths


if __name__ == "__main__":
    for p in write():
        print(p)
