"""The statistics of the GPU comparison's report.

- Intervals resample seeds and test items together (a seed x item bootstrap): the seed
  spread (initialisation, data order) and the finite test set both enter, and a paired
  difference keeps the pairing of both (the same seeds, the same items). A test item is a
  group of test rows (one document's, roformer.study.data), not a row: rows of one
  document are not independent.
- With few seeds the bootstrap's spread understates the seed part of the error (by a factor
  (S-1)/S in variance) and its percentiles the tails (a normal, not Student's t with S-1
  degrees of freedom). So an interval is the point +- t(S-1) x the replicates' standard
  deviation x sqrt(S/(S-1)): conservative where the items' error dominates, near its level
  where the seeds' does, where the percentiles fell short (docs/study.md, statistics).
- A "tie" is a TOST equivalence verdict: the 90% interval of the difference lies within
  +-margin (two one-sided 5% tests), the margin stated in the config.
- Each verdict is a test at 5% on its own; with several schemes compared at once, Holm's
  correction over both tests of every comparison of a budget (Shaffer's form: a comparison's
  two nulls cannot both be true) says which verdicts hold for the family as well. The p-values are the intervals inverted, so a verdict and its p-values
  never disagree.
- Onsets are time-to-event data: a run that already uses order at its first evaluation is
  left-censored (started at or before then), one that never does is right-censored. The
  curve is Kaplan-Meier's fraction started, with an exact (Clopper-Pearson) binomial band at
  each evaluation among the runs followed to it: resampling 8 seeds gives a band of no width
  where none or all have started.
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


def seed_scale(seeds: int, level: float) -> float:
    """How many of the replicates' standard deviations an interval at `level` reaches either
    side of its point, with `seeds` seeds (the module's note): t(S-1) x sqrt(S/(S-1)); with one
    seed, whose spread cannot be seen, the normal quantile (the items' error only)."""
    from scipy import stats   # when a report is written, not at start-up

    if seeds < 2:
        return float(stats.norm.ppf(0.5 + level / 2))
    return float(stats.t.ppf(0.5 + level / 2, seeds - 1)) * math.sqrt(seeds / (seeds - 1))


def interval(point: float, replicates: np.ndarray, seeds: int, level: float = 0.95) -> tuple[float, float]:
    """The interval at `level` around `point` from its bootstrap replicates over `seeds` seeds;
    (nan, nan) when a replicate is not finite (a member diverged at every rate)."""
    if not np.all(np.isfinite(replicates)) or not math.isfinite(point):
        return math.nan, math.nan
    half = seed_scale(seeds, level) * float(np.std(replicates, ddof=1))
    return point - half, point + half


def compare(loss: np.ndarray, reference: np.ndarray, weight: np.ndarray, *, margin: float, samples: int,
            seed: int = 0) -> dict:
    """The paired difference loss - reference with its 95% interval and the verdict:
    "higher" / "lower" (the 95% interval excludes 0), "equivalent" (TOST at 5%: the 90%
    interval within +-margin), else "undecided"; with the p-values of both tests."""
    replicates = bootstrap_means(loss, weight, samples=samples, seed=seed, reference=reference)
    seeds = loss.shape[0]
    diff = mean_loss(loss, weight) - mean_loss(reference, weight)
    lo, hi = interval(diff, replicates, seeds, 0.95)
    lo90, hi90 = interval(diff, replicates, seeds, 0.90)
    p_difference, p_equivalence = p_values(diff, replicates, seeds, margin)
    return {"diff": diff, "lo": lo, "hi": hi, "lo90": lo90, "hi90": hi90, "margin": margin,
            "verdict": verdict(lo, hi, lo90, hi90, margin), "p_difference": p_difference,
            "p_equivalence": p_equivalence}


def p_values(diff: float, replicates: np.ndarray, seeds: int, margin: float) -> tuple[float, float]:
    """(p_difference, p_equivalence) of a difference `diff` with its bootstrap replicates: the
    intervals inverted (the same t and scale as `interval`), so p_difference < level exactly
    where the interval at 1 - level excludes 0, and p_equivalence < level exactly where the one
    at 1 - 2 level lies within +-margin (TOST). Replicates that are not all finite (every rate
    of a scheme diverged) show nothing: p = 1."""
    from scipy import stats

    if not np.all(np.isfinite(replicates)) or not math.isfinite(diff):
        return 1.0, 1.0
    se = float(np.std(replicates, ddof=1)) * (math.sqrt(seeds / (seeds - 1)) if seeds >= 2 else 1.0)
    dist = stats.t(seeds - 1) if seeds >= 2 else stats.norm()
    if se == 0:   # every replicate the same: no error to test against
        return float(diff == 0), float(not -margin < diff < margin)
    return (min(1.0, 2 * float(dist.sf(abs(diff) / se))),
            max(float(dist.sf((diff + margin) / se)), float(dist.cdf((diff - margin) / se))))


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


def holm(p_values: list[float], alpha: float = 0.05, groups: list | None = None) -> list[bool]:
    """Holm's step-down correction: which of a family of tests are rejected with the family-wise
    error rate held at `alpha` (the smallest p below alpha/m, the next below alpha/(m-1), ...,
    stopping at the first that is not; strictly below, as the intervals exclude a null).

    With `groups` (a label per test), at most one null hypothesis of a group can be true, and
    each step divides alpha by the number of groups with a test not yet rejected: the most
    true nulls that can remain once those before it are false (Shaffer 1986, JASA 81:826,
    the sequentially rejective form). Without groups every test is its own group: Holm."""
    groups = list(range(len(p_values))) if groups is None else list(groups)
    open_tests = {g: groups.count(g) for g in groups}
    rejected = [False] * len(p_values)
    for index in sorted(range(len(p_values)), key=lambda i: p_values[i]):
        if not p_values[index] < alpha / len(open_tests):
            break
        rejected[index] = True
        open_tests[groups[index]] -= 1
        if not open_tests[groups[index]]:
            del open_tests[groups[index]]
    return rejected


def family_verdicts(comparisons: list[dict], alpha: float = 0.05) -> list[str | None]:
    """Each comparison's verdict (`compare`'s) with the whole family corrected: both null
    hypotheses of every comparison (no difference; a difference of at least the margin) in one
    step-down, so a null stays in the family whichever claim the data made. "holds" where the
    corrected verdict is the comparison's own, else "not under Holm: <the corrected verdict>";
    None for "undecided", which claims nothing.

    A comparison's two nulls cannot both be true, so it counts once in each step's divisor
    while either is left (`holm` with groups): one comparison alone keeps its own verdict.
    Entering only the p-value of the claim made would leave out the "no difference" nulls of
    the comparisons that claimed equivalence, and not hold the family-wise error rate."""
    m = len(comparisons)
    rejected = holm([c["p_difference"] for c in comparisons] + [c["p_equivalence"] for c in comparisons],
                    alpha, groups=list(range(m)) * 2)
    out = []
    for c, differs, equivalent in zip(comparisons, rejected, rejected[m:]):
        if c["verdict"] == "undecided":
            out.append(None)
            continue
        corrected = ("equivalent" + (" (nonzero)" if differs else "") if equivalent
                     else ("higher" if c["lo"] > 0 else "lower") if differs else "undecided")
        out.append("holds" if corrected == c["verdict"] else f"not under Holm: {corrected}")
    return out


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
    """Fraction started by each grid time (1 - the Kaplan-Meier survival of 'not started',
    scipy.stats.ecdf's on the right-censored sample); a left-censored onset counts as started
    at its time (an upper bound)."""
    from scipy import stats

    times, started = np.asarray(times, float), np.asarray(started, bool)
    sample = stats.CensoredData(uncensored=times[started], right=times[~started])
    return stats.ecdf(sample).cdf.evaluate(np.asarray(grid, float))


def onset_curve(times, started, grid, *, level: float = 0.95) -> dict:
    """Kaplan-Meier fraction started over `grid`, with an exact binomial (Clopper-Pearson) band
    at each grid time: k started of the n runs followed to it (a run right-censored earlier,
    one whose training diverged, is not among them)."""
    from scipy import stats

    times, started = np.asarray(times, float), np.asarray(started, bool)
    grid = np.asarray(grid, float)
    lo, hi = [], []
    for g in grid:
        done = started & (times <= g)
        k, n = int(done.sum()), int((done | (times >= g)).sum())
        tail = (1 - level) / 2
        lo.append(float(stats.beta.ppf(tail, k, n - k + 1)) if k > 0 else 0.0)
        hi.append(float(stats.beta.ppf(1 - tail, k + 1, n - k)) if k < n else 1.0)
    return {"grid": grid.tolist(), "fraction": kaplan_meier(times, started, grid).tolist(), "lo": lo, "hi": hi}


def percentile_band(values: np.ndarray, lo: float = 10, hi: float = 90) -> dict:
    """Median and the lo-hi percentiles over axis 0 (the seeds), ignoring non-finite values."""
    values = np.where(np.isfinite(values), values, np.nan)
    with np.errstate(all="ignore"):
        return {"median": np.nanmedian(values, 0).tolist(), "lo": np.nanpercentile(values, lo, 0).tolist(),
                "hi": np.nanpercentile(values, hi, 0).tolist()}
