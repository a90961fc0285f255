"""GLUE metrics (numpy, and scipy.stats for the correlations; tests check them against
scikit-learn / scipy) and GLUE scores."""
from __future__ import annotations

import numpy as np
from scipy import stats

from roformer.glue.tasks import TaskSpec


def accuracy(labels, preds) -> float:
    return float(np.mean(np.asarray(labels) == np.asarray(preds)))


def f1(labels, preds) -> float:
    """Binary F1 of the positive class (1), 0 when there are no true positives."""
    labels, preds = np.asarray(labels), np.asarray(preds)
    tp = np.sum((preds == 1) & (labels == 1))
    fp = np.sum((preds == 1) & (labels != 1))
    fn = np.sum((preds != 1) & (labels == 1))
    return 0.0 if tp == 0 else float(2 * tp / (2 * tp + fp + fn))


def matthews_corr(labels, preds) -> float:
    """Matthews correlation (binary); 0 when a marginal is constant, as sklearn does."""
    labels, preds = np.asarray(labels) == 1, np.asarray(preds) == 1
    tp = float(np.sum(preds & labels))
    tn = float(np.sum(~preds & ~labels))
    fp = float(np.sum(preds & ~labels))
    fn = float(np.sum(~preds & labels))
    denom = np.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    return 0.0 if denom == 0 else float((tp * tn - fp * fn) / denom)


def pearson(x, y) -> float:
    """Pearson's r (scipy.stats); 0 where either side is constant."""
    return _correlation(stats.pearsonr, x, y)


def spearman(x, y) -> float:
    """Spearman's rank correlation, ties ranked by their mean (scipy.stats); 0 where either
    side is constant."""
    return _correlation(stats.spearmanr, x, y)


def _correlation(correlate, x, y) -> float:
    # A model that predicts one value for every row (a collapsed seed) shows no association:
    # 0, the convention MCC follows for a one-class prediction. scipy's NaN would make the
    # median over seeds, the GLUE score and the results JSON NaN, and pick the collapsed
    # seed's predictions for submission.
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if np.ptp(x) == 0 or np.ptp(y) == 0:
        return 0.0
    return float(correlate(x, y).statistic)


def task_metrics(task: TaskSpec, labels, preds) -> dict[str, float]:
    """All of the task's official metrics, in percent-free [0, 1] / [-1, 1] units."""
    fns = {"accuracy": accuracy, "f1": f1, "matthews_corr": matthews_corr,
           "pearson": pearson, "spearman": spearman}
    return {name: fns[name](labels, preds) for name in task.metrics}


def scores_line(scores: dict[str, dict[str, float]]) -> str:
    """{split: {metric: value}} as a person reads it, in percent as glue_results.md:
    'validation accuracy 81.23, f1 87.01; test ...'."""
    return "; ".join(f"{split} " + ", ".join(f"{metric} {100 * value:.2f}" for metric, value in metrics.items())
                     for split, metrics in scores.items())


# ---------------------------------------------------------------- GLUE scores
# Each entry: (column label, task, split, metric or metrics averaged).

BERT_9 = (  # BERT / Cramming: 9 numbers, MNLI m and mm separately, no WNLI
    ("MNLI-m", "mnli", "validation_matched", ("accuracy",)),
    ("MNLI-mm", "mnli", "validation_mismatched", ("accuracy",)),
    ("QQP", "qqp", "validation", ("f1",)),
    ("QNLI", "qnli", "validation", ("accuracy",)),
    ("SST-2", "sst2", "validation", ("accuracy",)),
    ("CoLA", "cola", "validation", ("matthews_corr",)),
    ("STS-B", "stsb", "validation", ("spearman",)),
    ("MRPC", "mrpc", "validation", ("f1",)),
    ("RTE", "rte", "validation", ("accuracy",)),
)
MEAN_8 = (  # one number per task (leaderboard style: two-metric tasks averaged), no WNLI
    ("CoLA", "cola", "validation", ("matthews_corr",)),
    ("SST-2", "sst2", "validation", ("accuracy",)),
    ("MRPC", "mrpc", "validation", ("f1", "accuracy")),
    ("STS-B", "stsb", "validation", ("pearson", "spearman")),
    ("QQP", "qqp", "validation", ("f1", "accuracy")),
    ("MNLI", "mnli", ("validation_matched", "validation_mismatched"), ("accuracy",)),
    ("QNLI", "qnli", "validation", ("accuracy",)),
    ("RTE", "rte", "validation", ("accuracy",)),
)
SCORE_CONVENTIONS = {
    "glue_bert_9": ("BERT/Cramming GLUE score: mean of 9 numbers (MNLI-m, MNLI-mm, QQP F1, "
                    "QNLI, SST-2, CoLA MCC, STS-B Spearman, MRPC F1, RTE), no WNLI", BERT_9),
    "glue_mean_8": ("8-task GLUE mean: one number per task (MRPC/QQP mean of F1 and acc, "
                    "STS-B mean of Pearson and Spearman, MNLI mean of m and mm), no WNLI",
                    MEAN_8),
}


def glue_scores(medians: dict[str, dict[str, dict[str, float]]], cut=()) -> dict[str, dict]:
    """GLUE scores (x100) from per-task medians {task: {split: {metric: value}}}.

    A convention whose tasks are not all present reports `score` over what is there,
    with `complete: false` and the missing entries named, so a partial run is not
    mistaken for a full GLUE score. So does one with a task in `cut` (scored on part of its
    dev split), its entries named under `cut`.
    """
    out = {}
    for key, (description, entries) in SCORE_CONVENTIONS.items():
        parts, missing, partial = {}, [], []
        for label, task, splits, metrics in entries:
            splits = (splits,) if isinstance(splits, str) else splits
            values = [medians.get(task, {}).get(s, {}).get(m) for s in splits for m in metrics]
            if any(v is None for v in values):
                missing.append(label)
            else:
                parts[label] = 100.0 * float(np.mean(values))
                partial += [label] if task in cut else []
        out[key] = {
            "description": description,
            "score": float(np.mean(list(parts.values()))) if parts else None,
            "complete": not missing and not partial,
            "missing": missing,
            "cut": partial,
            "parts": parts,
        }
    return out
