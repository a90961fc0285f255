"""The statistics of the end-state protocol: where two schemes end, not only when they start.

The study trains one trunk per member and branches it at log-spaced budgets (token counts,
each branch cooled down to its own end). Read at every budget on the same test items, a
scheme S and the reference (rope) give loss curves per seed; this module turns them into:

- the compute multiplier M(T) (`multiplier_curve`): the tokens S needs to reach the
  reference's loss at budget T, over T. M tending to 1 says the reference's lead is an onset
  transient; a steady M > 1 a lasting efficiency gain;
- the flat test (`gap_slope`, `is_flat`): whether the gap S - reference has stopped moving
  over the last quarter of the budgets (in log tokens), so that the last budget is read as
  the end state, not as a point on the way;
- the power of the verdicts (`tost_power`, `difference_power`, `seeds_needed`,
  `power_table`): how many seeds a verdict needs at a given paired seed sd and margin;
- the verdict rules (`end_state_verdict`): "not decided" where the regime or the curve does
  not allow a verdict, and a flag on an "equivalent" between schemes that do not use order.

Curves are arrays loss [budgets, seeds, items] of test loss summed per item (a group of test
rows, roformer.ablation.study_data) at each budget's chosen rate, with weight [items] (the
predictions per item, the same at every budget); a scheme's seed i is paired with the
reference's seed i (the same data order and masks). Intervals are the study's (seed x item
bootstrap, point +- t(S-1) x the replicates' sd x sqrt(S/(S-1)): roformer.study.stats);
the replicates of every budget share one draw of seeds and items, so a replicate is one
coherent pair of curves.

The margins are inputs (roformer.study.preregistration holds them with their reasons): no
number here says what difference matters.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from roformer.study.stats import bootstrap_means, interval, mean_loss
from roformer.errors import ConfigError

# The flat test reads the last quarter of the budgets' log-token range (`gap_slope`).
FLAT_WINDOW = 0.25

REACHED, BEFORE, NEVER, DIVERGED = ("reached", "before the first budget", "not within the budgets",
                                    "not finite (a member diverged)")


# --------------------------------------------------------------------------- curves


def mean_curve(loss: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """Mean loss per prediction at each budget: loss [budgets, seeds, items] -> [budgets]."""
    return np.asarray([mean_loss(budget, weight) for budget in loss])


def replicate_curves(loss: np.ndarray, weight: np.ndarray, *, samples: int, seed: int,
                     reference: np.ndarray | None = None) -> np.ndarray:
    """Bootstrap replicates of the mean curve, [budgets, samples]: every budget resamples the
    same seeds and items (one `seed` for all), so each replicate is one coherent curve. With
    `reference` (same shape) the replicates are of the paired difference loss - reference."""
    return np.stack([bootstrap_means(loss[b], weight, samples=samples, seed=seed,
                                     reference=None if reference is None else reference[b])
                     for b in range(len(loss))])


def crossing(tokens: np.ndarray, curves: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The tokens at which each curve first reaches its target loss, and how (REACHED, BEFORE,
    NEVER): curves [budgets, R] (positive losses at increasing `tokens` [budgets]), targets [R].

    The first budget k at or below the target brackets the crossing with budget k-1, and
    log tokens are interpolated linearly in log loss between them (a power law L = A T^-c is a
    line there, so the crossing of two such curves is exact). A curve already at or below the
    target at the first budget got there at or before it (BEFORE: tokens nan, left-censored);
    one that never reaches it needs more than the last budget (NEVER: nan, right-censored).
    The first crossing, not the last: a curve that dips below and rises again (noise, a late
    divergence) has reached the loss once. A curve not finite at a budget up to its crossing
    (a member diverged there) gives DIVERGED (nan): its crossing cannot be placed."""
    tokens = np.asarray(tokens, float)
    curves, targets = np.asarray(curves, float), np.asarray(targets, float)
    if np.any(np.diff(tokens) <= 0) or tokens[0] <= 0:
        raise ValueError(f"budgets must be positive and increasing, got {tokens.tolist()}")
    below = curves <= targets[None]
    first = np.argmax(below, axis=0)
    hit = below.any(axis=0)
    out = np.full(len(targets), math.nan)
    status = np.where(hit, np.where(first == 0, BEFORE, REACHED), NEVER).astype(object)
    last = np.where(hit, first, len(tokens) - 1)            # the budgets the answer reads
    diverged = np.array([not np.all(np.isfinite(curves[: k + 1, r])) for r, k in enumerate(last)], bool)
    status[diverged] = DIVERGED
    inside = np.flatnonzero(hit & (first > 0) & ~diverged)
    if len(inside):
        k = first[inside]
        log_t, log_l = np.log(tokens), np.log(curves[:, inside])
        l0, l1 = log_l[k - 1, np.arange(len(k))], log_l[k, np.arange(len(k))]
        fraction = (np.log(targets[inside]) - l0) / (l1 - l0)   # l1 <= target < l0: in (0, 1]
        out[inside] = np.exp(log_t[k - 1] + fraction * (log_t[k] - log_t[k - 1]))
    return out, status


def multiplier_curve(tokens: Sequence[float], loss: np.ndarray, reference_tokens: Sequence[float],
                     reference: np.ndarray, weight: np.ndarray, *, samples: int, seed: int = 0,
                     level: float = 0.95) -> list[dict]:
    """M(T) for each reference budget T: the tokens the scheme needs to reach the reference's
    mean loss at T, divided by T, with its interval at `level`.

    loss [budgets, seeds, items] at `tokens`, reference [reference budgets, seeds, items] at
    `reference_tokens` (the scheme's budgets may reach past the reference's: a scheme behind at
    the last reference budget needs them for M to be measured there), seeds paired.

    Per reference budget: {"tokens": T, "reference_loss", "needed": tokens or nan,
    "multiplier": needed / T or nan, "status": REACHED / BEFORE / NEVER / DIVERGED, "lo", "hi",
    "censored": replicates whose crossing is outside the budgets}. The interval is the study's
    on log M (a ratio: symmetric in log), read back as a ratio; it needs every replicate to
    cross inside the budgets, else (nan, nan) and the count of those that did not, since an
    interval that dropped them would leave out the tail that matters."""
    tokens, reference_tokens = np.asarray(tokens, float), np.asarray(reference_tokens, float)
    if loss.shape[1:] != reference.shape[1:]:
        raise ValueError(f"the scheme's [seeds, items] {loss.shape[1:]} are not the reference's {reference.shape[1:]}")
    seeds = loss.shape[1]
    point_targets = mean_curve(reference, weight)
    point_needed, point_status = crossing(tokens, mean_curve(loss, weight)[:, None].repeat(len(point_targets), 1),
                                          point_targets)
    scheme_reps = replicate_curves(loss, weight, samples=samples, seed=seed)
    reference_reps = replicate_curves(reference, weight, samples=samples, seed=seed)
    out = []
    for j, t in enumerate(reference_tokens):
        needed, status = crossing(tokens, scheme_reps, reference_reps[j])
        censored = int(np.sum(status != REACHED))
        lo = hi = math.nan
        if point_status[j] == REACHED and not censored:
            log_lo, log_hi = interval(math.log(point_needed[j] / t), np.log(needed / t), seeds, level)
            lo, hi = math.exp(log_lo), math.exp(log_hi)
        out.append({"tokens": float(t), "reference_loss": float(point_targets[j]), "needed": float(point_needed[j]),
                    "multiplier": float(point_needed[j] / t), "status": str(point_status[j]),
                    "lo": lo, "hi": hi, "censored": censored})
    return out


# --------------------------------------------------------------------------- flat test


def window_budgets(tokens: Sequence[float], window: float = FLAT_WINDOW) -> np.ndarray:
    """Indices of the budgets in the last `window` of the log-token range: log T >= log T_max -
    window x (log T_max - log T_min). Log, not linear: budgets are log-spaced, and the last
    quarter of the tokens themselves ([0.75 T_max, T_max]) holds one budget of a doubling grid."""
    log_t = np.log(np.asarray(tokens, float))
    return np.flatnonzero(log_t >= log_t[-1] - window * (log_t[-1] - log_t[0]) - 1e-12)


def check_flat_window(tokens: Sequence[float], window: float = FLAT_WINDOW) -> None:
    """ConfigError (one line) when the budgets give the flat test fewer than two points in its
    window: a slope needs two, so the plan must be refused before anything trains."""
    inside = window_budgets(tokens, window)
    if len(inside) < 2:
        raise ConfigError(f"the flat test needs >= 2 budgets in the last {window:g} of the log-token range "
                          f"({min(tokens):g}..{max(tokens):g} tokens has {len(inside)}); add a budget")


def _slopes(x: np.ndarray, gaps: np.ndarray) -> np.ndarray:
    """Least-squares slopes of gaps [points, R] on x [points]."""
    xc = x - x.mean()
    return (xc[:, None] * (gaps - gaps.mean(0))).sum(0) / (xc ** 2).sum()


def gap_slope(tokens: Sequence[float], loss: np.ndarray, reference: np.ndarray, weight: np.ndarray, *,
              samples: int, seed: int = 0, window: float = FLAT_WINDOW) -> dict:
    """The slope of the gap (scheme - reference mean loss, nats) against log2 tokens over the
    budgets of `window_budgets`: nats per doubling of the budget, least squares, with its 95%
    and 90% intervals (the paired seed x item bootstrap, the study's scaling).

    {"slope", "lo", "hi", "lo90", "hi90", "budgets": the tokens it used, "gap": the gap at each}."""
    inside = window_budgets(tokens, window)
    if len(inside) < 2:
        check_flat_window(tokens, window)
    x = np.log2(np.asarray(tokens, float)[inside])
    gaps = mean_curve(loss[inside], weight) - mean_curve(reference[inside], weight)
    slope = float(_slopes(x, gaps[:, None])[0])
    replicates = _slopes(x, replicate_curves(loss[inside], weight, samples=samples, seed=seed,
                                             reference=reference[inside]))
    seeds = loss.shape[1]
    lo, hi = interval(slope, replicates, seeds, 0.95)
    lo90, hi90 = interval(slope, replicates, seeds, 0.90)
    return {"slope": slope, "lo": lo, "hi": hi, "lo90": lo90, "hi90": hi90,
            "budgets": np.asarray(tokens, float)[inside].tolist(), "gap": gaps.tolist()}


def is_flat(slope: Mapping, margin: float) -> bool:
    """The gap has stopped moving: the slope's 90% interval lies within +-margin (nats per
    doubling), two one-sided 5% tests as the study's equivalence. A slope that cannot be told
    from 0 is not flat by that alone: too few seeds give an interval wider than the margin,
    and then the end state is not decided."""
    if margin <= 0:
        raise ValueError(f"the slope margin must be > 0, got {margin}")
    return -margin < slope["lo90"] and slope["hi90"] < margin


# --------------------------------------------------------------------------- power


def _t_quantile(q: float, df: int) -> float:
    from scipy import stats

    return float(stats.t.ppf(q, df))


def tost_power(seeds: int, sd: float, margin: float, *, alpha: float = 0.05, difference: float = 0.0) -> float:
    """P(a paired TOST at `alpha` declares equivalence within +-margin) with `seeds` seeds whose
    paired differences have sd `sd` and mean `difference`: the interval D +- t(1-alpha, S-1) s/sqrt(S)
    inside (-margin, margin), with D ~ N(difference, sd^2/S) and s the seeds' sample sd, independent.

    Exact: for a given s, D must lie in (-margin + t s/sqrt(S), margin - t s/sqrt(S)) (empty once
    t s/sqrt(S) >= margin); that probability is integrated over s's scaled chi distribution."""
    from scipy import integrate, stats

    if seeds < 2:
        return 0.0
    df, t = seeds - 1, _t_quantile(1 - alpha, seeds - 1)
    se = sd / math.sqrt(seeds)
    v_max = df * (margin * math.sqrt(seeds) / (t * sd)) ** 2   # beyond it the interval is empty

    def given(v: float) -> float:
        half = margin - t * sd * math.sqrt(v / df) / math.sqrt(seeds)
        inside = stats.norm.cdf((half - difference) / se) - stats.norm.cdf((-half - difference) / se)
        return float(inside) * float(stats.chi2.pdf(v, df))

    return float(integrate.quad(given, 0.0, v_max, limit=200)[0])


def difference_power(seeds: int, sd: float, difference: float, *, alpha: float = 0.05) -> float:
    """P(a paired two-sided t test at `alpha` finds a difference) with `seeds` seeds whose
    paired differences have sd `sd` and mean `difference`: noncentral t with S-1 degrees of
    freedom and noncentrality difference sqrt(S)/sd."""
    from scipy import stats

    if seeds < 2:
        return 0.0
    df, t = seeds - 1, _t_quantile(1 - alpha / 2, seeds - 1)
    nc = difference * math.sqrt(seeds) / sd
    return float(stats.nct.sf(t, df, nc) + stats.nct.cdf(-t, df, nc))


def seeds_needed(sd: float, margin: float, *, kind: str, power: float = 0.8, alpha: float = 0.05,
                 max_seeds: int = 500) -> int | None:
    """The fewest seeds (>= 2) at which the test reaches `power`: kind "equivalence" (TOST
    within +-margin when the true difference is 0) or "difference" (two-sided t when the true
    difference is `margin`). None when more than `max_seeds` would be needed."""
    if kind not in ("equivalence", "difference"):
        raise ValueError(f"kind must be 'equivalence' or 'difference', got {kind!r}")
    test = (lambda n: tost_power(n, sd, margin, alpha=alpha)) if kind == "equivalence" else \
        (lambda n: difference_power(n, sd, margin, alpha=alpha))
    lo, hi = 2, 2
    while test(hi) < power:     # doubling, then bisection: power rises with the seeds
        if hi >= max_seeds:
            return None
        lo, hi = hi + 1, min(2 * hi, max_seeds)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if test(mid) >= power else (mid + 1, hi)
    return hi


def power_table(sds: Sequence[float], margin: float, *, power: float = 0.8, alpha: float = 0.05,
                max_seeds: int = 500) -> list[dict]:
    """Per paired seed sd: the seeds an equivalence and a difference verdict need at `margin`
    (None: more than `max_seeds`)."""
    return [{"sd": float(sd), "margin": float(margin),
             "equivalence": seeds_needed(sd, margin, kind="equivalence", power=power, alpha=alpha,
                                         max_seeds=max_seeds),
             "difference": seeds_needed(sd, margin, kind="difference", power=power, alpha=alpha,
                                        max_seeds=max_seeds)}
            for sd in sds]


def simulated_verdicts(seeds: int, sd: float, margin: float, *, difference: float = 0.0, trials: int = 2000,
                       items: int = 200, item_sd: float = 0.0, samples: int = 2000, seed: int = 0) -> dict[str, float]:
    """How often the study's own `compare` (seed x item bootstrap, t-scaled intervals, TOST at
    `margin`) gives each verdict when `seeds` paired seeds differ by `difference` on average
    with sd `sd` per seed, over `trials` simulated comparisons: {verdict: fraction}.

    Each trial draws a per-seed difference N(difference, sd^2) and, per item (`items`, 100
    predictions each), a further N(0, item_sd^2) per prediction on the scheme's side, on
    top of a reference loss of 5 nats per prediction. item_sd 0: the seeds' spread alone, the
    case the power table's formulas (`tost_power`, `difference_power`) describe."""
    from roformer.study.stats import compare

    rng = np.random.default_rng(seed)
    weight = np.full(items, 100.0)
    reference = np.full((seeds, items), 5.0) * weight
    counts: dict[str, int] = {}
    for _ in range(trials):
        per_seed = rng.normal(difference, sd, seeds)[:, None] + rng.normal(0.0, item_sd, (seeds, items))
        verdict = compare(reference + per_seed * weight, reference, weight, margin=margin, samples=samples,
                          seed=seed)["verdict"]
        counts[verdict] = counts.get(verdict, 0) + 1
    return {verdict: n / trials for verdict, n in sorted(counts.items())}


# --------------------------------------------------------------------------- verdicts


def rate_at_grid_edge(rate: float, grid: Sequence[float]) -> bool:
    """The chosen rate is the grid's lowest or highest (of more than one): the optimum may lie
    beyond it, so the scheme's loss is an upper bound on its best, not its best."""
    return len(grid) > 1 and rate in (min(grid), max(grid))


def end_state_verdict(comparison: Mapping, *, scheme: str, reference: str, flat: bool,
                      edge_schemes: Sequence[str] = (), uses_order: Mapping[str, bool]) -> dict:
    """The end-state verdict of `scheme` against `reference` at the last budget.

    comparison: roformer.study.stats.compare's dict there (its verdict read at the
    pre-registered margin). Rules, in order:
    - "not decided" when a chosen rate of either scheme is at its grid's edge (`edge_schemes`,
      from `rate_at_grid_edge` at any budget read): the difference would compare a scheme's
      best with another's bound;
    - "not decided" when the gap is not flat (`is_flat`): the last budget is not the end state;
    - else compare's verdict ("higher", "lower", "equivalent", "undecided").
    The flag: an "equivalent" verdict where a scheme does not use word order (`uses_order`, from
    the study's shuffle gap / order-horizon spectrum at the end) says nothing about positions:
    two order-blind models tie because neither uses the scheme at all.

    {"verdict", "reasons": why not decided (empty when decided), "flag": text or None}."""
    reasons = [f"{s}'s chosen rate is at the edge of its grid" for s in (scheme, reference) if s in edge_schemes]
    if not flat:
        reasons.append("the gap is still moving over the last quarter of the budgets (not flat)")
    verdict = "not decided" if reasons else str(comparison["verdict"])
    flag = None
    if str(comparison["verdict"]).startswith("equivalent"):
        blind = [s for s in (scheme, reference) if not uses_order[s]]
        if len(blind) == 2:
            flag = f"neither {scheme} nor {reference} uses word order: the tie compares two order-blind models"
        elif blind:
            flag = (f"{blind[0]} does not use word order: the tie says order bought nothing in this regime, "
                    "not that the two position schemes work alike")
    return {"verdict": verdict, "reasons": reasons, "flag": flag}
