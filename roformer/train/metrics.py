"""Run logging: metrics.jsonl + TensorBoard events, written by process 0 only, and the
training throughput (tokens/s, MFU) that goes into them."""
from __future__ import annotations

import contextlib
import json
import logging
import math
import statistics
import time
from pathlib import Path
from typing import Callable, Mapping

import jax

from roformer.files import write_text_atomic, writing
from roformer.train import flops

log = logging.getLogger("roformer.train")


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
            from tensorboardX import SummaryWriter  # imported here: heavy (protobuf), only process 0 needs it
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
        with writing(f"the metrics of {self.path.parent} (metrics.jsonl, tensorboard/)"):
            self._file.write(json.dumps(row) + "\n")
            self._file.flush()
            for name, value in row.items():
                if name != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(name, value, int(step))
            self._tb.flush()

    def close(self) -> None:
        if self.enabled:
            self.enabled = False
            with writing(f"the metrics of {self.path.parent} (metrics.jsonl, tensorboard/)"):
                self._file.close()
                self._tb.close()


class ThroughputTimer:
    """Tokens/s and MFU over the training steps between two readings.

    The first step (it compiles) only starts the clock, once its result is ready; time
    spent inside `paused()` (evaluation, checkpoint saves) is left out. MFU is the analytic
    `flops_per_step` (roformer.train.flops) against `peak_flops` per device; without a peak
    (None: a CPU, roformer.train.flops.device_peak_flops) it is not reported, and a reading
    above 1 (a given peak the steps beat, so a wrong one) is dropped with a warning."""

    def __init__(self, *, tokens_per_step: int, flops_per_step: float, peak_flops: float | None, num_devices: int,
                 clock: Callable[[], float] = time.perf_counter):
        self.tokens_per_step, self.peak_flops, self.num_devices = tokens_per_step, peak_flops, num_devices
        self.flops_per_step = flops_per_step
        self._clock = clock
        self._start: float | None = None
        self._steps = 0
        self._paused = 0.0
        self._warned = False
        self.history: dict[str, list[float]] = {"tokens_per_sec": [], "mfu": []}

    def step(self, metrics) -> None:
        """Count a finished step (`metrics`: its device outputs, waited on for the first)."""
        if self._start is None:
            jax.block_until_ready(metrics)
            self._start, self._steps = self._clock(), 0
        else:
            self._steps += 1

    @contextlib.contextmanager
    def paused(self):
        start = self._clock()
        try:
            yield
        finally:
            self._paused += self._clock() - start

    def read(self) -> dict[str, float]:
        """{tokens_per_sec, mfu} since the last reading ({} before any timed step), and
        restart the interval."""
        if self._start is None:
            return {}
        row = {}
        if self._steps > 0:
            elapsed = self._clock() - self._start - self._paused
            row = {"tokens_per_sec": self._steps * self.tokens_per_step / elapsed}
            if self.peak_flops:
                mfu = flops.mfu(self.flops_per_step, self._steps / elapsed, self.peak_flops, self.num_devices)
                if mfu <= 1:
                    row["mfu"] = mfu
                elif not self._warned:
                    self._warned = True
                    log.warning("MFU %.2f is above 1: the peak of %.3g FLOP/s per device is too low "
                                "(train.peak_flops_per_device); MFU is not reported", mfu, self.peak_flops)
            for name, value in row.items():
                self.history[name].append(value)
        self._start, self._steps, self._paused = self._clock(), 0, 0.0
        return row

    def medians(self) -> dict[str, float | None]:
        """The median of every reading so far (None without one)."""
        return {name: statistics.median(values) if values else None for name, values in self.history.items()}


def _drop_rows_after(path: Path, step: int) -> None:
    """Rewrite `path` (atomically) without rows past `step`, or a torn last line."""
    if not path.exists():
        return
    kept = "".join(json.dumps(row) + "\n" for row in read_metrics(path) if row.get("step", 0) <= step)
    if kept != path.read_text():
        write_text_atomic(path, kept)


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
