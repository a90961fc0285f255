"""GLUE metrics (numpy; tests check them against scikit-learn / scipy) and GLUE scores."""
from __future__ import annotations

import numpy as np

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
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    x, y = x - x.mean(), y - y.mean()
    # Correlation is scale-free: normalising by the largest deviation first keeps
    # the sums of squares from underflowing (or overflowing) for extreme inputs.
    x_scale, y_scale = np.abs(x).max(initial=0.0), np.abs(y).max(initial=0.0)
    if x_scale == 0 or y_scale == 0:
        return float("nan")
    x, y = x / x_scale, y / y_scale
    return float(np.sum(x * y) / np.sqrt(np.sum(x * x) * np.sum(y * y)))


def _average_ranks(x) -> np.ndarray:
    """Ranks 1..n with ties given their mean rank (scipy.stats.rankdata 'average')."""
    x = np.asarray(x, np.float64)
    order = np.argsort(x, kind="mergesort")
    sorted_x = x[order]
    # Group equal values; each group gets the mean of the ranks it spans.
    starts = np.r_[True, sorted_x[1:] != sorted_x[:-1]]
    group = np.cumsum(starts) - 1
    first = np.flatnonzero(starts)
    counts = np.diff(np.r_[first, len(x)])
    mean_rank = first + (counts + 1) / 2.0
    ranks = np.empty(len(x))
    ranks[order] = mean_rank[group]
    return ranks


def spearman(x, y) -> float:
    return pearson(_average_ranks(x), _average_ranks(y))


def task_metrics(task: TaskSpec, labels, preds) -> dict[str, float]:
    """All of the task's official metrics, in percent-free [0, 1] / [-1, 1] units."""
    fns = {"accuracy": accuracy, "f1": f1, "matthews_corr": matthews_corr,
           "pearson": pearson, "spearman": spearman}
    return {name: fns[name](labels, preds) for name in task.metrics}


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


def glue_scores(medians: dict[str, dict[str, dict[str, float]]]) -> dict[str, dict]:
    """GLUE scores (x100) from per-task medians {task: {split: {metric: value}}}.

    A convention whose tasks are not all present reports `score` over what is there,
    with `complete: false` and the missing entries named, so a partial run is not
    mistaken for a full GLUE score.
    """
    out = {}
    for key, (description, entries) in SCORE_CONVENTIONS.items():
        parts, missing = {}, []
        for label, task, splits, metrics in entries:
            splits = (splits,) if isinstance(splits, str) else splits
            values = [medians.get(task, {}).get(s, {}).get(m) for s in splits for m in metrics]
            if any(v is None for v in values):
                missing.append(label)
            else:
                parts[label] = 100.0 * float(np.mean(values))
        out[key] = {
            "description": description,
            "score": float(np.mean(list(parts.values()))) if parts else None,
            "complete": not missing,
            "missing": missing,
            "parts": parts,
        }
    return out
