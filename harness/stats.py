"""Summary statistics of timing samples, with numpy and scipy.

The confidence interval of the median is distribution-free: with ``n``
sorted samples, the interval between order statistics ``x[l]`` and ``x[u]``
covers the median with probability ``P(l <= B < u)`` for ``B ~ Binomial(n,
1/2)``. We take the narrowest symmetric pair with coverage >= 99%. Below
n = 8 no pair reaches 99% (even [min, max] covers only 1 - 2**(1-n), 98.4%
at n = 7), and the interval returned is [min, max] with that lower coverage.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from scipy import stats as sps

CONFIDENCE = 0.99


def _finite(values: Sequence[float], what: str) -> np.ndarray:
    x = np.asarray(values, dtype=float)
    if x.size == 0:
        raise ValueError(f"no {what} given")
    if not np.all(np.isfinite(x)):
        raise ValueError(f"{what} must be finite numbers, got {x[~np.isfinite(x)][:3].tolist()}")
    return x


def median_ci(samples: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Distribution-free confidence interval of the median (see the module doc).

    Args:
        samples: the measurements, in any order.
        confidence: the coverage wanted, 0.99 by default.

    Returns:
        (low, high), two of the samples; (min, max) when n is too small to reach ``confidence``.
    """
    x = np.sort(_finite(samples, "samples"))
    n = len(x)
    # 0-based x[l], x[n-1-l] are 1-based order statistics r = l+1, s = n-l,
    # which cover the median with probability P(r <= B <= s-1). Coverage
    # shrinks as l grows, so the first l from the middle that reaches it is the narrowest.
    for l in range((n - 1) // 2, -1, -1):
        if sps.binom.cdf(n - l - 1, n, 0.5) - sps.binom.cdf(l, n, 0.5) >= confidence:
            return float(x[l]), float(x[n - 1 - l])
    return float(x[0]), float(x[-1])


def summarize(samples: Sequence[float]) -> dict[str, float | int]:
    """Summary of one metric's samples, as stored beside them in a results document.

    Args:
        samples: the measurements (at least one, all finite).

    Returns:
        n, min, max, mean, std (ddof=1; 0.0 for one sample), median, q1, q3,
        p90, p95, p99 (numpy's linear percentiles), and ci99_median_low/high
        (see ``median_ci``).

    Raises:
        ValueError: on no samples or a non-finite one.
    """
    x = _finite(samples, "samples")
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


def mannwhitney_p(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Two-sided Mann-Whitney U p-value of two sample sets; None when either has a single sample."""
    if min(len(a), len(b)) < 2:
        return None
    return float(sps.mannwhitneyu(a, b, alternative="two-sided").pvalue)


def linear_fit(x: Sequence[float], y: Sequence[float]) -> dict[str, float | int]:
    """Least-squares line y = slope * x + intercept (scipy.stats.linregress).

    Args:
        x, y: paired finite values, at least 2 distinct x.

    Returns:
        slope, intercept, r2, stderr (of the slope) and n. When every y is
        equal, R² is 0/0; the flat line then passes through every point, so
        r2 is 1.0 and stderr 0.0 rather than NaN (which JSON cannot hold).

    Raises:
        ValueError: on unpaired or non-finite input, or fewer than 2 distinct x.
    """
    xs, ys = _finite(x, "x values"), _finite(y, "y values")
    if xs.shape != ys.shape:
        raise ValueError(f"a linear fit needs paired x and y, got {xs.size} x and {ys.size} y values")
    if len(np.unique(xs)) < 2:
        raise ValueError(f"a linear fit needs at least 2 distinct x values, got {np.unique(xs).tolist()}")
    if np.all(ys == ys[0]):
        return {"slope": 0.0, "intercept": float(ys[0]), "r2": 1.0, "stderr": 0.0, "n": int(xs.size)}
    r = sps.linregress(xs, ys)
    return {"slope": float(r.slope), "intercept": float(r.intercept), "r2": float(r.rvalue**2),
            "stderr": float(r.stderr), "n": int(xs.size)}
