"""Run logging: metrics.jsonl + TensorBoard events, written by process 0 only."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Mapping

import jax


def _jsonable(value):
    value = float(value) if hasattr(value, "__float__") and not isinstance(value, (int, bool)) else value
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)   # JSON has no NaN/inf; keep them readable
    return value


class MetricsWriter:
    """Appends one JSON object per call to `workdir/metrics.jsonl` and mirrors the
    scalars to TensorBoard (`workdir/tensorboard`). No-op on processes other than 0,
    so multi-host runs write one log.

    `resume_step`: the step training (re)starts from. Rows logged past it by an earlier,
    interrupted attempt are dropped first (and hidden in TensorBoard), so the steps run
    again are logged once."""

    def __init__(self, workdir: str | Path, *, enabled: bool | None = None, resume_step: int | None = None):
        self.enabled = jax.process_index() == 0 if enabled is None else enabled
        self.path = Path(workdir) / "metrics.jsonl"
        self._file = None
        self._tb = None
        if self.enabled:
            from tensorboardX import SummaryWriter  # imported lazily: only process 0 needs it
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if resume_step is not None:
                _drop_rows_after(self.path, resume_step)
            self._file = self.path.open("a")
            self._tb = SummaryWriter(str(Path(workdir) / "tensorboard"),
                                     purge_step=None if resume_step is None else resume_step + 1)

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        if not self.enabled:
            return
        row = {"step": int(step), **{k: _jsonable(v) for k, v in scalars.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        for name, value in row.items():
            if name != "step" and isinstance(value, (int, float)):
                self._tb.add_scalar(name, value, int(step))
        self._tb.flush()

    def close(self) -> None:
        if self.enabled:
            self._file.close()
            self._tb.close()
            self.enabled = False


def _drop_rows_after(path: Path, step: int) -> None:
    """Rewrite `path` (atomically) without rows past `step`, or a torn last line."""
    if not path.exists():
        return
    kept = "".join(json.dumps(row) + "\n" for row in read_metrics(path) if row.get("step", 0) <= step)
    if kept != path.read_text():
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text(kept)
        tmp.replace(path)


def read_metrics(path: str | Path) -> list[dict]:
    """All rows of a run's `metrics.jsonl` (`path` is the workdir or the file itself),
    for tests, notebooks and the ablation report.  A torn last line (run killed
    mid-write) is skipped; a missing file gives no rows."""
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows
