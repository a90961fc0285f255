"""`train.profile_steps`: a jax.profiler trace of a window of a pretraining run's steps,
written under the run's `tensorboard/` folder (plugins/profile/<time>/), where TensorBoard's
profile plugin and XProf read it. Process 0 traces; the others train untraced."""
from __future__ import annotations

import logging
from pathlib import Path

from roformer.errors import ConfigError

log = logging.getLogger("roformer.train")

PROFILE_STEPS_SYNTAX = "'first:last' step numbers, 1 <= first <= last (e.g. '100:105'), or '' for no trace"


def parse_profile_steps(text: str) -> tuple[int, int] | None:
    """The (first, last) steps of `train.profile_steps` (both traced), None for ''."""
    if not isinstance(text, str):
        raise ConfigError(f"train.profile_steps={text!r} is not allowed: {PROFILE_STEPS_SYNTAX}")
    if not text.strip():
        return None
    parts = [p.strip() for p in text.split(":")]
    if len(parts) != 2 or not all(p.isdigit() for p in parts) or not 1 <= int(parts[0]) <= int(parts[1]):
        raise ConfigError(f"train.profile_steps={text!r} is not allowed: {PROFILE_STEPS_SYNTAX}")
    return int(parts[0]), int(parts[1])


class StepProfiler:
    """Traces the steps of `window` (train.profile_steps): `before(step)` ahead of running a
    step starts the trace at the window's first step the run reaches (a run resumed inside the
    window traces the rest of it), `after(step, state)` once a step is done waits for the
    state (the trace ends when the window's device work does) and stops it at the last.
    Used as a context manager, so a run that stops inside the window still writes its trace."""

    def __init__(self, window: str, logdir: Path, *, enabled: bool):
        self.window = parse_profile_steps(window) if enabled else None
        self.logdir = logdir
        self.tracing = False

    def before(self, step: int) -> None:
        if self.window and not self.tracing and self.window[0] <= step <= self.window[1]:
            log.info("profiling steps %d to %d: the trace goes to %s", step, self.window[1],
                     self.logdir / "plugins" / "profile")
            import jax   # here: a config that is only read needs no jax

            jax.profiler.start_trace(str(self.logdir))
            self.tracing = True

    def after(self, step: int, state) -> None:
        if self.tracing and step >= self.window[1]:
            import jax

            jax.block_until_ready(state)
            self._stop()
            log.info("profiled to step %d (tensorboard --logdir %s, Profile tab)", step, self.logdir)

    def _stop(self) -> None:
        import jax

        jax.profiler.stop_trace()
        self.tracing, self.window = False, None

    def __enter__(self) -> "StepProfiler":
        return self

    def __exit__(self, *exc) -> None:
        if self.tracing:
            self._stop()
