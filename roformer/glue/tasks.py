"""GLUE task registry: one record per task says where its data lives and how it is scored.

Class ids follow HF `nyu-mll/glue` / TFDS `glue/<task>` (the index into `labels`), so
the three data sources agree and a model trained on one evaluates on another.
"""
from __future__ import annotations

import dataclasses
import difflib

from roformer.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class LocalLayout:
    """How one split's TSV looks in the official `download_glue_data.py` layout."""
    file: str                        # path relative to the task directory
    text_columns: tuple[str | int, ...]   # header names (or indices when headerless)
    label_column: str | int | None   # None: unlabelled (test) split
    index_column: str | None = None  # submission index (test splits)
    header: bool = True


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    name: str                        # config key, e.g. "sst2"
    display: str                     # official name, e.g. "SST-2"
    local_dir: str                   # folder under the GLUE data dir
    labels: tuple[str, ...] | None   # label strings by class id; None = regression
    eval_splits: tuple[str, ...]     # labelled splits reported (dev)
    test_splits: dict[str, str]      # split -> submission file name
    local: dict[str, LocalLayout]    # split -> file layout
    hf_config: str
    hf_text_fields: tuple[str, ...]
    metrics: tuple[str, ...]         # first one is the task's headline metric
    train_split: str | None = "train"
    predicted_by: str | None = None  # AX: predicted with the MNLI model

    @property
    def is_regression(self) -> bool:
        return self.labels is None

    @property
    def num_labels(self) -> int:
        return 1 if self.labels is None else len(self.labels)

    @property
    def label_names(self) -> tuple[str, ...] | None:
        """What each class id means (HF `nyu-mll/glue`'s names: the files' 0/1 say nothing):
        the id2label of an exported model. None for regression."""
        return LABEL_NAMES.get(self.name, self.labels)

    @property
    def tfds_name(self) -> str:
        return f"glue/{self.hf_config}"

    @property
    def splits(self) -> tuple[str, ...]:
        return tuple(self.local)


# The names HF `nyu-mll/glue` gives the classes of the tasks whose files label them 0/1.
LABEL_NAMES = {"cola": ("unacceptable", "acceptable"), "sst2": ("negative", "positive"),
               "mrpc": ("not_equivalent", "equivalent"), "qqp": ("not_duplicate", "duplicate"),
               "wnli": ("not_entailment", "entailment")}
_BINARY = ("0", "1")
_NLI2 = ("entailment", "not_entailment")
_NLI3 = ("entailment", "neutral", "contradiction")


def _pair(file, a, b, label, index=None, header=True):
    return LocalLayout(file, (a, b), label, index, header)


def _pair_splits(a, b, label, test_index="index"):
    """The usual sentence-pair layout: train.tsv and dev.tsv carry the label column,
    test.tsv an index column instead."""
    return {"train": _pair("train.tsv", a, b, label),
            "validation": _pair("dev.tsv", a, b, label),
            "test": _pair("test.tsv", a, b, None, test_index)}


def _single(file, a, label, index=None, header=True):
    return LocalLayout(file, (a,), label, index, header)


TASKS: dict[str, TaskSpec] = {
    "cola": TaskSpec(
        "cola", "CoLA", "CoLA", _BINARY, ("validation",), {"test": "CoLA.tsv"},
        {   # train/dev have no header: source, label, original label, sentence
            "train": _single("train.tsv", 3, 1, header=False),
            "validation": _single("dev.tsv", 3, 1, header=False),
            "test": _single("test.tsv", "sentence", None, "index"),
        },
        "cola", ("sentence",), ("matthews_corr",)),
    "sst2": TaskSpec(
        "sst2", "SST-2", "SST-2", _BINARY, ("validation",), {"test": "SST-2.tsv"},
        {
            "train": _single("train.tsv", "sentence", "label"),
            "validation": _single("dev.tsv", "sentence", "label"),
            "test": _single("test.tsv", "sentence", None, "index"),
        },
        "sst2", ("sentence",), ("accuracy",)),
    "mrpc": TaskSpec(
        "mrpc", "MRPC", "MRPC", _BINARY, ("validation",), {"test": "MRPC.tsv"},
        _pair_splits("#1 String", "#2 String", "Quality"),
        "mrpc", ("sentence1", "sentence2"), ("f1", "accuracy")),
    "stsb": TaskSpec(
        "stsb", "STS-B", "STS-B", None, ("validation",), {"test": "STS-B.tsv"},
        _pair_splits("sentence1", "sentence2", "score"),
        "stsb", ("sentence1", "sentence2"), ("spearman", "pearson")),
    "qqp": TaskSpec(
        "qqp", "QQP", "QQP", _BINARY, ("validation",), {"test": "QQP.tsv"},
        _pair_splits("question1", "question2", "is_duplicate", test_index="id"),
        "qqp", ("question1", "question2"), ("f1", "accuracy")),
    "mnli": TaskSpec(
        "mnli", "MNLI", "MNLI", _NLI3, ("validation_matched", "validation_mismatched"),
        {"test_matched": "MNLI-m.tsv", "test_mismatched": "MNLI-mm.tsv"},
        {
            "train": _pair("train.tsv", "sentence1", "sentence2", "gold_label"),
            "validation_matched": _pair("dev_matched.tsv", "sentence1", "sentence2", "gold_label"),
            "validation_mismatched": _pair(
                "dev_mismatched.tsv", "sentence1", "sentence2", "gold_label"),
            "test_matched": _pair("test_matched.tsv", "sentence1", "sentence2", None, "index"),
            "test_mismatched": _pair(
                "test_mismatched.tsv", "sentence1", "sentence2", None, "index"),
        },
        "mnli", ("premise", "hypothesis"), ("accuracy",)),
    "qnli": TaskSpec(
        "qnli", "QNLI", "QNLI", _NLI2, ("validation",), {"test": "QNLI.tsv"},
        _pair_splits("question", "sentence", "label"),
        "qnli", ("question", "sentence"), ("accuracy",)),
    "rte": TaskSpec(
        "rte", "RTE", "RTE", _NLI2, ("validation",), {"test": "RTE.tsv"},
        _pair_splits("sentence1", "sentence2", "label"),
        "rte", ("sentence1", "sentence2"), ("accuracy",)),
    "wnli": TaskSpec(
        "wnli", "WNLI", "WNLI", _BINARY, ("validation",), {"test": "WNLI.tsv"},
        _pair_splits("sentence1", "sentence2", "label"),
        "wnli", ("sentence1", "sentence2"), ("accuracy",)),
    "ax": TaskSpec(
        "ax", "AX", "diagnostic", _NLI3, (), {"test": "AX.tsv"},
        {"test": _pair("diagnostic.tsv", "sentence1", "sentence2", None, "index")},
        "ax", ("premise", "hypothesis"), (), train_split=None, predicted_by="mnli"),
}

# The nine GLUE tasks in leaderboard order (AX rides along with MNLI).
GLUE_TASKS = ("cola", "sst2", "mrpc", "stsb", "qqp", "mnli", "qnli", "rte", "wnli")

_ALIASES = {t.display.lower(): t.name for t in TASKS.values()} | {
    "sst-2": "sst2", "sts-b": "stsb", "diagnostic": "ax"}


def get_task(name: str) -> TaskSpec:
    key = _ALIASES.get(name.strip().lower(), name.strip().lower())
    if key not in TASKS:
        close = difflib.get_close_matches(key, [*TASKS, *_ALIASES, "all"], n=1)
        hint = f"did you mean {_ALIASES.get(close[0], close[0])!r}? " if close else ""
        raise ConfigError(f"unknown GLUE task {name!r}; {hint}choose from {', '.join(TASKS)} or 'all'")
    return TASKS[key]


def parse_task_list(spec: str) -> list[str]:
    """'all' -> the nine tasks; else a comma-separated list ('sst2,mrpc')."""
    if spec.strip().lower() == "all":
        return list(GLUE_TASKS)
    names = [get_task(s).name for s in spec.split(",") if s.strip()]
    if not names:
        raise ConfigError("config.task is empty; give a task name, a comma list or 'all'")
    return list(dict.fromkeys(names))
