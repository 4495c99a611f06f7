"""Two models switched in one server's fleet, a turn each, while the process's RSS is sampled: the driver of
tests/semantic/serve/fleet/test_memory.py, and by hand the before/after figures of the fleet's memory.

``python -m harness.memory.cycles A_DIR B_DIR --models-mb N [--pool-mb P] [--cycles C] [--json OUT]``
builds the fleet ``semantic serve --model a=A_DIR --model b=B_DIR --models-mb N`` builds (``fleet_of``,
with the server's imports loaded, not its HTTP), then each cycle acquires ``a`` and then ``b`` (a budget that
holds one model unloads the other), runs one named agent's turn on each and releases it. A thread reads
``VmRSS`` every ``--every-ms``; after each cycle a line says RSS and MLX's active, cache and peak memory.
``--json`` writes the cycles, the samples and ``VmHWM`` (the peak RSS, which no sample can miss).

It imports only ``semantic``, so a copy of this file run from a folder of its own measures whichever
checkout ``PYTHONPATH`` names (the figures before a change).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import threading
import time

import semantic.blas

semantic.blas.enable()  # as the server does, before anything imports mlx

import mlx.core as mx  # noqa: E402

import semantic.serve.app  # noqa: E402,F401  the server's imports, so the RSS is a server's
from semantic.serve.config import MB, ServeConfig  # noqa: E402
from semantic.serve.opening import fleet_of  # noqa: E402
from semantic.serve.turn.apirequest import ApiRequest  # noqa: E402


def status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


class Sampler:
    """``VmRSS`` every ``every_s`` on a thread, tagged with the phase the driver is in."""

    def __init__(self, every_s: float):
        self.every_s, self.phase, self.samples = every_s, "start", []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        t0 = time.monotonic()
        while not self._stop.is_set():
            self.samples.append((round(time.monotonic() - t0, 3), self.phase, status_kb("VmRSS") * 1024))
            self._stop.wait(self.every_s)

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)


async def turn(backend, agent: str, cycle: int, words: int) -> None:
    """One greedy turn of a named agent: its cache is kept, saved and read back at its model's next load."""
    system = "You are a careful coding agent. " * words
    req = ApiRequest(max_tokens=8, agent=agent, messages=[
        {"role": "system", "content": system}, {"role": "user", "content": f"List the files, turn {cycle}."}])
    prepared = await backend.prepare(req)
    async for _ in backend.stream(prepared):
        pass


async def run(args, sampler: Sampler) -> list[dict]:
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="fleet-cycles-")
    config = ServeConfig(models=(f"a={args.a}", f"b={args.b}"), models_mb=args.models_mb, pool_mb=args.pool_mb,
                         cache_dir=cache_dir, speculation=False, log_level="warning")
    fleet = fleet_of(config)
    cycles = []
    for c in range(args.cycles):
        for name in ("a", "b"):
            sampler.phase = f"{c}:{name}"
            lease = await fleet.acquire(name)
            try:
                await turn(lease.backend, f"agent-{name}", c, args.words)
            finally:
                lease.release()
        if fleet._trimming is not None:  # the heap trim after the last load, as the server runs it
            await fleet._trimming
        row = {"cycle": c, "rss_bytes": status_kb("VmRSS") * 1024, "active_bytes": mx.get_active_memory(),
               "cache_bytes": mx.get_cache_memory(), "peak_bytes": mx.get_peak_memory(),
               "loaded": [i for i, _ in fleet.loaded()], "fleet": fleet.summary()}
        cycles.append(row)
        print(f"cycle {c:2d}  rss {row['rss_bytes'] / MB:7.1f} MB  mlx active {row['active_bytes'] / MB:6.1f}  "
              f"cache {row['cache_bytes'] / MB:6.1f}  peak {row['peak_bytes'] / MB:6.1f}  loaded {row['loaded']}",
              flush=True)
    sampler.phase = "close"
    await fleet.aclose()
    return cycles


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--models-mb", type=int, required=True)
    p.add_argument("--pool-mb", type=int, default=32)
    p.add_argument("--cycles", type=int, default=12)
    p.add_argument("--words", type=int, default=15, help="the system prompt: this many 6-word sentences")
    p.add_argument("--every-ms", type=float, default=20.0)
    p.add_argument("--cache-dir")
    p.add_argument("--json")
    args = p.parse_args()
    with Sampler(args.every_ms / 1000) as sampler:
        cycles = asyncio.run(run(args, sampler))
    samples = sampler.samples
    peak = max(s[2] for s in samples)
    print(f"budget {args.models_mb} MB  max sampled rss {peak / MB:.1f} MB ({(peak - args.models_mb * MB) / MB:+.1f})  "
          f"VmHWM {status_kb('VmHWM') / 1024:.1f} MB", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"models_mb": args.models_mb, "cycles": cycles, "samples": samples,
                       "hwm_bytes": status_kb("VmHWM") * 1024}, f)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # all is written; the interpreter's teardown sometimes aborts in native code (std::terminate)
