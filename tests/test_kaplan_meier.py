"""The two Kaplan-Meier curves (the ablation's fraction started, the study's onset curve) are
scipy.stats.ecdf's on right-censored data, and give what the hand-written product gave."""
import numpy as np
import pytest
from scipy import stats

from roformer.ablation import onset
from roformer.study import stats as study_stats


def reference_fraction_started(times, started):
    """The product-limit estimate as the project wrote it by hand: at each distinct onset t,
    survival *= 1 - onsets at t / runs with time >= t."""
    survival, points = 1.0, []
    for t in sorted({t for t, s in zip(times, started) if s}):
        at_risk = sum(1 for u in times if u >= t)
        events = sum(1 for u, s in zip(times, started) if s and u == t)
        survival *= 1.0 - events / at_risk
        points.append((t, at_risk, events, 1.0 - survival))
    return points


def censored_cases(count=200, seed=0):
    """Small samples with many ties (times drawn from few values), onsets and censorings mixed,
    including all-censored and all-started samples."""
    rng = np.random.default_rng(seed)
    for _ in range(count):
        n = int(rng.integers(1, 12))
        times = rng.integers(0, 6, n) * 1000
        started = rng.random(n) < rng.choice([0.0, 0.3, 0.7, 1.0])
        yield times.tolist(), started.tolist()


def test_fraction_started_matches_the_hand_written_estimate_on_random_censored_samples():
    for times, started in censored_cases():
        points = onset.fraction_started(zip(times, started))
        expected = reference_fraction_started(times, started)
        assert [(p["tokens"], p["at_risk"], p["started"]) for p in points] == [e[:3] for e in expected]
        np.testing.assert_allclose([p["fraction"] for p in points], [e[3] for e in expected], rtol=0, atol=1e-15)


def test_the_study_onset_curve_matches_the_hand_written_estimate_on_random_censored_samples():
    grid = np.arange(-500, 6500, 250)
    for times, started in censored_cases(seed=1):
        expected = np.zeros(len(grid))
        for t, _, _, fraction in reference_fraction_started(times, started):
            expected[grid >= t] = fraction
        curve = study_stats.kaplan_meier(np.array(times), np.array(started, bool), grid)
        np.testing.assert_allclose(curve, expected, rtol=0, atol=1e-15)


@pytest.mark.parametrize("estimate", [
    lambda: onset.fraction_started([(1, True), (2, False), (3, True)]),
    lambda: study_stats.kaplan_meier(np.array([1, 2, 3]), np.array([True, False, True]), np.array([0, 3])),
])
def test_both_curves_are_scipys_estimator(monkeypatch, estimate):
    calls, real = [], stats.ecdf

    def spy(sample):
        calls.append(sample)
        return real(sample)
    monkeypatch.setattr(stats, "ecdf", spy)
    estimate()
    assert len(calls) == 1 and isinstance(calls[0], stats.CensoredData)
    assert calls[0].num_censored() == 1
