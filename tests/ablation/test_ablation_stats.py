"""roformer.ablation.stats: means over seeds and paired differences with 95% t-intervals."""
import numpy as np
import pytest
from scipy import stats

from roformer.ablation import stats as ablation_stats

pytestmark = pytest.mark.fast   # the fast lane (docs/testing.md)


def test_paired_difference_exceeds_only_beyond_the_seed_spread():
    noise = {0: 0.03, 1: -0.02, 2: 0.01, 3: -0.04}
    reference = {0: 5.0, 1: 5.2, 2: 4.9, 3: 5.1, 4: 5.0}   # seed 4 has no partner: left out
    half = stats.t.ppf(0.975, df=3) * np.std(list(noise.values()), ddof=1) / 2   # about 0.05
    for shift, exceeds in ((0.0, False), (0.03, False), (0.2, True), (-0.2, True)):
        values = {s: reference[s] + shift + n for s, n in noise.items()}
        d = ablation_stats.paired_difference(values, reference)
        mean = shift + np.mean(list(noise.values()))
        assert (d["diff"], d["lo"], d["hi"]) == pytest.approx((mean, mean - half, mean + half))
        assert d["n"] == 4 and d["exceeds"] is exceeds
    # One common seed: a difference but no interval; missing values are skipped.
    assert ablation_stats.paired_difference({0: 2.0, 1: None}, {0: 1.5, 1: 1.0}) == \
        {"diff": 0.5, "lo": None, "hi": None, "n": 1, "exceeds": None}
    assert ablation_stats.paired_difference({0: None}, {0: 1.0}) is None


def test_mean_std_and_t_critical():
    assert ablation_stats.mean_std([1.0, None, 3.0, float("nan")]) == {"mean": 2.0, "std": pytest.approx(2 ** 0.5), "n": 2}
    assert ablation_stats.mean_std([5.0]) == {"mean": 5.0, "std": None, "n": 1}
    assert ablation_stats.mean_std([None]) is None
    assert ablation_stats.t_critical(4) == pytest.approx(stats.t.ppf(0.975, 4))
