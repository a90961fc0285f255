"""The statistics of the GPU comparison's report.

- Intervals resample seeds and test items together (a seed x item bootstrap): the seed
  spread (initialisation, data order) and the finite test set both enter, and a paired
  difference keeps the pairing of both (the same seeds, the same items).
- A "tie" is a TOST equivalence verdict: the 90% interval of the difference lies within
  +-margin (two one-sided 5% tests), the margin stated in the config.
- Each verdict is a test at 5% on its own; with several schemes compared at once, Holm's
  correction over a budget's comparisons says which verdicts hold for the family as well.
- Onsets are time-to-event data: a run that already uses order at its first evaluation is
  left-censored (started at or before then), one that never does is right-censored. The
  curve is Kaplan-Meier's fraction started, with a percentile band from resampling seeds.
- Bands over seeds are percentiles, not mean +- SD (which runs through impossible values
  when outcomes are bimodal, e.g. started / not started).
"""
from __future__ import annotations

import functools
import math

import numpy as np


def item_sums(row_loss: np.ndarray, row_weight: np.ndarray, items: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Test rows summed into their items: loss [members, items], weight [items]."""
    n = int(items.max()) + 1 if len(items) else 0
    loss = np.stack([np.bincount(items, weights=row, minlength=n) for row in row_loss])
    return loss, np.bincount(items, weights=row_weight, minlength=n)


@functools.lru_cache(maxsize=1)
def resample_counts(seeds: int, items: int, samples: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """How often each replicate draws each seed [B, S] and each item [B, I], as floats (exact
    counts). Drawing them is most of a bootstrap's time at a full test set, and every interval
    of one budget asks for the same shape and seed (the report goes budget by budget), so the
    last draw is kept (read-only)."""
    rng = np.random.default_rng(seed)
    seed_counts = rng.multinomial(seeds, np.full(seeds, 1 / seeds), size=samples).astype(np.float64)
    item_counts = rng.multinomial(items, np.full(items, 1 / items), size=samples).astype(np.float64)
    seed_counts.setflags(write=False)
    item_counts.setflags(write=False)
    return seed_counts, item_counts


def bootstrap_means(loss: np.ndarray, weight: np.ndarray, *, samples: int, seed: int = 0,
                    reference: np.ndarray | None = None) -> np.ndarray:
    """`samples` bootstrap replicates of the mean loss per prediction over seeds and items:
    loss [seeds, items] summed per item, weight [items]. With `reference` (same shape, the same
    seeds and items) the replicates are of the paired difference loss - reference."""
    data = loss if reference is None else loss - reference
    seed_counts, item_counts = resample_counts(*data.shape, samples, seed)
    per_seed = item_counts @ data.T                                                    # [B, S]
    numerator = (seed_counts * per_seed).sum(1)
    denominator = seed_counts.sum(1) * (item_counts @ weight)
    return numerator / denominator


def mean_loss(loss: np.ndarray, weight: np.ndarray) -> float:
    return float(loss.sum() / (loss.shape[0] * weight.sum()))


def interval(replicates: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    tail = (1 - level) / 2 * 100
    lo, hi = np.percentile(replicates, [tail, 100 - tail])
    return float(lo), float(hi)


def compare(loss: np.ndarray, reference: np.ndarray, weight: np.ndarray, *, margin: float, samples: int,
            seed: int = 0) -> dict:
    """The paired difference loss - reference with its 95% interval and the verdict:
    "higher" / "lower" (the 95% interval excludes 0), "equivalent" (TOST at 5%: the 90%
    interval within +-margin), else "undecided"."""
    replicates = bootstrap_means(loss, weight, samples=samples, seed=seed, reference=reference)
    diff = mean_loss(loss, weight) - mean_loss(reference, weight)
    lo, hi = interval(replicates, 0.95)
    lo90, hi90 = interval(replicates, 0.90)
    # The p-values of the percentile bootstrap that agree with the intervals: the 95% interval
    # excludes 0 where p_difference < 0.05, the 90% interval lies within +-margin where
    # p_equivalence < 0.05 (both one-sided tests of TOST), up to the replicates' granularity.
    # A member whose loss is not finite (every rate of a scheme diverged) shows nothing: p = 1.
    if np.all(np.isfinite(replicates)):
        p_difference = min(1.0, 2 * min(float(np.mean(replicates <= 0)), float(np.mean(replicates >= 0))))
        p_equivalence = max(float(np.mean(replicates >= margin)), float(np.mean(replicates <= -margin)))
    else:
        p_difference = p_equivalence = 1.0
    return {"diff": diff, "lo": lo, "hi": hi, "lo90": lo90, "hi90": hi90, "margin": margin,
            "verdict": verdict(lo, hi, lo90, hi90, margin), "p_difference": p_difference,
            "p_equivalence": p_equivalence}


def verdict(lo: float, hi: float, lo90: float, hi90: float, margin: float) -> str:
    """`compare`'s verdict from a difference's 95% (lo, hi) and 90% (lo90, hi90) intervals at
    `margin`: so the same intervals can be read at another margin without resampling."""
    if margin <= 0:
        raise ValueError(f"the equivalence margin must be > 0, got {margin}")
    # Equivalence first: a difference can be both real (the interval excludes 0) and smaller
    # than the margin that matters; the report then says both.
    if -margin < lo90 and hi90 < margin:
        return "equivalent" + (" (nonzero)" if lo > 0 or hi < 0 else "")
    if lo > 0:
        return "higher"
    if hi < 0:
        return "lower"
    return "undecided"


def holm(p_values: list[float], alpha: float = 0.05) -> list[bool]:
    """Holm's step-down correction: which of a family of tests are rejected with the family-wise
    error rate held at `alpha` (the smallest p against alpha/m, the next against alpha/(m-1), ...,
    stopping at the first that fails)."""
    rejected = [False] * len(p_values)
    for rank, index in enumerate(sorted(range(len(p_values)), key=lambda i: p_values[i])):
        if p_values[index] > alpha / (len(p_values) - rank):
            break
        rejected[index] = True
    return rejected


def family_verdicts(comparisons: list[dict], alpha: float = 0.05) -> list[str | None]:
    """Whether each comparison's verdict (`compare`'s) holds with the whole family corrected
    (Holm over the comparisons): "holds" or "not under Holm"; None for "undecided", which
    claims nothing. A comparison's two null hypotheses (no difference; a difference of at least
    the margin) cannot both be true, so each comparison adds one true null at most, and its
    p-value is its claim's: the difference test's for "higher"/"lower", TOST's for "equivalent",
    the larger of the two for "equivalent (nonzero)", which claims both."""
    claims = {"higher": ("p_difference",), "lower": ("p_difference",), "equivalent": ("p_equivalence",),
              "equivalent (nonzero)": ("p_difference", "p_equivalence")}
    p_values = [max(c[key] for key in claims[c["verdict"]]) if c["verdict"] in claims
                else min(c["p_difference"], c["p_equivalence"]) for c in comparisons]
    return [None if c["verdict"] not in claims else "holds" if kept else "not under Holm"
            for c, kept in zip(comparisons, holm(p_values, alpha))]


def equivalence_bound(lo90: float, hi90: float) -> float:
    """The margin TOST needs: the difference is called equivalent at every margin above this
    (the 90% interval's end farthest from 0) and at none at or below it."""
    return max(abs(lo90), abs(hi90))


# --------------------------------------------------------------------------- onsets


def onset(tokens: list[float], gaps: list[float], threshold: float) -> dict:
    """When one run starts using order: its first evaluation with gap >= threshold.
    `left_censored`: already at the first evaluation after step 0 (the onset is at or before
    then); `started` False: never within the run (right-censored at its last evaluation)."""
    for i, (t, g) in enumerate(zip(tokens, gaps)):
        if t > 0 and math.isfinite(g) and g >= threshold:
            first_after_start = next(j for j, tt in enumerate(tokens) if tt > 0)
            return {"tokens": t, "started": True, "left_censored": i == first_after_start}
    return {"tokens": tokens[-1], "started": False, "left_censored": False}


def kaplan_meier(times: np.ndarray, started: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Fraction started by each grid time (1 - the Kaplan-Meier survival of 'not started');
    a left-censored onset counts as started at its time (an upper bound)."""
    times, started = np.asarray(times, float), np.asarray(started, bool)
    out = np.zeros(len(grid))
    surviving = 1.0
    event_times = np.unique(times[started])
    for t in event_times:
        at_risk = (times >= t).sum()
        events = ((times == t) & started).sum()
        if at_risk:
            surviving *= 1 - events / at_risk
        out[grid >= t] = 1 - surviving
    return out


def onset_curve(times, started, grid, *, samples: int, seed: int = 0, level: float = 0.95) -> dict:
    """Kaplan-Meier fraction started over `grid` with a percentile band from resampling runs."""
    times, started = np.asarray(times, float), np.asarray(started, bool)
    rng = np.random.default_rng(seed)
    curve = kaplan_meier(times, started, grid)
    replicates = []
    for _ in range(samples):
        pick = rng.integers(0, len(times), len(times))
        replicates.append(kaplan_meier(times[pick], started[pick], grid))
    tail = (1 - level) / 2 * 100
    lo, hi = np.percentile(np.asarray(replicates), [tail, 100 - tail], axis=0)
    return {"grid": np.asarray(grid, float).tolist(), "fraction": curve.tolist(), "lo": lo.tolist(), "hi": hi.tolist()}


def percentile_band(values: np.ndarray, lo: float = 10, hi: float = 90) -> dict:
    """Median and the lo-hi percentiles over axis 0 (the seeds), ignoring non-finite values."""
    values = np.where(np.isfinite(values), values, np.nan)
    with np.errstate(all="ignore"):
        return {"median": np.nanmedian(values, 0).tolist(), "lo": np.nanpercentile(values, lo, 0).tolist(),
                "hi": np.nanpercentile(values, hi, 0).tolist()}
