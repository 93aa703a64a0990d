"""Means with 95 % confidence intervals (Student's t), without scipy."""
from __future__ import annotations

import math
import statistics

# t_{0.975, df} for df = 1..30; above 30 the normal 1.96 is within 2 % of t.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t975(df: int) -> float:
    return _T975[df - 1] if df <= len(_T975) else 1.96


def mean_ci(xs) -> dict:
    """{"mean", "ci"} with ci the half-width of the 95 % interval (0 for one sample, and for
    infinite values -- a run that deadlocked has no makespan -- the mean is inf)."""
    xs = list(xs)
    m = statistics.fmean(xs) if xs else math.nan
    if len(xs) < 2 or not math.isfinite(m):
        return {"mean": m, "ci": 0.0 if len(xs) < 2 else math.nan}
    return {"mean": m, "ci": t975(len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs))}
