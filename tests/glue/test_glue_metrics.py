"""GLUE metrics against scikit-learn / scipy on the same predictions, and GLUE scores."""
import warnings

import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st
from scipy import stats
from sklearn import metrics as skm

from roformer.glue.metrics import (accuracy, f1, glue_scores, matthews_corr, pearson, spearman,
                                   task_metrics)
from roformer.glue.tasks import TASKS

pytestmark = pytest.mark.fast   # the fast lane (docs/testing.md)

binary = st.lists(st.tuples(st.integers(0, 1), st.integers(0, 1)), min_size=1, max_size=200)


@pytest.mark.filterwarnings("ignore:A single label was found")
@settings(max_examples=60, deadline=None)
@given(binary)
def test_classification_metrics_match_sklearn(pairs):
    labels, preds = map(np.array, zip(*pairs))
    assert accuracy(labels, preds) == pytest.approx(skm.accuracy_score(labels, preds))
    assert f1(labels, preds) == pytest.approx(skm.f1_score(labels, preds, zero_division=0))
    assert matthews_corr(labels, preds) == pytest.approx(skm.matthews_corrcoef(labels, preds),
                                                         abs=1e-12)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 10), st.floats(-5, 5, allow_nan=False)), min_size=3,
                max_size=100))
@example([(0, 0.0), (0, 2.2250738585e-313), (1, 0.0)])  # subnormal: sums of squares underflow
def test_correlations_match_scipy_with_ties(pairs):
    x = np.array([p[0] for p in pairs], np.float64) / 2   # many ties, like STS-B's 0.2 steps
    y = np.array([p[1] for p in pairs], np.float64)
    if np.ptp(x) == 0 or np.ptp(y) == 0:
        return  # correlation undefined
    assert pearson(x, y) == pytest.approx(stats.pearsonr(x, y)[0], abs=1e-9)
    assert spearman(x, y) == pytest.approx(stats.spearmanr(x, y)[0], abs=1e-9)


def test_task_metrics_per_task():
    rng = np.random.default_rng(0)
    labels, preds = rng.integers(0, 3, 500), rng.integers(0, 3, 500)
    assert task_metrics(TASKS["mnli"], labels, preds) == {
        "accuracy": pytest.approx(skm.accuracy_score(labels, preds))}
    b_labels, b_preds = labels % 2, preds % 2
    assert task_metrics(TASKS["mrpc"], b_labels, b_preds) == {
        "f1": pytest.approx(skm.f1_score(b_labels, b_preds)),
        "accuracy": pytest.approx(skm.accuracy_score(b_labels, b_preds))}
    assert task_metrics(TASKS["cola"], b_labels, b_preds) == {
        "matthews_corr": pytest.approx(skm.matthews_corrcoef(b_labels, b_preds))}
    scores, guesses = rng.uniform(0, 5, 300).round(1), rng.uniform(0, 5, 300)
    got = task_metrics(TASKS["stsb"], scores, guesses)
    assert got["pearson"] == pytest.approx(stats.pearsonr(scores, guesses)[0])
    assert got["spearman"] == pytest.approx(stats.spearmanr(scores, guesses)[0])
    # A constant prediction: MCC is 0 (as sklearn), not a division error.
    assert matthews_corr(b_labels, np.zeros_like(b_labels)) == 0.0
    # ... and so are the correlations, without a warning (not NaN, which would carry into
    # the median over seeds and the GLUE score).
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert pearson(scores, np.full_like(guesses, 2.5)) == 0.0
        assert spearman(np.ones_like(scores), guesses) == 0.0


def test_glue_scores_both_conventions():
    full = {
        "cola": {"validation": {"matthews_corr": 0.50}},
        "sst2": {"validation": {"accuracy": 0.90}},
        "mrpc": {"validation": {"f1": 0.88, "accuracy": 0.84}},
        "stsb": {"validation": {"pearson": 0.86, "spearman": 0.84}},
        "qqp": {"validation": {"f1": 0.86, "accuracy": 0.90}},
        "mnli": {"validation_matched": {"accuracy": 0.80},
                 "validation_mismatched": {"accuracy": 0.82}},
        "qnli": {"validation": {"accuracy": 0.88}},
        "rte": {"validation": {"accuracy": 0.60}},
        "wnli": {"validation": {"accuracy": 0.30}},  # excluded by both conventions
    }
    scores = glue_scores(full)
    bert = scores["glue_bert_9"]
    assert bert["complete"] and bert["missing"] == []
    assert bert["score"] == pytest.approx(
        100 * np.mean([0.80, 0.82, 0.86, 0.88, 0.90, 0.50, 0.84, 0.88, 0.60]))
    mean8 = scores["glue_mean_8"]
    assert mean8["score"] == pytest.approx(100 * np.mean(
        [0.50, 0.90, 0.86, 0.85, 0.88, 0.81, 0.88, 0.60]))
    assert "no WNLI" in bert["description"] and "8-task" in mean8["description"]

    partial = glue_scores({k: full[k] for k in ("sst2", "mrpc")})
    assert not partial["glue_bert_9"]["complete"]
    assert "RTE" in partial["glue_bert_9"]["missing"]
    assert partial["glue_bert_9"]["score"] == pytest.approx(100 * np.mean([0.90, 0.88]))
    # every task there, one scored on part of its dev split: the score is not complete
    cut = glue_scores(full, cut=["rte"])
    assert not cut["glue_bert_9"]["complete"] and cut["glue_bert_9"]["cut"] == ["RTE"]
    assert cut["glue_bert_9"]["score"] == scores["glue_bert_9"]["score"] and scores["glue_bert_9"]["cut"] == []


def test_a_collapsed_stsb_seed_leaves_the_median_the_score_and_the_submission_finite():
    from roformer.glue.run import median_seed, seed_medians

    rng = np.random.default_rng(3)
    gold = rng.uniform(0, 5, 200)
    seeds = {0: np.full_like(gold, 2.5), 1: gold + rng.normal(0, 0.5, 200), 2: gold + rng.normal(0, 1.0, 200)}
    task = TASKS["stsb"]
    per_seed = {s: {"validation": task_metrics(task, gold, p)} for s, p in seeds.items()}
    assert per_seed[0]["validation"] == {"pearson": 0.0, "spearman": 0.0}
    medians = seed_medians(task, per_seed)
    # The median of (0, r1, r2) is the worse real seed's correlation.
    assert medians["validation"]["spearman"] == pytest.approx(per_seed[2]["validation"]["spearman"])
    assert median_seed(task, per_seed, medians) == 2
    mean_8 = glue_scores({"stsb": medians})["glue_mean_8"]
    assert np.isfinite(mean_8["score"])
