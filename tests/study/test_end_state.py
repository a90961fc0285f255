"""The end-state protocol's statistics (roformer.study.end_state): M(T), the flat test, the
power table (checked against a simulation) and the verdict rules."""
import math

import numpy as np
import pytest
from scipy import stats

from roformer.errors import ConfigError
from roformer.study import end_state

TOKENS = 1e6 * 2.0 ** np.arange(8)       # a doubling grid, 1M..128M tokens


def power_law(tokens, shift=1.0, a=3.0, c=0.1):
    """A loss curve L(T) = a (T/shift)^-c: the curve of a model that needs `shift` x the tokens."""
    return a * (np.asarray(tokens) / shift) ** -c


WEIGHT = np.random.default_rng(99).integers(5, 15, size=40).astype(float)   # predictions per test item


def curves(mean: np.ndarray, seeds: int = 6, seed_sd: float = 0.0, rng=None) -> tuple:
    """loss [budgets, seeds, items] summed per item and weight [items] whose mean curve is
    `mean` times each seed's factor exp(N(0, seed_sd)), constant over the budgets."""
    rng = rng or np.random.default_rng(0)
    weight = WEIGHT
    factor = np.exp(rng.normal(0, seed_sd, size=seeds)) if seed_sd else np.ones(seeds)
    loss = mean[:, None, None] * factor[None, :, None] * weight[None, None, :]
    return loss, weight


@pytest.mark.parametrize("shift", [2.0, 1.5, 3.7])
def test_crossing_is_exact_for_power_laws_between_budgets(shift):
    # Log-log interpolation is exact on power laws; linear interpolation in tokens is not at 1.5.
    targets = power_law(TOKENS[:5])
    needed, status = end_state.crossing(TOKENS, power_law(TOKENS, shift)[:, None].repeat(5, 1), targets)
    assert list(status) == [end_state.REACHED] * 5
    np.testing.assert_allclose(needed / TOKENS[:5], shift, rtol=1e-9)


def test_crossing_is_censored_outside_the_budgets_and_takes_the_first_crossing():
    curve = power_law(TOKENS, 2.0)
    needed, status = end_state.crossing(TOKENS, np.stack([curve] * 3, 1),
                                        np.array([power_law(TOKENS[-1]), 10.0, power_law(TOKENS[3], 2.0)]))
    assert status[0] == end_state.NEVER and math.isnan(needed[0])      # needs 256M > the last budget
    assert status[1] == end_state.BEFORE and math.isnan(needed[1])     # below the target at the first
    assert status[2] == end_state.REACHED and needed[2] == pytest.approx(TOKENS[3])
    bumpy = curve.copy()
    bumpy[5] = 10.0                                                    # dips below, then rises
    needed, _ = end_state.crossing(TOKENS, bumpy[:, None], np.array([power_law(TOKENS[3], 2.0)]))
    assert needed[0] == pytest.approx(TOKENS[3])


def test_a_curve_not_finite_before_its_crossing_is_not_placed():
    curve = power_law(TOKENS, 2.0)
    curve[2] = np.nan                                                  # a member diverged there
    needed, status = end_state.crossing(TOKENS, np.stack([curve, curve], 1),
                                        np.array([power_law(TOKENS[3], 2.0), power_law(TOKENS[0], 2.0)]))
    assert status[0] == end_state.DIVERGED and math.isnan(needed[0])
    assert status[1] == end_state.BEFORE                               # reached before the NaN


def test_multiplier_curve_reads_a_steady_multiplier_and_censors_the_last_budgets():
    reference, weight = curves(power_law(TOKENS))
    scheme, _ = curves(power_law(TOKENS, 2.0))
    rows = end_state.multiplier_curve(TOKENS, scheme, TOKENS, reference, weight, samples=200)
    for row in rows[:-1]:
        assert row["status"] == end_state.REACHED and row["multiplier"] == pytest.approx(2.0)
    assert rows[-1]["status"] == end_state.NEVER and math.isnan(rows[-1]["multiplier"])
    # A scheme trained past the reference's last budget measures M there too.
    longer = 1e6 * 2.0 ** np.arange(9)
    scheme, _ = curves(power_law(longer, 2.0))
    assert end_state.multiplier_curve(longer, scheme, TOKENS, reference, weight, samples=200)[-1][
        "multiplier"] == pytest.approx(2.0)


def test_multiplier_interval_covers_the_true_multiplier():
    # Seeds shift each curve by a factor; over independent data sets, the 95% interval of
    # M(T) at a middle budget covers the true 1.5 in most of them (nominal 95%).
    covered, widths = 0, []
    for trial in range(30):
        rng = np.random.default_rng(trial)
        reference, weight = curves(power_law(TOKENS), seeds=8, seed_sd=0.01, rng=rng)
        scheme, _ = curves(power_law(TOKENS, 1.5), seeds=8, seed_sd=0.01, rng=rng)
        row = end_state.multiplier_curve(TOKENS, scheme, TOKENS, reference, weight, samples=300, seed=trial)[3]
        covered += row["lo"] < 1.5 < row["hi"]
        widths.append(row["hi"] - row["lo"])
    assert covered >= 25 and min(widths) > 0


def test_multiplier_interval_is_open_when_a_replicate_does_not_cross():
    # The scheme barely reaches the reference's last-but-one loss: some resampled curves do not.
    rng = np.random.default_rng(1)
    reference, weight = curves(power_law(TOKENS), seeds=6, seed_sd=0.03, rng=rng)
    scheme, _ = curves(power_law(TOKENS, 1.9), seeds=6, seed_sd=0.03, rng=rng)
    row = end_state.multiplier_curve(TOKENS, scheme, TOKENS, reference, weight, samples=300)[6]
    assert row["censored"] > 0 and math.isnan(row["lo"]) and math.isnan(row["hi"])


def test_mismatched_seeds_or_items_are_refused():
    reference, weight = curves(power_law(TOKENS), seeds=6)
    scheme, _ = curves(power_law(TOKENS), seeds=5)
    with pytest.raises(ValueError, match="seeds, items"):
        end_state.multiplier_curve(TOKENS, scheme, TOKENS, reference, weight, samples=10)


# --------------------------------------------------------------------------- flat test


def test_the_window_is_the_last_quarter_of_log_tokens():
    assert end_state.window_budgets(TOKENS).tolist() == [6, 7]          # log2 >= 7 - 7/4
    assert end_state.window_budgets(TOKENS, 0.5).tolist() == [4, 5, 6, 7]
    with pytest.raises(ConfigError, match="add a budget") as error:
        end_state.check_flat_window([1e6, 1e7, 1e8])
    assert "\n" not in str(error.value)


def gap_curves(slope: float, seeds: int = 8, seed_sd: float = 0.005, rng=None):
    """Reference on a power law; scheme = reference + 0.1 + slope x log2(T/T0) + per-seed noise at
    every budget (nats per prediction)."""
    rng = rng or np.random.default_rng(0)
    reference, weight = curves(power_law(TOKENS), seeds=seeds, rng=rng)
    gap = 0.1 + slope * np.log2(TOKENS / TOKENS[0])
    noise = rng.normal(0, seed_sd, size=(len(TOKENS), seeds))
    scheme = reference + (gap[:, None] + noise)[:, :, None] * weight[None, None, :]
    return scheme, reference, weight


def test_gap_slope_is_the_least_squares_slope_per_doubling():
    scheme, reference, weight = gap_curves(0.03, seed_sd=0.0)
    result = end_state.gap_slope(TOKENS, scheme, reference, weight, samples=100)
    assert result["slope"] == pytest.approx(0.03)
    assert result["budgets"] == TOKENS[[6, 7]].tolist()


def test_flat_needs_the_slopes_interval_inside_the_margin():
    flat = end_state.gap_slope(TOKENS, *gap_curves(0.0), samples=400)
    moving = end_state.gap_slope(TOKENS, *gap_curves(0.05), samples=400)
    noisy = end_state.gap_slope(TOKENS, *gap_curves(0.0, seeds=3, seed_sd=0.05), samples=400)
    assert end_state.is_flat(flat, 0.02)
    assert not end_state.is_flat(moving, 0.02)
    assert not end_state.is_flat(noisy, 0.02)          # too few seeds to tell: not flat
    assert flat["lo90"] > flat["lo"] and flat["hi90"] < flat["hi"]
    with pytest.raises(ValueError, match="slope margin"):
        end_state.is_flat(flat, 0.0)


# --------------------------------------------------------------------------- power


def simulated_power(seeds: int, sd: float, margin: float, kind: str, runs: int = 40000, alpha: float = 0.05):
    """Paired-seed tests run on normal differences: mean 0 for equivalence (TOST at alpha),
    mean `margin` for difference (two-sided t at alpha)."""
    rng = np.random.default_rng(seeds)
    d = rng.normal(0.0 if kind == "equivalence" else margin, sd, size=(runs, seeds))
    mean, se = d.mean(1), d.std(1, ddof=1) / math.sqrt(seeds)
    if kind == "equivalence":
        t = stats.t.ppf(1 - alpha, seeds - 1)
        return float(np.mean((mean - t * se > -margin) & (mean + t * se < margin)))
    t = stats.t.ppf(1 - alpha / 2, seeds - 1)
    return float(np.mean(np.abs(mean / se) > t))


@pytest.mark.parametrize("seeds, sd, margin", [(8, 0.05, 0.05), (15, 0.05, 0.04), (5, 0.02, 0.03)])
def test_power_formulas_match_a_simulation(seeds, sd, margin):
    tolerance = 4 * math.sqrt(0.25 / 40000)
    assert end_state.tost_power(seeds, sd, margin) == pytest.approx(
        simulated_power(seeds, sd, margin, "equivalence"), abs=tolerance)
    assert end_state.difference_power(seeds, sd, margin) == pytest.approx(
        simulated_power(seeds, sd, margin, "difference"), abs=tolerance)


@pytest.mark.parametrize("kind", ["equivalence", "difference"])
def test_seeds_needed_is_the_fewest_that_reach_the_power(kind):
    n = end_state.seeds_needed(0.05, 0.05, kind=kind)
    power = end_state.tost_power if kind == "equivalence" else end_state.difference_power
    assert power(n, 0.05, 0.05) >= 0.8 > power(n - 1, 0.05, 0.05)
    assert simulated_power(n, 0.05, 0.05, kind) > 0.8 - 4 * math.sqrt(0.25 / 40000)
    assert end_state.seeds_needed(0.05, 0.001, kind=kind, max_seeds=50) is None


def test_power_falls_with_the_seed_sd_and_rises_with_the_margin_and_the_seeds():
    assert end_state.tost_power(8, 0.05, 0.02) < end_state.tost_power(8, 0.03, 0.02) < end_state.tost_power(
        8, 0.03, 0.05) < end_state.tost_power(16, 0.03, 0.05)
    # Once t x sd / sqrt(S) exceeds the margin for almost every sample sd, TOST cannot fire.
    assert end_state.tost_power(8, 0.07, 0.02) < 0.01
    table = end_state.power_table([0.03, 0.05], 0.05)
    assert [row["sd"] for row in table] == [0.03, 0.05]
    assert table[0]["equivalence"] < table[1]["equivalence"]


# --------------------------------------------------------------------------- verdicts


def comparison(verdict: str) -> dict:
    return {"diff": 0.0, "lo": -0.01, "hi": 0.01, "lo90": -0.008, "hi90": 0.008, "verdict": verdict}


ORDER = {"rope": True, "learned": True, "alibi": False, "none": False}


def test_rate_at_grid_edge():
    assert end_state.rate_at_grid_edge(1e-3, [1e-3, 2e-3, 4e-3])
    assert end_state.rate_at_grid_edge(4e-3, [1e-3, 2e-3, 4e-3])
    assert not end_state.rate_at_grid_edge(2e-3, [1e-3, 2e-3, 4e-3])
    assert not end_state.rate_at_grid_edge(1e-3, [1e-3])


def test_a_rate_at_the_edge_or_a_moving_gap_is_not_decided():
    edge = end_state.end_state_verdict(comparison("lower"), scheme="learned", reference="rope", flat=True,
                                       edge_schemes=["learned"], uses_order=ORDER)
    moving = end_state.end_state_verdict(comparison("lower"), scheme="learned", reference="rope", flat=False,
                                         uses_order=ORDER)
    decided = end_state.end_state_verdict(comparison("lower"), scheme="learned", reference="rope", flat=True,
                                          edge_schemes=["alibi"], uses_order=ORDER)
    assert edge["verdict"] == moving["verdict"] == "not decided"
    assert "learned's chosen rate" in edge["reasons"][0] and "not flat" in moving["reasons"][0]
    assert decided == {"verdict": "lower", "reasons": [], "flag": None}


def test_an_equivalence_without_order_is_flagged():
    both = end_state.end_state_verdict(comparison("equivalent"), scheme="alibi", reference="none", flat=True,
                                       uses_order=ORDER)
    one = end_state.end_state_verdict(comparison("equivalent (nonzero)"), scheme="alibi", reference="rope",
                                      flat=True, uses_order=ORDER)
    ordered = end_state.end_state_verdict(comparison("equivalent"), scheme="learned", reference="rope", flat=True,
                                          uses_order=ORDER)
    assert both["verdict"] == "equivalent" and "neither alibi nor none" in both["flag"]
    assert one["flag"].startswith("alibi does not use word order")
    assert ordered["flag"] is None
    # The flag stays when the verdict itself is withheld: the reader still learns why.
    assert end_state.end_state_verdict(comparison("equivalent"), scheme="alibi", reference="none", flat=False,
                                       uses_order=ORDER)["flag"]


def test_the_studys_own_compare_declares_equivalence_about_as_often_as_the_paired_t_tost():
    """scripts/equivalence_power_sim.py's simulation: the bootstrap's verdicts against the exact
    formula at a true difference of 0, and no "equivalent" at twice the margin."""
    trials = 400
    verdicts = end_state.simulated_verdicts(6, 0.05, 0.05, trials=trials, items=20, samples=500)
    equivalent = sum(v for k, v in verdicts.items() if k.startswith("equivalent"))
    assert equivalent == pytest.approx(end_state.tost_power(6, 0.05, 0.05), abs=4 * math.sqrt(0.25 / trials))
    assert sum(verdicts.values()) == pytest.approx(1.0)
    apart = end_state.simulated_verdicts(6, 0.03, 0.05, difference=0.1, trials=100, items=20, samples=500)
    assert not any(k.startswith("equivalent") for k in apart) and apart["higher"] > 0.9
