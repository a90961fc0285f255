"""How far an ablation session's training has got, as a log line every
`config.progress_every_s` seconds: each run that trained since the last line with its
step, the runs whose training is done, the steps done and left over all the session's
training, and the time left at the recent rate (an example: docs/ablation-report.md, Progress).

Each run's step is the last row of its metrics.jsonl, so the line reads the same whichever
way the runs go (in turn, side by side in their own processes, or as vmapped seeds), and
the runs' own progress bars can stay off. The estimate divides the steps left by the
session's recent rate over all runs; runs of other schemes or lengths step at other rates,
so it is an estimate.
"""
from __future__ import annotations

import collections
import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

from roformer.ablation.plan import Plan

log = logging.getLogger("roformer.ablate")

# How many earlier lines' counts the rate reaches back over: long enough to smooth over an
# evaluation, short enough to follow a change of mode (the extension runs after the schemes').
RATE_WINDOW = 3
TAIL_BYTES = 16_384   # more than a few metrics rows, the longest being an evaluation's


class TrainingRun(NamedTuple):
    run: str
    workdir: Path   # the workdir whose metrics.jsonl the run's training writes
    steps: int


def training_runs(plan: Plan) -> list[TrainingRun]:
    """Every run the ablation trains (the schemes' pretraining, then the context extension
    when enabled), with its workdir and step budget."""
    return [TrainingRun(run.name, run.workdir, int(run.train_config.train.steps)) for run in plan.runs]


def last_step(workdir: Path) -> int:
    """The step of the last complete row of workdir/metrics.jsonl (0 when there is none),
    read from the file's end: a long run's file holds thousands of rows."""
    path = workdir / "metrics.jsonl"
    try:
        with path.open("rb") as f:
            size = f.seek(0, 2)
            f.seek(max(0, size - TAIL_BYTES))
            lines = f.read().splitlines()
    except FileNotFoundError:
        return 0
    for line in reversed(lines):
        try:
            row = json.loads(line)
        except ValueError:   # a torn last line, or the first line cut by the seek
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            return row["step"]
    return 0


def _duration(seconds: float) -> str:
    minutes = round(seconds / 60)
    if minutes < 60:
        return f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours} h {minutes} min"
    return f"{hours / 24:.1f} days"


class Progress:
    """The session's training progress over `runs`; each `line()` is one report."""

    def __init__(self, runs: list[TrainingRun], clock: Callable[[], float] = time.monotonic):
        self.runs = runs
        self.total = sum(r.steps for r in runs)
        self.clock = clock
        self._last = self._steps()
        self._history = collections.deque([(clock(), sum(self._last.values()))], maxlen=RATE_WINDOW + 1)

    def _steps(self) -> dict[str, int]:
        return {r.run: min(last_step(r.workdir), r.steps) for r in self.runs}

    def _totals(self, steps: dict[str, int]) -> str:
        done, total = sum(steps.values()), self.total
        finished = sum(steps[r.run] >= r.steps for r in self.runs)
        return (f"training done in {finished} of {len(self.runs)} runs; "
                + (f"{done:,} of {total:,} steps ({100 * done / total:.1f} %)" if total else "no steps"))

    def first_line(self) -> str:
        """Where the session starts (a resumed one: what earlier sessions trained)."""
        return f"progress: at the start, {self._totals(self._last)}"

    def line(self) -> str:
        steps, now = self._steps(), self.clock()
        done, total = sum(steps.values()), self.total
        moved = [r for r in self.runs if steps[r.run] != self._last[r.run]]
        self._last = steps
        self._history.append((now, done))
        since, done_then = self._history[0]
        rate = (done - done_then) / (now - since) if now > since else 0.0

        training = ", ".join(f"{r.run} finished" if steps[r.run] >= r.steps else
                             f"{r.run} at step {steps[r.run]:,} of {r.steps:,}" for r in moved)
        text = f"progress: {training or 'no run trained since the last line'}; {self._totals(steps)}"
        if done >= total:
            return text
        window = _duration(now - since)
        if rate > 0:
            return (f"{text}; {rate:.1f} steps/s over the last {window}: about "
                    f"{_duration((total - done) / rate)} of training left (evaluations and GLUE not counted)")
        return f"{text}; no steps over the last {window}"


@contextlib.contextmanager
def reporting(plan: Plan, enabled: bool = True) -> Iterator[None]:
    """Log a progress line every config.progress_every_s seconds (0: never) while the block runs."""
    every = float(plan.config.progress_every_s)
    if not enabled or every <= 0:
        yield
        return
    progress = Progress(training_runs(plan))
    log.info("%s", progress.first_line())
    stop = threading.Event()

    def report() -> None:
        while not stop.wait(every):
            try:
                log.info("%s", progress.line())
            except Exception as error:  # noqa: BLE001 - a report that fails must not stop training
                log.warning("progress line failed: %s: %s", type(error).__name__, error)

    thread = threading.Thread(target=report, name="ablation-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
