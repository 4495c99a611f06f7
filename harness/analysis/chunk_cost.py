"""What one step of the step loop costs: a decode step of B rows, and a prefill chunk of L tokens at a context depth.

``python -m harness.analysis.chunk_cost [--model smollm2-135m] [--depths 0 4096 8000] [--chunks 1 4 16 64]``

EXP-010 asks for two things at once: decoders' p99 inter-token latency at
most ``r`` times their idle median while an 8K prompt prefills, and that
prompt's own time at most ``g`` times an unchunked prefill. A step is one
decode (``d``) then one chunk (``c(L, depth)``), one after the other, so with
``L`` chosen per step a decoder waits ``d + c`` and the prefill is slowed by
``(c + d) / c``: ``(r - 1)(g - 1) >= 1`` whatever ``L`` is (r <= 3 needs
g >= 1.5). Even a loop that fused the decode rows into the chunk's forward
pass (vLLM's way) is bounded by ``c(1, depth) / d``: this prints the figures
that decide it, and the ``(r, g)`` each chunk size gives at ``--depths[-1]``.

Every timed region ends in ``mx.eval``; the median of ``--rounds`` is printed.
The softmax line is why long contexts cost so much on this CPU: MLX's CPU
``exp`` runs at about 16 ns an element (numpy's at about 2.6).
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def _median_s(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)

    from semantic import blas

    blas.enable()  # before MLX is first imported: the steps below import it when they run
    from harness import device
    from harness.models.load import load

    device.ensure_working_device()  # the timings below run on the default device: a wrong GPU leaves it first
    model = load(args.model).model
    d = _decode_step_s(model, args.decoders, args.rounds + 2)
    print(f"decode step, {args.decoders} rows at depth 64: {1000 * d:.0f} ms")
    costs = _chunk_costs_s(model, args.depths, args.chunks, args.rounds, d)
    _print_trade_off(costs, d, args.depths[-1], args.chunks)
    _print_exp(args.rounds + 2)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--decoders", type=int, default=4)
    ap.add_argument("--depths", type=int, nargs="+", default=[0, 4096, 8000])
    ap.add_argument("--chunks", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--rounds", type=int, default=3)
    return ap.parse_args(argv)


def _decode_step_s(model, decoders: int, rounds: int) -> float:
    """The median seconds of one decode step of ``decoders`` rows, each 64 tokens deep."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from semantic import kinds

    rows = []
    for i in range(decoders):
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array([list(range(100 + i, 164 + i))]), cache=cache))
        rows.append(cache)
    batch = kinds.merge(rows)

    def decode():
        mx.eval(model(mx.array([[5]] * decoders), cache=batch)[:, -1, :])
        for c in batch:  # undo the step: every round decodes at the same depth
            c.offset -= 1
            if hasattr(c, "_idx"):
                c._idx -= 1

    return _median_s(decode, rounds)


def _chunk_costs_s(model, depths: list[int], chunks: list[int], rounds: int, d: float) -> dict:
    """(depth, chunk) -> the median seconds of a prefill chunk that long at that depth, each printed
    as it is measured (also in decode steps of ``d`` seconds)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    costs = {}
    for depth in depths:
        cache = make_prompt_cache(model)
        for start in range(0, depth, 512):
            mx.eval(model(mx.array([list(range(100, 100 + min(512, depth - start)))]), cache=cache)[:, -1])
        for chunk in chunks:
            def prefill():
                mx.eval(model(mx.array([list(range(300, 300 + chunk))]), cache=cache)[:, -1, :])
                for c in cache:
                    c.offset -= chunk

            costs[depth, chunk] = _median_s(prefill, rounds)
            print(f"chunk of {chunk:3d} at depth {depth:5d}: {1000 * costs[depth, chunk]:7.0f} ms"
                  f"  ({1000 * costs[depth, chunk] / chunk:.1f} ms a token, {costs[depth, chunk] / d:.1f} decode steps)")
    return costs


def _print_trade_off(costs: dict, d: float, deep: int, chunks: list[int]) -> None:
    """The decoders' latency ratio r and the prefill's slowdown g each chunk size gives at depth ``deep``."""
    for chunk in chunks:
        c = costs[deep, chunk]
        print(f"at depth {deep}, chunk {chunk}: serial r = {1 + c / d:.1f}, g = {1 + d / c:.2f};"
              f" fused (decode rides in the chunk) r >= {c / d:.1f}")


def _print_exp(rounds: int) -> None:
    """MLX's ``exp`` against numpy's over one layer's attention scores at depth 8000."""
    import mlx.core as mx

    s = mx.random.normal((1, 3, 192, 8000))
    mx.eval(s)
    t_mx = _median_s(lambda: mx.eval(mx.exp(s)), rounds)
    host = np.array(s)
    t_np = _median_s(lambda: np.exp(host), rounds)
    print(f"exp of {s.size / 1e6:.1f}M float32 (one layer's attention scores, 64 queries at depth 8000):"
          f" MLX {1000 * t_mx:.0f} ms, numpy {1000 * t_np:.0f} ms")


if __name__ == "__main__":
    main()
