"""The comparison re-read at equal wall-clock time beside equal tokens.

M(T) and the budget tables compare schemes at equal tokens. A scheme whose step is slower
(relative attention terms, a bias table) reads fewer tokens in the same time, so at equal time
its curve is read at fewer tokens. Each scheme's training throughput is measured in its own
group (roformer.study.groups: tokens per second over every training chunk but the first, which
compiled the program, all members at once); a member's throughput is that over the group's
members, since the members train in one vmapped program.

Against the reference, with `ratio` = the scheme's throughput over the reference's (both
measured on the same device kind; records from different devices are not compared):

- the loss at equal time (`equal_time_rows`): at each reference budget T, the reference ran for
  T / r_ref seconds, in which the scheme reads T x ratio tokens; its loss there is read off its
  own budget curve, interpolated linearly in log tokens and log loss (the M(T) crossing's rule,
  `loss_at`), never extrapolated past its first or last budget;
- the time multiplier M(T) / ratio: the time the scheme needs to reach the reference's loss at
  T, over the time the reference took.

The throughput is one measurement per scheme, taken as fixed: the intervals are the seed x item
bootstrap's over the losses only.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from roformer.study.end_state import mean_curve, replicate_curves
from roformer.study.stats import interval


def member_throughput(record: Mapping) -> float | None:
    """Training tokens per second of one member of the scheme's own group (not the group beyond
    the grid's edges, which has other members); None for a record without the measure."""
    timing = record.get("timing", {})
    members = len(record["members"]) - record.get("edges", {}).get("members", 0)
    rate = timing.get("tokens_per_s")
    return float(rate) / members if rate and members > 0 else None


def loss_at(tokens: Sequence[float], curves: np.ndarray, at: np.ndarray | float) -> np.ndarray:
    """Each curve's loss at `at` tokens: curves [budgets, R] (positive, at increasing `tokens`),
    `at` a scalar or [R]. Log loss is interpolated linearly in log tokens between the two
    budgets that bracket `at` (a power law is a line there); nan outside the budgets (no
    extrapolation) and where a bracketing budget is not finite."""
    tokens = np.asarray(tokens, float)
    curves = np.asarray(curves, float)
    if curves.ndim == 1:
        curves = curves[:, None]
    at = np.broadcast_to(np.asarray(at, float), curves.shape[1:])
    if np.any(np.diff(tokens) <= 0) or tokens[0] <= 0:
        raise ValueError(f"budgets must be positive and increasing, got {tokens.tolist()}")
    out = np.full(curves.shape[1:], math.nan)
    log_t = np.log(tokens)
    inside = (at >= tokens[0] * (1 - 1e-12)) & (at <= tokens[-1] * (1 + 1e-12))
    for r in np.flatnonzero(inside):
        x = min(max(math.log(at[r]), log_t[0]), log_t[-1])
        k = int(np.clip(np.searchsorted(log_t, x), 1, len(tokens) - 1))
        l0, l1 = curves[k - 1, r], curves[k, r]
        if not (l0 > 0 and l1 > 0 and math.isfinite(l0) and math.isfinite(l1)):
            continue
        fraction = (x - log_t[k - 1]) / (log_t[k] - log_t[k - 1])
        out[r] = math.exp(math.log(l0) + fraction * (math.log(l1) - math.log(l0)))
    return out


def equal_time_rows(tokens: Sequence[float], loss: np.ndarray, reference_tokens: Sequence[float],
                    reference: np.ndarray, weight: np.ndarray, ratio: float, *, samples: int,
                    seed: int = 0, level: float = 0.95) -> list[dict]:
    """Per reference budget T: the scheme's loss after the reference's time to T (T x `ratio`
    tokens of it, `ratio` its throughput over the reference's) minus the reference's at T, with
    the seed x item bootstrap's interval at `level` (both curves resample the same seeds and
    items, so each replicate is a paired pair of curves).

    loss [budgets, seeds, items] at `tokens`, reference [reference budgets, seeds, items],
    seeds paired. Each row: {"tokens": T, "scheme_tokens": T x ratio, "reference_loss",
    "loss": the scheme's there (nan outside its budgets), "diff", "lo", "hi"}."""
    if loss.shape[1:] != reference.shape[1:]:
        raise ValueError(f"the scheme's [seeds, items] {loss.shape[1:]} are not the reference's {reference.shape[1:]}")
    if not (math.isfinite(ratio) and ratio > 0):
        raise ValueError(f"the throughput ratio must be > 0, got {ratio}")
    seeds = loss.shape[1]
    scheme_point = mean_curve(loss, weight)
    reference_point = mean_curve(reference, weight)
    scheme_reps = replicate_curves(loss, weight, samples=samples, seed=seed)
    reference_reps = replicate_curves(reference, weight, samples=samples, seed=seed)
    rows = []
    for b, t in enumerate(np.asarray(reference_tokens, float)):
        at = t * ratio
        point = float(loss_at(tokens, scheme_point, at)[0])
        diff = point - float(reference_point[b])
        replicates = loss_at(tokens, scheme_reps, at) - reference_reps[b]
        lo, hi = interval(diff, replicates, seeds, level) if math.isfinite(diff) else (math.nan, math.nan)
        rows.append({"tokens": float(t), "scheme_tokens": float(at), "reference_loss": float(reference_point[b]),
                     "loss": point, "diff": diff, "lo": lo, "hi": hi})
    return rows
