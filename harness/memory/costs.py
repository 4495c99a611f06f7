"""Measures the constants of ``semantic.serve.fleet.footprint`` (what a model costs a server's RSS), each in a
fresh process, and sets each measured turn beside the estimate.

    python -m harness.memory.costs [MODEL_DIR ...] [--pool-mb 256] [--prompts 64,600,1500,2100,4000]

* ``runtime``: RSS after the server's imports, and with no model loaded after a tiny model loaded, ran a
  turn and unloaded (the fixed cost: ``RUNTIME_BYTES``);
* ``tokenizer``: what loading each model's tokenizer adds once the imports are paid (``tokenizer_bytes``);
* ``turn``: each model loaded as the fleet loads it, then turns of each prompt length (token ids, greedy, 4
  tokens): the peak RSS of the turn (``VmHWM``, reset before it) over the RSS before it, beside
  ``working_bytes``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

MB = 1 << 20


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def _server_imports() -> None:
    import semantic.blas

    semantic.blas.enable()
    import semantic.serve.app  # noqa: F401  what a server has imported before its first model


def _fleet(model_dir: str, pool_mb: int):
    from semantic.serve.config import ServeConfig
    from semantic.serve.opening import fleet_of

    return fleet_of(ServeConfig(models=(f"m={model_dir}",), pool_mb=pool_mb, cache_dir=tempfile.mkdtemp(),
                                speculation=False))


async def _turn(backend, ids: list[int]) -> None:
    from semantic.serve.turn.apirequest import ApiRequest

    prepared = await backend.prepare(ApiRequest(max_tokens=4, prompt=ids))
    async for _ in backend.stream(prepared):
        pass


def child_runtime() -> dict:
    import asyncio

    _server_imports()
    imports = _status_kb("VmRSS") * 1024
    from harness.models.tiny import write_tiny_llama

    tiny = write_tiny_llama(Path(tempfile.mkdtemp()) / "tiny")

    async def run():
        fleet = _fleet(str(tiny), 8)
        lease = await fleet.acquire("m")
        await _turn(lease.backend, list(range(1, 200)))
        lease.release()
        await fleet._unload(fleet.slots["m"], "measure")
        await fleet.aclose()

    asyncio.run(run())
    return {"imports_bytes": imports, "runtime_bytes": _status_kb("VmRSS") * 1024}


def child_tokenizer(model_dir: str) -> dict:
    import gc

    _server_imports()
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from harness.models.tiny import write_tiny_llama

    load_tokenizer(write_tiny_llama(Path(tempfile.mkdtemp()) / "tiny"))  # the lazy imports, paid once
    gc.collect()
    before = _status_kb("VmRSS") * 1024
    tok = load_tokenizer(Path(model_dir))
    gc.collect()
    return {"tokenizer_bytes": _status_kb("VmRSS") * 1024 - before, "vocab": len(tok.vocab)}


def child_turn(model_dir: str, pool_mb: int, prompts: list[int]) -> dict:
    import asyncio
    import gc

    _server_imports()
    import mlx.core as mx

    rows = []

    async def run():
        fleet = _fleet(model_dir, pool_mb)
        lease = await fleet.acquire("m")
        await fleet._trimming
        gc.collect()
        for n in prompts:
            before, active = _status_kb("VmRSS") * 1024, mx.get_active_memory()
            mx.reset_peak_memory()
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS now
            try:
                vocab = lease.backend.service.vocab_size
                await _turn(lease.backend, [(n + 13 * i) % vocab for i in range(n)])  # no prefix of another
            except Exception as exc:  # a prompt the pool or the context does not hold
                rows.append({"prompt": n, "error": f"{type(exc).__name__}: {exc}"[:200]})
                continue
            rows.append({"prompt": n, "peak_over_bytes": _status_kb("VmHWM") * 1024 - before,
                         "after_over_bytes": _status_kb("VmRSS") * 1024 - before,
                         "mlx_cache_bytes": mx.get_cache_memory(),
                         "mlx_peak_over_bytes": mx.get_peak_memory() - active})
        lease.release()
        await fleet.aclose()

    asyncio.run(run())
    return {"rows": rows}


def _child(*args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "harness.memory.costs", "--child", *args],
                         capture_output=True, text=True)
    lines = out.stdout.strip().splitlines()
    if not lines:
        raise RuntimeError(f"the {args[0]} measurement printed nothing (exit {out.returncode}): {out.stderr[-2000:]}")
    return json.loads(lines[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="*")
    p.add_argument("--pool-mb", type=int, default=256)
    p.add_argument("--prompts", default="64,600,1500,2100,4000")
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        kind, *rest = a.child
        result = {"runtime": lambda: child_runtime(), "tokenizer": lambda: child_tokenizer(rest[0]),
                  "turn": lambda: child_turn(rest[0], int(rest[1]), [int(x) for x in rest[2].split(",")])}[kind]()
        print(json.dumps(result), flush=True)
        os._exit(0)  # what was measured is out; the interpreter's teardown sometimes aborts in native code

    from semantic.serve.fleet import footprint as fp

    r = _child("runtime")
    print(f"runtime: {r['imports_bytes'] / MB:.0f} MB after the server's imports, {r['runtime_bytes'] / MB:.0f} MB "
          f"with no model loaded after a load, a turn and an unload (RUNTIME_BYTES {fp.RUNTIME_BYTES / MB:.0f})")
    for model in a.models:
        d = Path(model).expanduser()
        t = _child("tokenizer", str(d))
        size = (d / "tokenizer.json").stat().st_size if (d / "tokenizer.json").is_file() else 0
        print(f"{d.name}: tokenizer {t['tokenizer_bytes'] / MB:.0f} MB (tokenizer.json {size / MB:.1f} MB, "
              f"vocabulary {t['vocab']}; estimated {fp.tokenizer_bytes(d) / MB:.0f})")
        w = fp.working_bytes(d, a.pool_mb * MB)
        for row in _child("turn", str(d), str(a.pool_mb), a.prompts)["rows"]:
            if "error" in row:
                print(f"  prompt {row['prompt']:5d}: {row['error']}")
                continue
            print(f"  prompt {row['prompt']:5d}: peak +{row['peak_over_bytes'] / MB:6.0f} MB, after +"
                  f"{row['after_over_bytes'] / MB:5.0f} MB (MLX: peak +{row['mlx_peak_over_bytes'] / MB:.0f}, cache "
                  f"{row['mlx_cache_bytes'] / MB:.0f}); "
                  f"estimated working memory {w / MB:.0f} MB (pool {a.pool_mb})")


if __name__ == "__main__":
    main()
