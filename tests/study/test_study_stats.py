"""The study's statistics (roformer/study/stats.py): the bootstrap intervals, TOST and
Holm's correction over a family, p-values, equivalence bounds, and the onsets."""
import numpy as np
import pytest

from roformer.study import stats as study_stats


def test_bootstrap_interval_covers_the_truth_and_widens_with_fewer_items():
    rng = np.random.default_rng(0)
    weight = np.full(400, 10.0)
    loss = 10 * (3.0 + rng.normal(0, 0.5, size=(8, 400)) + rng.normal(0, 0.05, size=(8, 1)))
    lo, hi = study_stats.interval(study_stats.mean_loss(loss, weight),
                                  study_stats.bootstrap_means(loss, weight, samples=1000), 8)
    assert lo < 3.0 < hi
    lo_small, hi_small = study_stats.interval(study_stats.mean_loss(loss[:, :40], weight[:40]),
                                              study_stats.bootstrap_means(loss[:, :40], weight[:40], samples=1000), 8)
    assert hi_small - lo_small > hi - lo


def test_intervals_over_few_seeds_reach_their_level_where_the_seeds_spread_dominates():
    """Seeds far apart, items alike: 8 seeds' percentile interval of the bootstrap covered the
    truth about 87 % of the time; scaled by t(7) and sqrt(8/7) it covers it about 95 %. A
    simulation of 300 studies, each with its own seed offsets (sd 0.05) and item losses."""
    rng = np.random.default_rng(5)
    weight = np.ones(200)
    covered_t, covered_percentile = 0, 0
    for trial in range(300):
        loss = 3.0 + rng.normal(0, 0.05, size=(8, 1)) + rng.normal(0, 0.05, size=(8, 200))
        replicates = study_stats.bootstrap_means(loss, weight, samples=400, seed=trial)
        lo, hi = study_stats.interval(study_stats.mean_loss(loss, weight), replicates, 8)
        covered_t += lo < 3.0 < hi
        p_lo, p_hi = np.percentile(replicates, [2.5, 97.5])
        covered_percentile += p_lo < 3.0 < p_hi
    assert covered_percentile / 300 < 0.91 and 0.92 <= covered_t / 300 <= 0.98


def test_the_bootstrap_draws_its_counts_once_per_shape_and_seed_and_gives_fresh_draws_numbers():
    """The report asks every interval of a budget for the same resampling; the counts are drawn
    once and kept, and the replicates are those of counts drawn afresh for each call."""
    rng = np.random.default_rng(1)
    loss, reference, weight = rng.random((4, 50)), rng.random((4, 50)), rng.random(50) + 0.5

    def fresh(data, seed, items=50):
        draw = np.random.default_rng(seed)
        seed_counts = draw.multinomial(4, np.full(4, 1 / 4), size=300)
        item_counts = draw.multinomial(items, np.full(items, 1 / items), size=300)
        return (seed_counts * (item_counts @ data.T)).sum(1) / (seed_counts.sum(1) * (item_counts @ weight[:items]))

    for seed in (0, 0, 1, 0):
        np.testing.assert_array_equal(study_stats.bootstrap_means(loss, weight, samples=300, seed=seed),
                                      fresh(loss, seed))
        np.testing.assert_array_equal(study_stats.bootstrap_means(loss, weight, samples=300, seed=seed,
                                                                  reference=reference), fresh(loss - reference, seed))
    np.testing.assert_array_equal(study_stats.bootstrap_means(loss[:, :30], weight[:30], samples=300),
                                  fresh(loss[:, :30], 0, items=30))
    study_stats.resample_counts.cache_clear()
    study_stats.bootstrap_means(loss, weight, samples=300)
    study_stats.bootstrap_means(loss, weight, samples=300, reference=reference)
    assert study_stats.resample_counts.cache_info().hits == 1


def test_tost_calls_a_tie_only_within_the_margin():
    rng = np.random.default_rng(1)
    weight = np.ones(2000)
    base = 3 + rng.normal(0, 0.3, size=(8, 2000))
    same = study_stats.compare(base + rng.normal(0, 0.01, size=base.shape), base, weight, margin=0.02, samples=500)
    assert same["verdict"].startswith("equivalent")
    worse = study_stats.compare(base + 0.1, base, weight, margin=0.02, samples=500)
    assert worse["verdict"] == "higher" and worse["lo"] > 0
    noisy = study_stats.compare(base + rng.normal(0, 1.0, size=base.shape), base, weight, margin=0.02, samples=500)
    assert noisy["verdict"] == "undecided"
    with pytest.raises(ValueError):
        study_stats.verdict(-1.0, 1.0, -0.5, 0.5, margin=0.0)


def test_holm_rejects_step_down_and_stops_at_the_first_that_fails():
    # Sorted: 0.005 <= 0.05/4, 0.01 <= 0.05/3, then 0.03 > 0.05/2 stops it (0.04 is not reached).
    assert study_stats.holm([0.01, 0.04, 0.03, 0.005]) == [True, False, False, True]
    assert study_stats.holm([0.01, 0.02, 0.03]) == [True, True, True]   # 0.01 <= 0.05/3, 0.02 <= 0.05/2, 0.03 <= 0.05
    assert study_stats.holm([0.2, 0.001]) == [False, True]
    assert study_stats.holm([]) == []


def test_each_verdict_is_checked_against_the_whole_familys_correction():
    """family_verdicts says which verdicts survive the correction over both tests of every
    comparison: a clear difference does, a borderline one among many does not (and says what
    is left of it), one comparison alone keeps its own verdict, "undecided" claims nothing."""
    rng = np.random.default_rng(3)
    weight = np.ones(2000)
    base = 3 + rng.normal(0, 0.3, size=(8, 2000))
    clear = study_stats.compare(base + 0.2, base, weight, margin=0.02, samples=2000)
    assert clear["verdict"] == "higher" and clear["p_difference"] < 0.05 and clear["p_equivalence"] > 0.05
    tie = study_stats.compare(base + rng.normal(0, 0.005, size=base.shape), base, weight, margin=0.05, samples=2000)
    assert tie["verdict"].startswith("equivalent") and tie["p_equivalence"] < 0.05
    noisy = study_stats.compare(base + rng.normal(0, 1.0, size=base.shape), base, weight, margin=0.02, samples=2000)
    assert noisy["verdict"] == "undecided"
    assert study_stats.family_verdicts([clear, tie, noisy]) == ["holds", "holds", None]
    lost = base + 0.2
    lost[3, 7] = np.nan   # a member that diverged at every rate
    nothing = study_stats.compare(lost, base, weight, margin=0.02, samples=500)
    assert nothing["verdict"] == "undecided" and nothing["p_difference"] == nothing["p_equivalence"] == 1.0
    assert study_stats.family_verdicts([clear, nothing]) == ["holds", None]
    # One comparison alone: its verdict at 5% is the family's (its two nulls count once).
    borderline = {"verdict": "higher", "lo": 0.001, "p_difference": 0.03, "p_equivalence": 1.0}
    assert study_stats.family_verdicts([borderline]) == ["holds"]
    # Among three, 0.03 is not below 0.05/3.
    assert study_stats.family_verdicts([borderline] * 3) == ["not under Holm: undecided"] * 3
    both = {"verdict": "equivalent (nonzero)", "lo": 0.001, "p_difference": 0.04, "p_equivalence": 0.0}
    assert study_stats.family_verdicts([both]) == ["holds"]
    # Three open comparisons: clear's 0 < 0.05/3, both's 0 < 0.05/3 (both stays open for its
    # difference), then 0.04 against 0.05/2 fails: what is left of both is its equivalence.
    assert study_stats.family_verdicts([both, clear, borderline]) == [
        "not under Holm: equivalent", "holds", "not under Holm: undecided"]


def test_the_family_correction_holds_the_family_wise_error_rate():
    """Under the null of no difference in every comparison, with equivalence always shown
    (its p near 0) and the difference tests' p uniform, a false "nonzero" claim that holds
    under the correction comes at most about 5% of the time. Entering only the p-value of the
    claim each comparison made (this module's earlier form) gives about 25% at six comparisons."""
    rng = np.random.default_rng(0)
    trials, m, errors = 20000, 6, 0
    for p_difference in rng.uniform(size=(trials, m)):
        comparisons = [{"verdict": "equivalent (nonzero)" if p < 0.05 else "equivalent", "lo": 0.0,
                        "p_difference": p, "p_equivalence": 0.0} for p in p_difference]
        errors += any(c["verdict"] == "equivalent (nonzero)" and f == "holds"
                      for c, f in zip(comparisons, study_stats.family_verdicts(comparisons)))
    assert errors / trials < 0.055


def test_p_values_are_the_intervals_inverted():
    """p_difference is below a level exactly where the interval at 1 - level excludes 0, and
    p_equivalence exactly where the interval at 1 - 2 level lies within +-margin, at any seed
    count (one seed: the normal quantile)."""
    rng = np.random.default_rng(1)
    for seeds in (1, 2, 3, 8, 16):
        for trial in range(40):
            diff = rng.uniform(-0.1, 0.1)
            replicates = rng.normal(diff, rng.uniform(0.005, 0.05), 500)
            p_difference, p_equivalence = study_stats.p_values(diff, replicates, seeds, 0.05)
            for level in (0.01, 0.02, 0.05, 0.1, 0.2, 0.4):
                lo, hi = study_stats.interval(diff, replicates, seeds, 1 - level)
                if abs(p_difference - level) > 1e-9:
                    assert (lo > 0 or hi < 0) == (p_difference < level), (seeds, trial, level)
                lo, hi = study_stats.interval(diff, replicates, seeds, 1 - 2 * level)
                if abs(p_equivalence - level) > 1e-9:
                    assert (-0.05 < lo and hi < 0.05) == (p_equivalence < level), (seeds, trial, level)
    assert study_stats.p_values(0.1, np.array([0.1, np.nan]), 8, 0.05) == (1.0, 1.0)
    assert all(np.isnan(study_stats.interval(0.1, np.array([0.1, np.inf]), 8)))
    assert study_stats.p_values(0.0, np.zeros(100), 8, 0.05) == (1.0, 0.0)   # identical losses: a tie, no difference
    # TOST reads the 90% interval, not the 95% one: an interval whose 90% lies within the margin
    # and whose 95% does not is "equivalent".
    assert study_stats.verdict(-0.03, 0.055, -0.02, 0.045, 0.05) == "equivalent"
    assert study_stats.verdict(-0.03, 0.055, -0.02, 0.051, 0.05) == "undecided"


def test_the_equivalence_bound_is_the_smallest_margin_tost_passes():
    """Read at another margin, the same intervals give compare's verdict there: equivalent just
    above the bound, and at the bound itself what the 95% interval says."""
    rng = np.random.default_rng(2)
    weight = np.ones(2000)
    base = 3 + rng.normal(0, 0.3, size=(8, 2000))
    for shift in (0.0, 0.01, -0.03):
        loss = base + shift + rng.normal(0, 0.02, size=base.shape)
        found = study_stats.compare(loss, base, weight, margin=0.02, samples=500)
        bound = study_stats.equivalence_bound(found["lo90"], found["hi90"])
        assert bound == pytest.approx(max(abs(found["lo90"]), abs(found["hi90"])))
        assert bound >= abs(shift) - 0.01
        ends = (found["lo"], found["hi"], found["lo90"], found["hi90"])
        assert study_stats.verdict(*ends, margin=bound * 1.001).startswith("equivalent")
        assert not study_stats.verdict(*ends, margin=bound).startswith("equivalent")
        again = study_stats.compare(loss, base, weight, margin=bound * 1.001, samples=500)
        assert again["verdict"].startswith("equivalent")
        assert study_stats.verdict(*ends, margin=0.02) == found["verdict"]


def test_onsets_are_censored_on_both_sides():
    tokens = [0, 10, 20, 30]
    assert study_stats.onset(tokens, [0.0, 0.5, 0.6, 0.7], 0.1) == {"tokens": 10, "started": True, "left_censored": True}
    assert study_stats.onset(tokens, [0.0, 0.0, 0.2, 0.7], 0.1) == {"tokens": 20, "started": True, "left_censored": False}
    assert study_stats.onset(tokens, [0.0] * 4, 0.1) == {"tokens": 30, "started": False, "left_censored": False}
    curve = study_stats.kaplan_meier(np.array([10, 20, 30, 30]), np.array([True, True, False, False]),
                                     np.array([0, 10, 20, 30]))
    np.testing.assert_allclose(curve, [0, 0.25, 0.5, 0.5])


def test_the_onset_band_is_exact_where_none_or_all_seeds_have_started():
    """0 of 8 started: the band still reaches 0.37 (Clopper-Pearson), where resampling the 8
    seeds gave no width at all; 8 of 8: down to 0.69; 4 of 8: the exact binomial interval. A
    run right-censored early (diverged at 10) is not counted after it."""
    band = study_stats.onset_curve([30] * 8, [False] * 8, [10, 20, 30])
    assert band["fraction"] == [0, 0, 0] and band["lo"] == [0, 0, 0]
    assert band["hi"] == pytest.approx([0.3694] * 3, abs=1e-4)
    band = study_stats.onset_curve([10] * 8, [True] * 8, [10])
    assert band["hi"] == [1.0] and band["lo"] == pytest.approx([0.6306], abs=1e-4)
    band = study_stats.onset_curve([10, 10, 10, 10, 30, 30, 30, 30], [True] * 4 + [False] * 4, [10])
    assert band["lo"] == pytest.approx([0.1570], abs=1e-4) and band["hi"] == pytest.approx([0.8430], abs=1e-4)
    band = study_stats.onset_curve([10, 20, 30], [False, True, False], [20])   # 1 started of the 2 followed
    assert band["fraction"] == [0.5]
    assert band["lo"] == pytest.approx([1 - 0.975 ** 0.5]) and band["hi"] == pytest.approx([0.975 ** 0.5])


def test_percentile_band_ignores_diverged_values():
    band = study_stats.percentile_band(np.array([[1.0, 2.0], [3.0, np.nan], [5.0, np.inf]]))
    assert band["median"] == [3.0, 2.0]
