"""GLUE leaderboard submission files: `<Task>.tsv` with `index\\tprediction`, zipped."""
from __future__ import annotations

import logging
import zipfile
from pathlib import Path

import numpy as np

from roformer.errors import ConfigError
from roformer.glue.tasks import TaskSpec

log = logging.getLogger("roformer.glue")

# Every file the leaderboard server expects in the zip.
SUBMISSION_FILES = ("CoLA.tsv", "SST-2.tsv", "MRPC.tsv", "STS-B.tsv", "QQP.tsv", "MNLI-m.tsv",
                    "MNLI-mm.tsv", "QNLI.tsv", "RTE.tsv", "WNLI.tsv", "AX.tsv")


def prediction_strings(task: TaskSpec, predictions: np.ndarray) -> list[str]:
    """Label strings the server expects: class names (0/1, entailment/...) or, for
    STS-B, the score clipped to the 0..5 range."""
    if task.is_regression:
        return [f"{float(p):.3f}" for p in np.clip(predictions, 0.0, 5.0)]
    return [task.labels[int(p)] for p in predictions]


def write_predictions(out_dir: str | Path, task: TaskSpec, split: str,
                      indices: np.ndarray, predictions: np.ndarray) -> Path:
    """Write one task/split's file (rows in index order) and return its path."""
    file_name = task.test_splits[split]
    path = Path(out_dir) / file_name
    path.parent.mkdir(parents=True, exist_ok=True)
    order = np.argsort(indices, kind="stable")
    strings = prediction_strings(task, np.asarray(predictions)[order])
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write("index\tprediction\n")
        for i, s in zip(np.asarray(indices)[order], strings):
            f.write(f"{int(i)}\t{s}\n")
    return path


def zip_submission(out_dir: str | Path, zip_path: str | Path | None = None) -> Path:
    """Zip the submission TSVs found in `out_dir` (flat, as the server wants them)."""
    out_dir = Path(out_dir)
    zip_path = Path(zip_path) if zip_path else out_dir.with_suffix(".zip")
    present = [name for name in SUBMISSION_FILES if (out_dir / name).is_file()]
    if not present:
        raise ConfigError(f"no submission files in {out_dir}; expected some of "
                          f"{', '.join(SUBMISSION_FILES)}")
    with zipfile.ZipFile(zip_path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name in present:
            zf.write(out_dir / name, arcname=name)
    return zip_path


def missing_submission_files(out_dir: str | Path) -> list[str]:
    return [name for name in SUBMISSION_FILES if not (Path(out_dir) / name).is_file()]



def finish_submission(out_dir: str | Path, zip_path: str | Path, started: float) -> dict:
    """Zip the submission files of `out_dir` and say what the zip is: {"zip", "missing_files"
    (what the leaderboard needs and no run wrote), "from_earlier_runs" (files not written since
    `started`, the run's start, by time.time(): another run's predictions in the same workdir,
    perhaps of another model)}, each of the last two also a warning."""
    out_dir = Path(out_dir)
    summary = {"zip": str(zip_submission(out_dir, zip_path)), "missing_files": missing_submission_files(out_dir),
               "from_earlier_runs": [name for name in SUBMISSION_FILES if (out_dir / name).is_file()
                                     and (out_dir / name).stat().st_mtime < started]}
    if summary["missing_files"]:
        log.warning("submission.zip lacks %s (tasks not run); the leaderboard needs all of them",
                    ", ".join(summary["missing_files"]))
    if summary["from_earlier_runs"]:
        log.warning("submission.zip holds %s from an earlier run in this workdir, not this run's models; "
                    "delete them from %s to leave them out", ", ".join(summary["from_earlier_runs"]), out_dir)
    return summary
