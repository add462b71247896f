"""Statistics of `kvstash bench quality` over windows: paired intervals and distributions.

Every window is scored with the exact cache and with each codec on the same tokens, so a codec's effect is
measured as a paired difference per window. The perplexity change of a text is
exp(mean(nll_mode) - mean(nll_exact)) - 1, windows weighing equally; its interval is a t-interval on the
per-window nll differences, mapped through the same exp (monotone, so the ends stay ends). A percentile
bootstrap over windows is offered beside it for figures that are not means (greedy agreement's median).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

# two-sided 95% Student t quantiles by degrees of freedom; beyond 30 the normal's 1.96 is within 2%
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
        20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048,
        29: 2.045, 30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980}


def t95(df: int) -> float:
    """The 97.5% quantile of Student's t with `df` degrees of freedom (table; between rows the next lower
    row's, which is the larger, so the interval errs wide)."""
    if df < 1:
        raise ValueError("a t-interval needs at least two values")
    return _T95[max(k for k in _T95 if k <= df)] if df <= 120 else 1.96


def mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def t_interval(xs: Sequence[float]) -> tuple[float, float, float]:
    """(mean, low, high): the 95% t-interval of the mean of `xs`."""
    m = mean(xs)
    if len(xs) < 2:
        return m, m, m
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))
    half = t95(len(xs) - 1) * sd / math.sqrt(len(xs))
    return m, m - half, m + half


def ppl_delta_interval(nll_mode: Sequence[float], nll_exact: Sequence[float]) -> tuple[float, float, float]:
    """(delta %, low %, high %) of perplexity vs exact, paired over windows (same windows, same order: the text's).

    Windows that overlap on a short text can make neighbouring differences alike; then the t-interval of
    independent windows is too narrow. Where the lag-1 autocorrelation r of the differences is positive, the
    half-width is widened by sqrt((1 + r) / (1 - r)), what an AR(1) series' mean needs (r capped at 0.9); a
    negative r narrows nothing."""
    diffs = paired_deltas(nll_mode, nll_exact)
    m, lo, _ = t_interval(diffs)
    r = min(max(autocorrelation(diffs), 0.0), 0.9)
    half = (m - lo) * math.sqrt((1 + r) / (1 - r))
    return tuple((math.exp(v) - 1) * 100 for v in (m, m - half, m + half))  # type: ignore[return-value]


def paired_deltas(nll_mode: Sequence[float], nll_exact: Sequence[float]) -> list[float]:
    """Each window's nll under the codec less its nll under the exact cache (same windows, same order)."""
    if len(nll_mode) != len(nll_exact):
        raise ValueError("paired windows differ in number")
    return [a - b for a, b in zip(nll_mode, nll_exact, strict=True)]


def autocorrelation(xs: Sequence[float], lag: int = 1) -> float:
    """The sample autocorrelation of `xs` (in text order) at `lag`; 0.0 when they do not vary. Windows that
    overlap on a short text could make neighbouring differences alike, and then the t-interval too narrow: a
    clearly positive value says so."""
    n, m = len(xs), mean(xs)
    var = sum((x - m) ** 2 for x in xs)
    if n <= lag or var == 0:
        return 0.0
    return sum((xs[i] - m) * (xs[i + lag] - m) for i in range(n - lag)) / var


def quantile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile (numpy's default), q in [0, 1]."""
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def distribution(xs: Sequence[float]) -> dict[str, float]:
    """min / p10 / median / mean / max of `xs`."""
    return {"min": min(xs), "p10": quantile(xs, 0.1), "median": quantile(xs, 0.5), "mean": mean(xs),
            "max": max(xs)}


def bootstrap(xs: Sequence[float], stat: Callable[[Sequence[float]], float], *, reps: int = 2000,
              seed: int = 0) -> tuple[float, float]:
    """95% percentile-bootstrap interval of stat(xs), resampling windows with replacement (seeded)."""
    rng = random.Random(seed)
    vals = sorted(stat([xs[rng.randrange(len(xs))] for _ in xs]) for _ in range(reps))
    return quantile(vals, 0.025), quantile(vals, 0.975)
