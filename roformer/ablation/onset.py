"""When each run starts to use word order, read off its held-out evaluations.

A run "uses word order" from the first evaluation at which shuffling the tokens of each
held-out document raises its loss by at least `threshold` nats (the order gap; the
ablation's `order_threshold`). Runs are the ablation's rows (`scheme`, `seed`, `status`
and `curve`, the per-evaluation points of `roformer.ablation.collect.eval_curve`).

- Per run: the onset in tokens, or, for a run that has not started yet, the tokens of its
  last evaluation: a censored observation (it may start later; a study still running, or
  one whose budget ran out first, does not know).
- Per scheme: the fraction of its seeds that have started as a function of tokens, with
  censoring, as a Kaplan-Meier estimate (1 - the survival function of "not started yet").
  With every run evaluated to the full budget it is the plain fraction of seeds started by
  t; while runs are still going it does not count a run that has not got to t yet as one
  that never started.
- Held-out loss at matched token counts, each scheme against the reference scheme, paired
  by seed with a 95% interval, so the comparison can be read before and after the other
  schemes start.
- Whether each scheme is still catching up with the reference at the end of the budget:
  the slope of its loss difference to the reference over the last quarter of the
  evaluations, per seed, with a 95% interval over seeds. An interval below 0 says the gap
  is still closing (the budget has not decided the comparison); one inside a small band
  around 0 says the curves run parallel there; a wide one that includes 0 cannot say yet.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence

from roformer.ablation.stats import finite, paired_difference

ORDER_KEY = "eval_order_gap"
# A held-out loss this far (nats) above the run's best so far is a loss spike; evaluations of
# one run move by a few hundredths from one to the next.
SPIKE_NATS = 0.2
# The gap trend is fitted over this last share of the common evaluations, in nats per this many tokens.
TREND_FRACTION = 0.25
TREND_TOKENS = 10_000_000
MIN_TREND_POINTS = 3
# Curves run parallel when the whole interval of the slope lies within this many nats per
# TREND_TOKENS: over the onset study's last quarter (10M tokens) about the seed-to-seed spread
# of its closest schemes' final losses.
PARALLEL_SLOPE = 0.05


def run_onset(curve: Sequence[Mapping], threshold: float, key: str = ORDER_KEY) -> dict:
    """`{"started", "onset_tokens", "onset_step", "last_tokens", "sustained"}` of one run.

    `onset_tokens` is None for a run whose gap has not reached `threshold` at any
    evaluation; `last_tokens` is its last evaluated token count (where it is censored).
    `sustained` says whether the gap stayed at or above the threshold at every later
    evaluation (a run that crosses and falls back is started, and said to have fallen back)."""
    points = [p for p in curve if finite(p.get(key))]
    last = points[-1]["tokens"] if points else None
    for i, point in enumerate(points):
        if point[key] >= threshold:
            return {"started": True, "onset_tokens": point["tokens"], "onset_step": point["step"],
                    "last_tokens": last, "sustained": all(p[key] >= threshold for p in points[i:])}
    return {"started": False, "onset_tokens": None, "onset_step": None, "last_tokens": last,
            "sustained": None}


def loss_spike(curve: Sequence[Mapping], rise: float = SPIKE_NATS, key: str = "eval_loss") -> dict | None:
    """The first evaluation whose held-out loss is at least `rise` nats above the run's best so
    far (a loss spike: the divergence guard stops only runs whose loss leaves its range, a
    jump back to the unigram level stays inside it), or None. `{"step", "tokens", "rise",
    "recovered"}`: `recovered` says whether a later evaluation came back within `rise` of the
    best before the spike."""
    points = [p for p in curve if finite(p.get(key))]
    best = math.inf
    for i, point in enumerate(points):
        if point[key] >= best + rise:
            later = [p[key] for p in points[i + 1:]]
            return {"step": point["step"], "tokens": point["tokens"], "rise": point[key] - best,
                    "recovered": any(v < best + rise for v in later)}
        best = min(best, point[key])
    return None


def fraction_started(observations: Iterable[tuple[float, bool]]) -> list[dict]:
    """Kaplan-Meier estimate of the fraction of runs started by each event time.

    `observations` are (tokens, started): the onset of a run that started, or the last
    evaluation of one that has not (censored there). Returns one point per distinct onset:
    `tokens`, `at_risk` (runs not started and still observed just before), `started` (onsets
    there) and `fraction` (scipy.stats.ecdf's estimate on the right-censored sample)."""
    from scipy import stats   # on first use: the ablation's other commands do not need it

    obs = list(observations)
    onsets = sorted({t for t, started in obs if started})
    if not onsets:
        return []
    sample = stats.CensoredData(uncensored=[t for t, started in obs if started],
                                right=[t for t, started in obs if not started])
    fractions = stats.ecdf(sample).cdf.evaluate(onsets)
    return [{"tokens": tokens, "at_risk": sum(1 for t, _ in obs if t >= tokens),
             "started": sum(1 for t, started in obs if started and t == tokens), "fraction": float(fraction)}
            for tokens, fraction in zip(onsets, fractions)]


def median_onset(points: Sequence[Mapping]) -> float | None:
    """Tokens at which the estimated fraction started first reaches one half (None: not yet)."""
    return next((p["tokens"] for p in points if p["fraction"] >= 0.5), None)


def scheme_onsets(runs: Sequence[Mapping], threshold: float) -> list[dict]:
    """Per scheme (in the runs' order): its runs' onsets, the censored ones, the estimated
    fraction started over tokens, the median onset and the range of the observed onsets.
    Runs that failed count with the evaluations they had (censored where they stopped)."""
    schemes = list(dict.fromkeys(r["scheme"] for r in runs))
    out = []
    for scheme in schemes:
        per_run = []
        for run in (r for r in runs if r["scheme"] == scheme):
            onset = run_onset(run.get("curve") or [], threshold)
            if onset["last_tokens"] is not None:
                per_run.append({"seed": run["seed"], "status": run.get("status"), **onset,
                                "loss_spike": loss_spike(run.get("curve") or [])})
        observations = [(o["onset_tokens"] if o["started"] else o["last_tokens"], o["started"]) for o in per_run]
        curve = fraction_started(observations)
        onsets = sorted(o["onset_tokens"] for o in per_run if o["started"])
        out.append({
            "scheme": scheme, "runs": per_run, "observed": len(per_run), "started": len(onsets),
            "onsets": onsets,
            "censored": sorted(o["last_tokens"] for o in per_run if not o["started"]),
            "fell_back": [o["seed"] for o in per_run if o["started"] and not o["sustained"]],
            "loss_spikes": [{"seed": o["seed"], **o["loss_spike"]} for o in per_run if o["loss_spike"]],
            "fraction_started": curve,
            "median_onset": median_onset(curve),
            "onset_range": [onsets[0], onsets[-1]] if onsets else None,
        })
    return out


def _point_at(curve: Sequence[Mapping], step: int) -> Mapping | None:
    return next((p for p in curve if p["step"] == step), None)


def _values_at(runs_by_seed: Mapping[int, Mapping], step: int, key: str) -> dict[int, float]:
    """{seed: the run's `key` at `step`} for the seeds that have a finite value there."""
    values = {s: (_point_at(r["curve"], step) or {}).get(key) for s, r in runs_by_seed.items()}
    return {s: v for s, v in values.items() if finite(v)}


def matched_steps(runs: Sequence[Mapping], fractions: Sequence[float] = (0.1, 0.25, 0.5, 1.0)) -> list[int]:
    """Evaluation steps every finished run has, nearest to these fractions of the longest
    finished curve (duplicates dropped, in order)."""
    curves = [r.get("curve") or [] for r in runs if r.get("status") == "done" and r.get("curve")]
    if not curves:
        return []
    common = sorted(set.intersection(*({p["step"] for p in c} for c in curves)))
    if not common:
        return []
    last = common[-1]
    chosen = [min(common, key=lambda s, f=f: abs(s - f * last)) for f in fractions]
    return list(dict.fromkeys(chosen))


def loss_at_matched_tokens(runs: Sequence[Mapping], reference: str, steps: Sequence[int],
                           key: str = "eval_loss") -> list[dict]:
    """Per scheme and step: the mean of `key` over its finished seeds and, for schemes other
    than `reference`, the paired difference to the reference (same seed) with a 95% t-interval."""
    done = [r for r in runs if r.get("status") == "done"]
    ref = {r["seed"]: r for r in done if r["scheme"] == reference}
    rows = []
    for scheme in dict.fromkeys(r["scheme"] for r in done):
        mine = {r["seed"]: r for r in done if r["scheme"] == scheme}
        cells = []
        for step in steps:
            values = _values_at(mine, step, key)
            tokens = next((p["tokens"] for r in mine.values() if (p := _point_at(r["curve"], step))), None)
            cells.append({"step": step, "tokens": tokens,
                          "mean": statistics.fmean(values.values()) if values else None, "n": len(values),
                          "vs_reference": None if scheme == reference
                          else paired_difference(values, _values_at(ref, step, key))})
        rows.append({"scheme": scheme, "cells": cells})
    return rows


def _slope(points: Sequence[tuple[float, float]]) -> float:
    """Least-squares slope of y over x."""
    mx = statistics.fmean(x for x, _ in points)
    my = statistics.fmean(y for _, y in points)
    return sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)


def gap_trend(runs: Sequence[Mapping], reference: str, key: str = "eval_loss",
              fraction: float = TREND_FRACTION) -> list[dict]:
    """Per scheme other than `reference` (finished runs, paired by seed): over the last
    `fraction` of the evaluation steps that the scheme's and the reference's runs share, the
    least-squares slope of (scheme - reference) `key` against tokens, in nats per
    TREND_TOKENS, each seed's own, then their mean with a 95% t-interval. `trend`: "closing"
    (interval below 0), "widening" (above 0), "parallel" (inside +-PARALLEL_SLOPE), "unclear"
    (includes 0 but reaches past that), None below two seeds.
    `closes_in_tokens`: with a closing gap, the tokens a straight line from the last common
    evaluation's mean gap at the mean slope takes to reach 0 (an extrapolation, not a forecast)."""
    done = [r for r in runs if r.get("status") == "done" and r.get("curve")]
    ref = {r["seed"]: r for r in done if r["scheme"] == reference}
    out = []
    for scheme in dict.fromkeys(r["scheme"] for r in done):
        if scheme == reference:
            continue
        mine = {r["seed"]: r for r in done if r["scheme"] == scheme and r["seed"] in ref}
        steps = [{p["step"] for p in r["curve"] if finite(p.get(key))} for r in (*mine.values(), *(ref[s] for s in mine))]
        common = sorted(set.intersection(*steps)) if steps else []
        window = [s for s in common if s >= (1 - fraction) * common[-1]] if common else []
        if len(window) < MIN_TREND_POINTS:
            continue
        slopes, last = {}, {}
        for seed, run in mine.items():
            diffs = [(p["tokens"], p[key] - _point_at(ref[seed]["curve"], s)[key])
                     for s in window for p in [_point_at(run["curve"], s)]]
            slopes[seed] = _slope(diffs) * TREND_TOKENS
            last[seed] = diffs[-1][1]
        slope = paired_difference(slopes, {seed: 0.0 for seed in slopes})
        gap = statistics.fmean(last.values())
        trend = None
        if slope is not None and slope["lo"] is not None:
            # Closing moves the gap toward 0: down for a scheme above the reference, up for one below.
            toward = -1 if gap >= 0 else 1
            moving = -1 if slope["hi"] < 0 else 1 if slope["lo"] > 0 else 0
            trend = ("closing" if moving == toward else "widening" if moving == -toward
                     else "parallel" if -PARALLEL_SLOPE <= slope["lo"] and slope["hi"] <= PARALLEL_SLOPE else "unclear")
        closes = abs(gap / slope["diff"]) * TREND_TOKENS if trend == "closing" else None
        ref_curve = ref[next(iter(mine))]["curve"]
        out.append({"scheme": scheme, "seeds": sorted(slopes), "from_step": window[0], "to_step": window[-1],
                    "from_tokens": _point_at(ref_curve, window[0])["tokens"],
                    "to_tokens": _point_at(ref_curve, window[-1])["tokens"],
                    "gap": gap, "slope": slope, "trend": trend, "closes_in_tokens": closes})
    return out


def summarize_onset(runs: Sequence[Mapping], *, reference: str, threshold: float) -> dict:
    """The onset section of the ablation report: per-scheme onsets and fractions started,
    the held-out loss at matched token counts against `reference`, and whether each scheme's
    gap to it is still closing at the end of the budget."""
    steps = matched_steps(runs)
    return {"threshold": threshold, "reference": reference, "schemes": scheme_onsets(runs, threshold),
            "matched_steps": steps, "loss_at_matched_tokens": loss_at_matched_tokens(runs, reference, steps),
            "gap_trend": gap_trend(runs, reference)}
