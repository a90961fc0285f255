"""Why a run stops on its own, and the divergence guard that decides one of them.

`TrainingStopped` is a stop the run's own checks decided: its message is the one line
the command line prints (roformer.cli), naming the step and the checkpoint to go back
to. This module imports only the standard library, so the CLI can name the types
without loading jax.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import math
import statistics
from collections.abc import Iterator

from roformer.errors import ConfigError, UserError

log = logging.getLogger("roformer.train")


class TrainingStopped(UserError):
    """The run stopped itself; the message says why and what is left, on one line."""


class TrainingDiverged(TrainingStopped, FloatingPointError):
    """The training or held-out loss went non-finite, or finite but far above its recent
    level. A FloatingPointError, so callers that catch those report the run as diverged."""


class CheckpointSaveFailed(TrainingStopped, OSError):
    """A checkpoint could not be written (a full disk, say); earlier ones are intact."""


@contextlib.contextmanager
def stop_reason_kept() -> Iterator[None]:
    """A run that stopped itself (TrainingStopped) ends with that line, whatever its cleanup
    meets afterwards: closing the metrics on the disk that just filled up fails too, and that
    error, which would replace the one that says what happened, is said in a warning line."""
    try:
        yield
    except Exception as error:
        stopped, seen = error.__context__, {id(error)}
        while stopped is not None and not isinstance(stopped, TrainingStopped) and id(stopped) not in seen:
            seen.add(id(stopped))
            stopped = stopped.__context__
        if isinstance(error, TrainingStopped) or not isinstance(stopped, TrainingStopped):
            raise
        log.warning("while stopping: %s: %s", type(error).__name__, (str(error).splitlines() or [""])[0][:300])
        raise stopped.with_traceback(stopped.__traceback__) from stopped.__cause__


# Losses are compared with at least this many nats: a nearly solved task's losses are
# small, and their relative noise alone could pass any factor.
MIN_REFERENCE_LOSS = 1.0
# Logged losses the median needs before the guard judges a row.
MIN_HISTORY = 5


@dataclasses.dataclass
class DivergenceGuard:
    """Decides when a finite loss has diverged (see docs/pretraining.md).

    A logged training loss above `factor` x the median of the last `window` in-range
    logged losses is out of range; `patience` such rows in a row stop the run. A held-out
    loss above `factor` x the best one so far stops it at once. Rows up to `after_step`
    (the warmup) are only recorded, never judged; `factor` 0 turns the guard off."""

    factor: float = 3.0
    patience: int = 3
    window: int = 20
    after_step: int = 0
    history: collections.deque = dataclasses.field(default_factory=collections.deque)
    best_eval: float | None = None
    strikes: int = 0                # consecutive out-of-range rows
    onset: int | None = None        # first step whose own loss was out of range, in this streak
    last_good_step: int = 0         # newest logged step whose loss was in range
    last_good_eval_step: int = 0    # newest evaluated step whose loss was in range
    resumed_step: int = 0           # the checkpoint this run started from

    def __post_init__(self):
        if self.factor and not self.factor > 1:
            raise ConfigError(f"train.divergence_factor={self.factor} must be above 1 (or 0: no guard)")
        if self.patience < 1 or self.window < 1:
            raise ConfigError(f"train.divergence_patience={self.patience} and train.divergence_window="
                              f"{self.window} must be at least 1")
        self.history = collections.deque(self.history, maxlen=self.window)

    @property
    def enabled(self) -> bool:
        return self.factor > 0

    @property
    def suspicious(self) -> bool:
        """The latest logged loss was out of range (a checkpoint now could hold a diverged state)."""
        return self.strikes > 0

    def threshold(self) -> float | None:
        if not self.enabled or len(self.history) < min(MIN_HISTORY, self.window):
            return None
        return self.factor * max(statistics.median(self.history), MIN_REFERENCE_LOSS)

    def good_checkpoint_step(self) -> int:
        """The newest step whose checkpoint holds parameters known to be in range. The loss
        of step s is that of the parameters after step s - 1: when step s's loss is out of
        range, checkpoints from step s - 1 on are not. Until a logged loss since the resume
        was in range, the checkpoint the run resumed from is not trusted either: it may be
        the one that produced the divergence (damaged, or its optimizer state), and naming
        it would send the same command back into it."""
        step = self.onset - 2 if self.onset is not None else max(self.last_good_step - 1, self.resumed_step)
        if self.resumed_step and self.last_good_step <= self.resumed_step:
            step = min(step, self.resumed_step - 1)
        return step

    def check_loss(self, step: int, loss: float, step_losses: list[tuple[int, float]] | None = None) -> str | None:
        """Record a logged training loss (the mean of `step_losses`, each step's own); what
        went wrong when the run must stop, else None."""
        threshold = self.threshold() if step > self.after_step else None
        if threshold is not None and loss > threshold:
            if not self.strikes:
                self.onset = next((s for s, x in step_losses or [] if x > threshold), step)
            self.strikes += 1
            if self.strikes >= self.patience:
                return (f"training loss {loss:.4g} stayed above {self.factor:g} x its recent median "
                        f"{threshold / self.factor:.4g} for {self.strikes} logged steps")
            return None
        self.strikes, self.onset = 0, None
        self.history.append(loss)
        self.last_good_step = step
        return None

    def check_eval(self, step: int, loss: float) -> str | None:
        """Record a held-out loss; what went wrong when the run must stop, else None."""
        if not math.isfinite(loss):
            return f"non-finite held-out loss {loss}"
        if (self.enabled and step > self.after_step and self.best_eval is not None
                and loss > self.factor * max(self.best_eval, MIN_REFERENCE_LOSS)):
            return f"held-out loss {loss:.4g} is above {self.factor:g} x the best so far, {self.best_eval:.4g}"
        self.best_eval = loss if self.best_eval is None else min(self.best_eval, loss)
        self.last_good_eval_step = step
        return None
