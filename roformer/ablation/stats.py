"""The statistics of the ablation's report: over seeds, means with their spread and paired
differences with 95% t-intervals (each seed shares data order, masks and initialisation
across schemes, so differences are taken per seed)."""
from __future__ import annotations

import math
import statistics
from typing import Any, Iterable, Mapping


def finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def t_critical(df: int) -> float:
    """Two-sided 95% critical value of Student's t with `df` degrees of freedom."""
    from scipy import stats   # scipy.stats: only when an interval is computed, not at start-up

    return float(stats.t.ppf(0.975, df))


def mean_std(values: Iterable[float | None]) -> dict | None:
    """Mean and sample standard deviation of the finite values (std None for one value)."""
    vals = [float(v) for v in values if finite(v)]
    if not vals:
        return None
    return {"mean": statistics.fmean(vals), "std": statistics.stdev(vals) if len(vals) > 1 else None,
            "n": len(vals)}


def paired_difference(values: Mapping[int, float | None], reference: Mapping[int, float | None]) -> dict | None:
    """Mean of value - reference over the seeds both have, with its 95% t-interval (paired:
    each seed shares data order, masks and initialisation). `exceeds` is True when the
    interval excludes 0, i.e. the difference is larger than the seed-to-seed spread."""
    diffs = [float(values[s]) - float(reference[s]) for s in sorted(values)
             if s in reference and finite(values[s]) and finite(reference[s])]
    if not diffs:
        return None
    mean = statistics.fmean(diffs)
    if len(diffs) < 2:
        return {"diff": mean, "lo": None, "hi": None, "n": 1, "exceeds": None}
    half = t_critical(len(diffs) - 1) * statistics.stdev(diffs) / math.sqrt(len(diffs))
    return {"diff": mean, "lo": mean - half, "hi": mean + half, "n": len(diffs),
            "exceeds": bool(mean - half > 0 or mean + half < 0)}
