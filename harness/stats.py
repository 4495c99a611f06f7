"""Summary statistics of timing samples, with numpy and scipy.

The confidence interval of the median is distribution-free: with ``n``
sorted samples, the interval between order statistics ``x[l]`` and ``x[u]``
covers the median with probability ``P(l <= B < u)`` for ``B ~ Binomial(n,
1/2)``. We take the narrowest symmetric pair with coverage >= 99%. Below
n = 8 no pair reaches 99%, and the interval is the whole range [min, max].
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from scipy import stats as sps

CONFIDENCE = 0.99


def median_ci(samples: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Distribution-free confidence interval of the median (see module doc)."""
    x = np.sort(np.asarray(samples, dtype=float))
    n = len(x)
    # 0-based x[l], x[n-1-l] are 1-based order statistics r = l+1, s = n-l,
    # which cover the median with probability P(r <= B <= s-1).
    for l in range((n - 1) // 2, -1, -1):
        if sps.binom.cdf(n - l - 1, n, 0.5) - sps.binom.cdf(l, n, 0.5) >= confidence:
            return float(x[l]), float(x[n - 1 - l])
    return float(x[0]), float(x[-1])


def summarize(samples: Sequence[float]) -> dict[str, float]:
    """n, min, max, mean, std (ddof=1), median, q1, q3, p90, p95, p99 and the 99% CI of the median."""
    x = np.asarray(samples, dtype=float)
    if x.size == 0:
        raise ValueError("no samples to summarize")
    if not np.all(np.isfinite(x)):
        raise ValueError("samples must be finite numbers")
    q1, med, q3, p90, p95, p99 = np.percentile(x, [25, 50, 75, 90, 95, 99])
    lo, hi = median_ci(x)
    return {
        "n": int(x.size),
        "min": float(x.min()),
        "max": float(x.max()),
        "mean": float(x.mean()),
        "std": float(x.std(ddof=1)) if x.size > 1 else 0.0,
        "median": float(med),
        "q1": float(q1),
        "q3": float(q3),
        "p90": float(p90),
        "p95": float(p95),
        "p99": float(p99),
        "ci99_median_low": lo,
        "ci99_median_high": hi,
    }


def linear_fit(x: Sequence[float], y: Sequence[float]) -> dict[str, float]:
    """Least-squares line y = slope * x + intercept, with R² (scipy.stats.linregress)."""
    xs, ys = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if xs.shape != ys.shape or len(np.unique(xs)) < 2:
        raise ValueError("a linear fit needs paired x and y with at least 2 distinct x values")
    r = sps.linregress(xs, ys)
    return {"slope": float(r.slope), "intercept": float(r.intercept), "r2": float(r.rvalue**2),
            "stderr": float(r.stderr), "n": int(xs.size)}
