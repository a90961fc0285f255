"""What every training driver (one run: roformer.train.loop; vmapped seeds: roformer.train.seeds)
logs and how it stops: the metrics on their way to metrics.jsonl with the divergence guard's
checks (`TrainLog`), the stop flag SIGTERM and Ctrl-C set (`StopFlag`), and when a step is due
to log, evaluate or save (`due`). The drivers differ in what they step, not in these.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import signal
import threading

import jax
import numpy as np
from jax.experimental import multihost_utils

from roformer.train.checkpoint import Checkpointer
from roformer.train.config import TrainConfig
from roformer.train.guard import DivergenceGuard, TrainingDiverged
from roformer.train.metrics import MetricsWriter, ThroughputTimer

log = logging.getLogger("roformer.train")


@dataclasses.dataclass(frozen=True)
class Due:
    """What a step is due for, by the train section's intervals (the last step is due for all)."""
    log: bool
    eval: bool
    checkpoint: bool


def due(step: int, tc: TrainConfig) -> Due:
    last = step == tc.steps
    return Due(step % tc.log_every == 0 or last, step % tc.eval_every == 0 or last,
               step % tc.checkpoint_every == 0 or last)


class StopFlag:
    """Set by SIGTERM (preemption notice) or SIGINT (Ctrl-C) while the `with` block runs; the
    loop then saves and exits cleanly. A second Ctrl-C interrupts at once (KeyboardInterrupt).
    The previous handlers come back on exit."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.requested = False
        self.signal = ""   # the name of the signal that asked to stop
        self._previous: dict = {}

    def __enter__(self) -> "StopFlag":
        if threading.current_thread() is threading.main_thread():
            self._previous = {signum: signal.signal(signum, self._handle) for signum in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)

    def _handle(self, signum, frame) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        self.signal = signal.Signals(signum).name

    def should_stop(self, step: int, every: int) -> bool:
        """Single process: as soon as signalled. Multi-process: every `every` steps
        all processes agree (any one signalled -> all stop at the same step)."""
        if jax.process_count() == 1:
            return self.requested
        if step % every:
            return False
        flags = multihost_utils.process_allgather(np.array([self.requested], np.int32))
        return bool(np.any(flags))


class TrainLog:
    """Training metrics on their way to the log: kept on device until a row is due, then
    fetched, checked for a non-finite loss, averaged over the interval and written with
    the throughput and the phase mark."""

    def __init__(self, writer: MetricsWriter, timer: ThroughputTimer, bar, checkpointer: Checkpointer,
                 guard: DivergenceGuard, *, mark: dict, first_loss: float | None = None):
        self.writer, self.timer, self.bar, self.checkpointer, self.mark = writer, timer, bar, checkpointer, mark
        self.guard = guard
        self.pending: list[tuple[int, dict]] = []
        self.first_loss: float | None = first_loss   # the run's, when resumed
        self.last_loss: float | None = None

    def add(self, step: int, metrics: dict) -> None:
        self.queue(step, metrics)
        self.bar.update(1)
        self.timer.step(metrics)

    def queue(self, step: int, metrics: dict) -> None:
        """Keep a step's metrics (device or host values) for the next `flush`."""
        self.pending.append((step, metrics))

    def write(self, step: int, row: dict, *, section: str = "eval") -> None:
        """A row with the phase mark: an evaluation's (the training rows are `flush`'s)."""
        self.writer.write(step, {**row, **self.mark}, section=section)

    def check_eval(self, step: int, loss: float) -> None:
        """Give the guard a held-out loss; one out of range stops the run (`stop`)."""
        reason = self.guard.check_eval(step, loss)
        if reason:
            self.stop(reason, step, min(self.guard.last_good_eval_step, self.guard.good_checkpoint_step()),
                      guard_check=math.isfinite(loss))

    def may_save(self, step: int, *, final: bool = False, who: str = "") -> bool:
        """Whether a checkpoint due at `step` is saved: not while the training loss is out of
        range (the guard's suspicion), except at the run's last step."""
        if final or not self.guard.suspicious:
            return True
        log.warning("%sstep %d: checkpoint skipped while the training loss is out of range", who, step)
        return False

    def flush(self, step: int) -> None:
        if not self.pending:
            return
        fetched = [(s, jax.device_get(m)) for s, m in self.pending]
        self.pending.clear()
        for s, m in fetched:
            if not math.isfinite(float(m["loss"])):
                # the loss at step s is that of the parameters after step s - 1
                self.stop(f"non-finite training loss {float(m['loss'])}", s,
                          min(self.guard.good_checkpoint_step(), s - 2))
        row = {name: float(np.mean([m[name] for _, m in fetched])) for name in ("loss", "mlm_accuracy", "grad_norm")}
        row["learning_rate"] = float(fetched[-1][1]["learning_rate"])
        self.write(step, {**row, **self.timer.read()}, section="train")
        self.checkpointer.check()   # a save that failed since the last row stops the run here
        reason = self.guard.check_loss(step, row["loss"], [(s, float(m["loss"])) for s, m in fetched])
        if reason:
            self.stop(reason, step, self.guard.good_checkpoint_step(), guard_check=True)
        if self.guard.suspicious:
            log.warning("step %d: training loss %.4g is above %g x its recent median (%d of "
                        "train.divergence_patience=%d)", step, row["loss"], self.guard.factor, self.guard.strikes,
                        self.guard.patience)
        self.first_loss = self.first_loss if self.first_loss is not None else row["loss"]
        self.last_loss = row["loss"]
        self.bar.set_postfix(loss=f"{row['loss']:.3f}", acc=f"{row['mlm_accuracy']:.3f}")

    def stop(self, reason: str, step: int, good_step: int, *, guard_check: bool = False) -> None:
        """Stop the run for a diverged loss: checkpoints saved after `good_step` (the newest
        step whose loss was in range) are moved to diverged_checkpoints/, so the same
        command resumes from the last good one; raises TrainingDiverged, one line."""
        self.bar.close()
        self.checkpointer.wait()
        later = self.checkpointer.steps_after(good_step)
        aside = self.checkpointer.set_aside(later, "diverged_checkpoints") if later else None
        latest, best = self.checkpointer.latest_step(), self.checkpointer.best_step()
        if latest is None:
            where = "No checkpoint was saved before it; a new run starts from step 0"
        else:
            where = (f"The last good checkpoint is step {latest} in {self.checkpointer.directory}"
                     + (f" (later ones moved to {aside})" if aside else "")
                     + (f"; the lowest held-out loss is step {best}'s" if best not in (None, latest) else "")
                     + "; the same command resumes from it, e.g. with a lower train.learning_rate")
        off = " (train.divergence_factor=0 turns this check off)" if guard_check else ""
        raise TrainingDiverged(f"training diverged at step {step}: {reason}; stopping. {where}{off}")
