"""What a training run shows a person while it runs, and the line it ends with.

- `progress_bar`: tqdm's bar on a terminal. Written to a file or a pipe (a log, CI, a job
  scheduler), the bar's carriage-return redraws pile up into kilobyte-long lines, so there
  the same calls log a plain line every `every_s` seconds and one at the end: the step, the
  rate, the time left and the bar's postfix (loss, accuracy).
- `announce_compile`: wraps a jitted step so that its first call, where XLA compiles it
  (seconds to minutes before the first step runs), is announced with a "compiling ..." line
  and followed by how long it took.
- `summary_line`: the run's summary as one short line; summary.json keeps all of it.
"""
from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, TextIO

from tqdm.auto import tqdm

log = logging.getLogger("roformer.train")

PLAIN_EVERY_S = 30.0


def progress_bar(*, total: int, initial: int = 0, desc: str, enabled: bool = True,
                 every_s: float = PLAIN_EVERY_S, stream: TextIO | None = None):
    """A tqdm bar when `stream` (stderr) is a terminal, else a `PlainProgress` with the same
    `update`, `set_postfix` and `close`; a disabled tqdm bar when not `enabled`."""
    stream = sys.stderr if stream is None else stream
    if not enabled:
        return tqdm(disable=True)
    if _is_terminal(stream):
        return tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True, file=stream)
    return PlainProgress(total=total, initial=initial, desc=desc, every_s=every_s)


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):   # no isatty, or a closed stream
        return False


class PlainProgress:
    """A progress bar's calls as a log line every `every_s` seconds (and one at `close`)."""

    def __init__(self, *, total: int, initial: int = 0, desc: str, every_s: float = PLAIN_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.total, self.n, self.desc, self.every_s = total, initial, desc, every_s
        self._clock = clock
        self._start_n = initial
        self._last_t = clock()
        self._first: tuple[int, float] | None = None   # (step, time) of the first update: the rate
        # counts from there, leaving out the first step's compilation
        self._postfix: dict[str, Any] = {}
        self._closed = False

    def update(self, n: int = 1) -> None:
        self.n += n
        now = self._clock()
        if self._first is None:
            self._first = (self.n, now)
        if now - self._last_t >= self.every_s:
            self._last_t = now
            log.info("%s", self.line(now))

    def set_postfix(self, **values: Any) -> None:
        self._postfix = values

    def close(self) -> None:
        if not self._closed and self.n > self._start_n:
            log.info("%s", self.line(self._clock()))
        self._closed = True

    def __enter__(self) -> PlainProgress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def line(self, now: float) -> str:
        parts = [f"{self.desc}: step {self.n:,} of {self.total:,} ({100 * self.n / max(self.total, 1):.0f}%)"]
        rate = 0.0
        if self._first is not None and now > self._first[1]:
            rate = (self.n - self._first[0]) / (now - self._first[1])
        if rate > 0:
            parts.append(f"{rate:.3g} steps/s")
            if self.n < self.total:
                parts.append(f"{duration((self.total - self.n) / rate)} left")
        parts += [f"{key} {value}" for key, value in self._postfix.items()]
        return ", ".join(parts)


def duration(seconds: float) -> str:
    """`seconds` as a person reads it: 42s, 3m05s, 2h07m."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def announce_compile(fn: Callable, what: str, *, enabled: bool = True) -> Callable:
    """`fn`, whose first call logs "compiling <what> ..." before and "compiled <what> in Ns"
    after (the call that traces and compiles a jitted function; its execution is
    asynchronous and not counted). `enabled=False`: `fn` itself."""
    return CompileNotice(fn, what) if enabled else fn


class CompileNotice:
    """A jitted function whose first call is announced (`announce_compile`); its other
    attributes are the function's."""

    def __init__(self, fn: Callable, what: str) -> None:
        self._fn, self._what, self._pending = fn, what, True

    def __call__(self, *args, **kwargs):
        if not self._pending:
            return self._fn(*args, **kwargs)
        self._pending = False
        log.info("compiling %s ...", self._what)
        start = time.perf_counter()
        out = self._fn(*args, **kwargs)
        log.info("compiled %s in %.1fs", self._what, time.perf_counter() - start)
        return out

    def __getattr__(self, name: str):
        return getattr(self._fn, name)


def stop_signal(summary: Mapping[str, Any]) -> str:
    """The signal that stopped a preempted run (SIGTERM, or SIGINT for Ctrl-C); a summary
    written before runs recorded it says either."""
    return summary.get("stop_signal") or "SIGTERM or Ctrl-C"


def summary_line(summary: Mapping[str, Any]) -> str:
    """The run's summary (summary.json) as one short line."""
    if summary.get("start_step"):
        steps = f"steps {summary['start_step']:,}-{summary['final_step']:,}"
    else:
        steps = f"{summary['final_step']:,} steps"
    parts = [steps + (f" (stopped: {stop_signal(summary)})" if summary.get("preempted") else "")]
    if summary.get("first_loss") is not None and summary.get("final_loss") is not None:
        parts.append(f"train loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f}")
    if summary.get("eval_loss") is not None:
        held_out = f"held-out loss {summary['eval_loss']:.3f}"
        if summary.get("eval_mlm_accuracy") is not None:
            held_out += f", accuracy {100 * summary['eval_mlm_accuracy']:.1f}%"
        if summary.get("eval_order_gap") is not None:
            held_out += f", order gap {summary['eval_order_gap']:+.3f}"
        parts.append(held_out)
    if summary.get("tokens_per_sec"):
        parts.append(f"{summary['tokens_per_sec']:,.0f} tokens/s" +
                     (f" (MFU {100 * summary['mfu']:.1f}%)" if summary.get("mfu") else ""))
    if summary.get("wall_time_s") is not None:
        parts.append(duration(summary["wall_time_s"]))
    where = f" (all of it in {summary['workdir']}/summary.json)" if summary.get("workdir") else ""
    return "summary: " + "; ".join(parts) + where
