"""Run logging: one writer (`MetricsWriter`) sends every metrics row to its backends,
metrics.jsonl and TensorBoard events, and a Weights & Biases run where asked for
(ROFORMER_WANDB_PROJECT), on process 0 only; and the training throughput (tokens/s, MFU)
that goes into them."""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import secrets
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

import jax

from roformer.errors import ConfigError
from roformer.files import write_text_atomic, writing
from roformer.train import flops

log = logging.getLogger("roformer.train")


def _jsonable(value):
    value = float(value) if hasattr(value, "__float__") and not isinstance(value, (int, bool)) else value
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)   # JSON has no NaN/inf; keep them readable
    return value


class MetricsBackend(Protocol):
    """Where metric rows go: one call per row (`row`: the step's values, JSON-ready; `section`:
    "train" or "eval", the prefix of its charts' tags), then `close`. `MetricsWriter` calls
    each of its backends in turn."""

    def write(self, step: int, row: Mapping[str, Any], section: str) -> None: ...

    def close(self) -> None: ...


SECTIONS = ("train", "eval")


def charted(row: Mapping[str, Any], section: str) -> dict[str, float]:
    """The chart values of a row, `section/name` -> value: its numbers, less `step` (the x axis,
    not a metric) and its labels (GLUE's task text; bools)."""
    return {f"{section}/{name}": value for name, value in row.items()
            if name != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)}


class JsonlBackend:
    """`workdir/metrics.jsonl`, one JSON object per row: `labels` (GLUE's task and seed), then
    `step`, then the row, whose keys stay as given (no section prefix: readers depend on them).
    `resume_step`: rows an earlier, interrupted attempt logged past it are dropped first, so the
    steps run again are logged once."""

    def __init__(self, workdir: Path, *, resume_step: int | None = None, labels: Mapping[str, Any] | None = None):
        self.path = workdir / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        check_metrics_file(workdir)
        if resume_step is not None:
            _drop_rows_after(self.path, resume_step)
        self.labels = dict(labels or {})
        self._file = open(self.path, "a", encoding="utf-8")

    def write(self, step: int, row: Mapping[str, Any], section: str = "train") -> None:
        self._file.write(json.dumps({**self.labels, "step": int(step), **row}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardBackend:
    """TensorBoard events in `logdir`: each row's numbers as `train/...` or `eval/...` scalars,
    and the run's resolved `config` as text (tag `config`) and as hparams. Rows past
    `resume_step` that an earlier attempt wrote are hidden (TensorBoard's purge_step)."""

    def __init__(self, logdir: Path, *, resume_step: int | None = None, config: Mapping[str, Any] | None = None):
        from tensorboardX import SummaryWriter  # imported here: heavy (protobuf), only process 0 needs it
        self._tb = SummaryWriter(str(logdir), purge_step=None if resume_step is None else resume_step + 1)
        if config is not None:
            self._record_config(config, resume_step or 0)

    def _record_config(self, config: Mapping[str, Any], step: int) -> None:
        from tensorboardX.summary import hparams

        text = json.dumps(config, indent=2, default=str)
        self._tb.add_text("config", "\n".join("    " + line for line in text.splitlines()), step)  # a code block
        for summary in hparams(flat_settings(config), {}):   # the HParams tab: experiment, start, end
            self._tb.file_writer.add_summary(summary)
        self._tb.flush()

    def write(self, step: int, row: Mapping[str, Any], section: str = "train") -> None:
        for tag, value in charted(row, section).items():
            self._tb.add_scalar(tag, value, int(step))
        self._tb.flush()

    def close(self) -> None:
        self._tb.close()


def flat_settings(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as dotted keys -> numbers, text or bools (lists as their text; None left out)."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flat_settings(value, f"{name}."))
        elif value is not None:
            flat[name] = value if isinstance(value, (bool, int, float, str)) else str(value)
    return flat


class WandbBackend:
    """A Weights & Biases run (`wandb`, not a dependency: `pip install wandb`) in `project`,
    its files under `workdir/wandb`, its charts `train/...` and `eval/...`. By default its id is
    kept in `workdir/wandb_run_id`, so a resumed run continues the same W&B run, and its config
    is the run's resolved config (workdir/config.json); `name`, `group`, `config` and
    `keep_id=False` (a fresh run each time: a GLUE task trains from scratch) set them otherwise.
    W&B's own settings (WANDB_MODE=offline, WANDB_ENTITY, the API key) apply."""

    RUN_ID_FILE = "wandb_run_id"

    def __init__(self, workdir: Path, project: str, *, name: str | None = None, group: str | None = None,
                 config: Mapping[str, Any] | None = None, keep_id: bool = True) -> None:
        try:
            import wandb
        except ImportError as error:
            raise ConfigError(f"{WANDB_PROJECT_ENV}={project}: W&B logging needs the wandb package "
                              "(pip install wandb)") from error
        id_file = workdir / self.RUN_ID_FILE
        if keep_id and id_file.is_file():
            run_id = id_file.read_text().strip()
        else:
            run_id = secrets.token_hex(8)
            if keep_id:
                write_text_atomic(id_file, run_id + "\n")
        config = run_config(workdir) if config is None else config
        name = name or "/".join(workdir.resolve().parts[-2:])   # runs/tiny, rope/seed0 (an ablation's run)
        self.run = wandb.init(project=project, id=run_id, resume="allow", dir=str(workdir), name=name,
                              group=group, config=dict(config) if config is not None else None)

    def write(self, step: int, row: Mapping[str, Any], section: str = "train") -> None:
        self.run.log(charted(row, section), step=int(step))

    def close(self) -> None:
        self.run.finish()


# W&B logging is on for a run when this names a project (and off by default): a switch of
# the environment, like W&B's own settings, so that the run's config and its fingerprints
# do not depend on where its metrics are mirrored.
WANDB_PROJECT_ENV = "ROFORMER_WANDB_PROJECT"


def wandb_project() -> str:
    """The W&B project ROFORMER_WANDB_PROJECT names ('' = no W&B)."""
    return os.environ.get(WANDB_PROJECT_ENV, "").strip()


def run_config(workdir: Path) -> dict | None:
    """The resolved config a run wrote (workdir/config.json), None before it is written."""
    config_file = workdir / "config.json"
    return json.loads(config_file.read_text()) if config_file.is_file() else None


def default_backends(workdir: Path, *, resume_step: int | None = None) -> list[MetricsBackend]:
    """metrics.jsonl and TensorBoard (with the run's config.json), and W&B where
    ROFORMER_WANDB_PROJECT names a project."""
    backends: list[MetricsBackend] = [
        JsonlBackend(workdir, resume_step=resume_step),
        TensorBoardBackend(workdir / "tensorboard", resume_step=resume_step, config=run_config(workdir))]
    if wandb_project():
        backends.append(WandbBackend(workdir, wandb_project()))
    return backends


class MetricsWriter:
    """A run's metrics, one row per `write`, to each backend: by default metrics.jsonl and
    TensorBoard events in `workdir` (and W&B: `default_backends`); pretraining and GLUE
    (roformer.glue.run) both log through it. No-op on processes other than 0, so multi-host
    runs write one log.

    `resume_step`: the step training (re)starts from. Rows logged past it by an earlier,
    interrupted attempt are dropped first (and hidden in TensorBoard), so the steps run
    again are logged once. `what`: the outputs a full disk's one-line error names."""

    def __init__(self, workdir: str | Path, *, enabled: bool | None = None, resume_step: int | None = None,
                 backends: Callable[..., list[MetricsBackend]] = default_backends, what: str | None = None):
        self.enabled = jax.process_index() == 0 if enabled is None else enabled
        self.path = Path(workdir) / "metrics.jsonl"
        # what a full disk's one line names
        self.what = what or f"the metrics of {self.path.parent} (metrics.jsonl, tensorboard/)"
        self._backends: list[MetricsBackend] = []
        if self.enabled:
            self._backends = backends(Path(workdir), resume_step=resume_step)

    def write(self, step: int, scalars: Mapping[str, float], *, section: str = "train") -> None:
        """One row; `section` ("train" or "eval") prefixes its TensorBoard and W&B tags."""
        if section not in SECTIONS:
            raise ValueError(f"section {section!r}: one of {SECTIONS}")
        if not self.enabled:
            return
        row = {k: _jsonable(v) for k, v in scalars.items()}
        with writing(self.what):
            for backend in self._backends:
                backend.write(step, row, section)

    def close(self) -> None:
        if self.enabled:
            self.enabled = False
            with writing(self.what):
                for backend in self._backends:
                    backend.close()


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

    def restart(self) -> None:
        """The next step compiles again (a program of another shape): like the first, it only
        starts the clock, and the steps of the interval so far are dropped with their time."""
        self._start, self._steps, self._paused = None, 0, 0.0

    @contextlib.contextmanager
    def paused(self, ready=None):
        """Leave the block's time out of the throughput. `ready`: arrays the block will wait for
        (the train state); waited for first, so the steps still running on the device count as
        training, not as the pause."""
        if ready is not None:
            jax.block_until_ready(ready)
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
    if kept.encode() != path.read_bytes():
        write_text_atomic(path, kept)


def check_metrics_file(workdir: Path) -> None:
    """Refuse in one line a workdir whose metrics.jsonl is not a file the run can append to."""
    if (workdir / "metrics.jsonl").is_dir():
        raise ConfigError(f"{workdir / 'metrics.jsonl'} is a directory, not the run's metrics log: move it aside "
                          "(the run writes its metrics there)")


def read_metrics(path: str | Path) -> list[dict]:
    """All rows of a run's `metrics.jsonl` (`path` is the workdir or the file itself),
    for tests, notebooks and the ablation report.  A torn last line (run killed
    mid-write) is skipped; a missing file gives no rows. A damaged line elsewhere (not
    UTF-8 text, not a JSON object, a step that is no integer: bit rot, binary junk) is
    skipped too, said in one warning; a directory in the file's place is refused in one line."""
    path = Path(path)
    if path.is_dir() and path.name != "metrics.jsonl":
        path = path / "metrics.jsonl"
    check_metrics_file(path.parent)
    if not path.exists():
        return []
    rows, damaged = [], []
    lines = path.read_bytes().split(b"\n")
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            row = None
        if isinstance(row, dict) and isinstance(row.get("step", 0), int) and not isinstance(row.get("step"), bool):
            rows.append(row)
        elif number < len(lines) - (lines[-1] == b""):   # not the torn last line of a killed run
            damaged.append(number)
    if damaged:
        log.warning("%s: skipped %d damaged line(s) (line %s%s): not a JSON row of metrics", path, len(damaged),
                    damaged[0], ", ..." if len(damaged) > 1 else "")
    return rows
