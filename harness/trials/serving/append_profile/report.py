"""What the profile says: a progress line as it goes, milliseconds, and the summary of its samples."""

from __future__ import annotations

import os
import statistics
import sys
import time


def progress(line: str) -> None:
    print(f"[append-profile {time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.1f}] {line}", file=sys.stderr, flush=True)


def ms(s: float) -> float:
    return round(s * 1e3, 2)


def summarize(result: dict) -> dict:
    """Medians of each part's samples: the engine's stamps, spans and micro-benchmarks; over HTTP, each
    server's times and its ratio over mlx_lm.server's, trial by trial."""
    out = {}
    if result.get("engine"):
        out["engine"] = _engine(result["engine"])
    if result.get("http"):
        out["http"] = _http(result["http"]["samples"])
    return out


def _engine(eng: dict) -> dict:
    med = lambda rows, k: statistics.median(r[k] for r in rows if r.get(k) is not None) if any(
        r.get(k) is not None for r in rows) else None
    ours, ref = eng["ours"], eng["mlx_lm"]
    labels = sorted({k for r in ours for k in (*r["before_last_token"], *r["after_last_token"])})
    return {
        "ours_ttft_ms": med(ours, "ttft_ms"), "ours_last_token_ms": med(ours, "last_token_ms"),
        "ours_tokens_final_ms": med(ours, "tokens_final_ms"), "ours_completion_ms": med(ours, "completion_ms"),
        "ours_admitted_ms": med(ours, "admitted_ms"),
        "mlx_lm_ttft_ms": med(ref, "ttft_ms"), "mlx_lm_last_token_ms": med(ref, "last_token_ms"),
        "spans_ms": {l: {"before_last_token": statistics.median(r["before_last_token"].get(l, 0.0) for r in ours),
                         "after_last_token": statistics.median(r["after_last_token"].get(l, 0.0) for r in ours)}
                     for l in labels},
        "micro_ms": eng["micro"],
    }


def _http(s: dict) -> dict:
    out = {}
    for name, rows in s.items():
        out[name] = {k: statistics.median(r[k] for r in rows) for k in ("ttft_s", "last_token_s", "turn_s")}
        out[name]["n"] = len(rows)
        out[name]["cached_tokens"] = [r["cached_tokens"] for r in rows]
    peer = s.get("mlx_lm.server")
    for name, rows in s.items():
        if peer is not None and name != "mlx_lm.server":  # the ratio of each trial's pair, then the median
            out[f"ratio_{name}_over_mlx_lm"] = {
                k: statistics.median(x[k] / y[k] for x, y in zip(rows, peer)) for k in ("ttft_s", "last_token_s", "turn_s")}
    out["load"] = [r["load"] for rows in s.values() for r in rows]
    return out
