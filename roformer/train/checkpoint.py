"""Orbax checkpoints of the training state, data-iterator state and model config.

Layout: `workdir/checkpoints/<step>/{state,data,model_config[,metrics]}`. Saves are
async and keep the last K, plus the one with the lowest held-out loss (`metrics`, saved
with a checkpoint taken right after an evaluation), so a run that diverged cannot rotate
its best checkpoint away. A save that fails (a full disk) stops the run at that save, or
at the first log row after it, with one line; its partial step directory is removed.
Restore walks back from the newest step, so a corrupt or partial newest checkpoint is
moved aside with a warning and the previous one is used; when none is readable,
training starts from step 0 with a warning that says so.
"""
from __future__ import annotations

import errno
import json
import logging
import math
import shutil
import sys
import threading
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.experimental import multihost_utils

from roformer.data.tokenizer import WordPieceTokenizer
from roformer.errors import ConfigError
from roformer.model import ModelConfig, RoFormerForMaskedLM
from roformer.train.guard import CheckpointSaveFailed

log = logging.getLogger("roformer.train")

ITEMS = ("state", "data", "model_config")
CHECKPOINTS = "checkpoints"   # a pretraining workdir's checkpoint directory


def _allgather_json(obj: Any) -> list[Any]:
    """Every process's JSON-serialisable `obj`, in process order (data iterators are
    per process, while orbax writes JSON items from process 0 only)."""
    if jax.process_count() == 1:
        return [obj]
    encoded = np.frombuffer(json.dumps(obj).encode(), dtype=np.uint8)
    lengths = multihost_utils.process_allgather(np.array([encoded.size], np.int32))
    padded = np.zeros(int(lengths.max()), np.uint8)
    padded[:encoded.size] = encoded
    gathered = multihost_utils.process_allgather(padded)
    return [json.loads(bytes(row[:n]).decode()) for row, n in zip(gathered, lengths.reshape(-1))]


def _code_in(tb) -> list:
    """The code objects of a traceback's frames, outermost first."""
    codes = []
    while tb is not None:
        codes.append(tb.tb_frame.f_code)
        tb = tb.tb_next
    return codes


def _is_closed_loop_callback(unraisable) -> bool:
    """A RuntimeError('Event loop is closed') from asyncio's call_soon_threadsafe, called
    from outside Python (no object): a tensorstore read completing after orbax closed the
    event loop that awaited it."""
    error = unraisable.exc_value
    if not isinstance(error, RuntimeError) or str(error) != "Event loop is closed" or unraisable.object:
        return False
    return any(code.co_name == "call_soon_threadsafe" for code in _code_in(unraisable.exc_traceback))


class _AbandonedOrbaxTasks(logging.Filter):
    """asyncio's 'Task/Future exception was never retrieved' for an error raised in orbax, or
    for a tensorstore read orbax had stopped awaiting: that one is set on its future from
    C++, so it carries no traceback to show where it came from, only tensorstore's spec in
    its text (seen once in a test run under load)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        if not message.startswith(("Task exception was never retrieved", "Future exception was never retrieved")):
            return True
        error, tb = (record.exc_info[1], record.exc_info[2]) if record.exc_info else (None, None)
        if tb is None and "tensorstore_spec" in str(error):
            return False
        files = [code.co_filename for code in _code_in(tb)]
        return not any("orbax/checkpoint" in name for name in [message, *files])


class _UnrequestedItems(logging.Filter):
    """orbax's warning that a checkpoint item was 'found in the checkpoint, but could not be
    restored', for one of our own items: a restore that asks for some of them (the model
    config alone, or the parameters without the iterator state) leaves the others unread
    on purpose, and a resume would otherwise print one such line per item left."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("Item ") and "was found in the checkpoint, but could not be restored" in message
                    and any(f'"{item}"' in message.split(" was found")[0] for item in ITEMS))


def _quiet_unrequested_items() -> None:
    """Install _UnrequestedItems on orbax's logger (absl's), once per process."""
    absl_log = logging.getLogger("absl")
    if not any(isinstance(f, _UnrequestedItems) for f in absl_log.filters):
        absl_log.addFilter(_UnrequestedItems())


def _quiet_failed_restores() -> None:
    """Silence the echo of a failed restore (installed once per process, before the first).

    When one array of a checkpoint cannot be read, orbax's restore raises at once and
    closes the event loop it ran on, while tensorstore still finishes the other reads
    and orbax's other tasks still end: each finished read then calls
    `loop.call_soon_threadsafe` on the closed loop, which Python prints as an unraisable
    RuntimeError, and each orphaned task that failed is logged by asyncio as 'Task (or
    Future) exception was never retrieved'. That is hundreds of tracebacks after one
    corrupt checkpoint, saying nothing the restore error did not. Exactly those are
    dropped; every other unraisable exception goes to the previous hook."""
    asyncio_log = logging.getLogger("asyncio")
    if not any(isinstance(f, _AbandonedOrbaxTasks) for f in asyncio_log.filters):
        asyncio_log.addFilter(_AbandonedOrbaxTasks())
    if getattr(sys.unraisablehook, "drops_closed_loop_callbacks", False):
        return
    previous = sys.unraisablehook

    def hook(unraisable) -> None:
        if not _is_closed_loop_callback(unraisable):
            previous(unraisable)

    hook.drops_closed_loop_callbacks = True
    sys.unraisablehook = hook


class _PendingSaveErrors(logging.Filter):
    """Drops orbax's own ERROR logs (tracebacks from its background threads) while a save
    of ours is pending: `Checkpointer` reports that save's failure itself, on one line."""

    def __init__(self):
        super().__init__()
        self.pending = 0

    def filter(self, record: logging.LogRecord) -> bool:
        return not (self.pending and record.levelno >= logging.ERROR and "orbax/checkpoint" in record.pathname)


_SAVE_ERRORS = _PendingSaveErrors()
_SAVE_ERRORS_LOCK = threading.Lock()


def _install_save_error_filter() -> None:
    absl_log = logging.getLogger("absl")   # orbax logs through absl
    with _SAVE_ERRORS_LOCK:
        if _SAVE_ERRORS not in absl_log.filters:
            absl_log.addFilter(_SAVE_ERRORS)


def _eval_loss(metrics) -> float:
    """Rank of a checkpoint's metrics for retention: its held-out loss (lower is better)."""
    loss = float((metrics or {}).get("eval_loss", math.inf))
    return loss if math.isfinite(loss) else math.inf


def _why(error: BaseException) -> str:
    """A failed save's cause in a few words: 'no space left on device', else the first
    line of the innermost error."""
    chain, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        chain.append(error)
        error = error.__cause__ or error.__context__
    for item in chain:
        if getattr(item, "errno", None) == errno.ENOSPC or "No space left on device" in str(item) \
                or f"os_error_code='{errno.ENOSPC}'" in str(item):
            return "no space left on device"
    innermost = chain[-1]
    first = (str(innermost).strip().splitlines() or [""])[0][:300]
    return f"{type(innermost).__name__}: {first}" if first else type(innermost).__name__


def _megabytes(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


class Checkpointer:
    """Thin wrapper over `ocp.CheckpointManager` for this training loop."""

    # A save with less free space than this many times its size is waited for, so that a
    # full disk stops the run at the save that hit it.
    NEARLY_FULL = 2.0

    def __init__(self, directory: str | Path, *, max_to_keep: int, async_save: bool = True):
        self.directory = Path(directory).resolve()
        CM = ocp.checkpoint_managers
        # The newest `max_to_keep`, and the lowest held-out loss among those saved with one.
        retention = CM.AnyPreservationPolicy([
            CM.LatestN(n=max_to_keep),
            CM.BestN(get_metric_fn=_eval_loss, reverse=True, n=1, keep_checkpoints_without_metrics=False)])
        options = ocp.CheckpointManagerOptions(
            preservation_policy=retention, best_fn=_eval_loss, best_mode="min",   # best_fn: metrics are saved
            create=True, enable_async_checkpointing=async_save)
        _quiet_unrequested_items()   # saved_model_config and restore_latest each read some of the items
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)
        self._closed = False
        self._pending: dict | None = None   # the save in flight: step, bytes, free space
        _install_save_error_filter()

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def best_step(self) -> int | None:
        """The checkpoint with the lowest held-out loss among those saved with one."""
        try:
            step = self.manager.best_step()
            return step if step is not None and _eval_loss(self.manager.metrics(step)) < math.inf else None
        except Exception:  # noqa: BLE001 - an unreadable metrics file ranks nothing
            return None

    def save(self, step: int, state, data_state: dict, model_config: dict, *,
             metrics: dict | None = None, optimizer: dict | None = None) -> None:
        """Start an async save (collective: every process calls it). `metrics` (the held-out
        loss at this step, when evaluated) rank it for retention; `optimizer` (the settings
        the state was trained with) goes into the step's metadata. On a nearly full disk the
        save is waited for; a failure raises CheckpointSaveFailed."""
        self.wait()   # the previous save's outcome first (orbax would wait for it too)
        data_states = {f"process_{i}": s for i, s in enumerate(_allgather_json(data_state))}
        needed = sum(leaf.nbytes for leaf in jax.tree.leaves(state) if hasattr(leaf, "nbytes"))
        free = shutil.disk_usage(self.directory).free
        self._begin(step, needed, free)
        items = ocp.args.Composite(state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_states),
                                   model_config=ocp.args.JsonSave(model_config))
        try:
            # {} without an evaluation: ranked last (orbax warns about a save without metrics)
            self.manager.save(step, force=True, args=items, metrics=metrics or {},
                              custom_metadata={"optimizer": optimizer} if optimizer else None)
            if free < self.NEARLY_FULL * needed:
                self.manager.wait_until_finished()
        except Exception as error:  # noqa: BLE001 - any failed write stops the run, said once
            self._failed(error)

    def saved_optimizer(self, step: int) -> dict | None:
        """The optimizer settings saved with `step` (None for checkpoints that predate them)."""
        try:
            return dict(self.manager.metadata(step).custom_metadata.get("optimizer") or {}) or None
        except Exception:  # noqa: BLE001 - unreadable metadata: nothing to compare with
            return None

    def check(self) -> None:
        """Raise CheckpointSaveFailed if the last save failed; does not wait for one in flight.
        (One process only: processes could see the save's end at different times, and a
        multi-process run learns of a failure at its next save.)"""
        if self._pending is None or jax.process_count() > 1 or self.manager.is_saving_in_progress():
            return
        try:
            self.manager.wait_until_finished()   # finished: returns at once, or raises its error
        except Exception as error:  # noqa: BLE001
            self._failed(error)
        self._end()

    def _begin(self, step: int, needed: int, free: int) -> None:
        self._pending = {"step": step, "needed": needed, "free": free}
        _SAVE_ERRORS.pending += 1

    def _end(self) -> None:
        if self._pending is not None:
            self._pending = None
            _SAVE_ERRORS.pending -= 1

    def _failed(self, error: Exception) -> None:
        pending, self._pending = self._pending or {}, None
        _SAVE_ERRORS.pending -= 1 if pending else 0
        step = pending.get("step")
        self._remove_partial(step)
        latest, why = self.latest_step(), _why(error)
        fix = "free some space" if why == "no space left on device" else "fix that"
        raise CheckpointSaveFailed(
            f"could not save the checkpoint at step {step} in {self.directory}: {why} (it needs about "
            f"{_megabytes(pending.get('needed', 0))}; {_megabytes(pending.get('free', 0))} were free); stopping. "
            + (f"The last good checkpoint is step {latest}; {fix} and run the same command again to resume "
               "from it" if latest is not None else f"No checkpoint was saved before it; {fix} and start again")
        ) from error

    def _remove_partial(self, step: int | None) -> None:
        """Remove what the failed save of `step` left (orbax's temporary directory), so the
        next run neither trips on it nor counts it as a checkpoint."""
        if step is None or jax.process_index() != 0:
            return
        for path in self.directory.glob(f"{step}.orbax-checkpoint-tmp*"):
            shutil.rmtree(path, ignore_errors=True)
        finished = self.directory / str(step)
        if finished.exists() and step not in self.manager.all_steps():
            shutil.rmtree(finished, ignore_errors=True)
        self.manager.reload()

    def saved_model_config(self) -> dict | None:
        """Model config of the newest readable checkpoint, or None when there is none."""
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                restored = self.manager.restore(step, args=ocp.args.Composite(
                    model_config=ocp.args.JsonRestore()))
                return dict(restored["model_config"])
            except Exception:  # a corrupt step is reported by restore_latest
                continue
        return None

    def restore_latest(self, abstract_state) -> tuple[int, Any, dict | None] | None:
        """(step, state, this process's data-iterator state) from the newest readable
        checkpoint; None if the directory holds none (then training starts from step 0,
        said in one warning when unreadable checkpoints were moved aside). `abstract_state`
        carries the shapes, dtypes and shardings to restore into."""
        _quiet_failed_restores()
        steps = sorted(self.manager.all_steps(), reverse=True)
        for index, step in enumerate(steps):
            try:
                restored = self.manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state),
                    data=ocp.args.JsonRestore()))
            except Exception as error:  # noqa: BLE001 - any unreadable step is skipped
                self._move_aside(step, error, next_step=steps[index + 1] if index + 1 < len(steps) else None)
                continue
            data = restored["data"] or {}
            return step, restored["state"], data.get(f"process_{jax.process_index()}")
        if steps:
            log.warning("no readable checkpoint in %s; starting from step 0 (the unreadable ones are in %s)",
                        self.directory, self.directory.parent / "corrupt_checkpoints")
        return None

    def _move_aside(self, step: int, error: Exception, *, next_step: int | None) -> None:
        aside = self.directory.parent / "corrupt_checkpoints" / str(step)
        log.warning("checkpoint at step %d in %s is unreadable (%s: %s); moving it to %s%s", step,
                    self.directory, type(error).__name__, str(error).splitlines()[0][:200], aside,
                    "" if next_step is None else f" and trying step {next_step}")
        self.set_aside([step], "corrupt_checkpoints")

    def set_aside(self, steps: list[int], folder: str) -> Path:
        """Move the checkpoints of `steps` to `workdir/<folder>/<step>` (collective), so the
        next run resumes from an earlier one; returns that folder."""
        aside = self.directory.parent / folder
        if jax.process_index() == 0:
            for step in steps:
                aside.mkdir(parents=True, exist_ok=True)
                if (aside / str(step)).exists():
                    shutil.rmtree(aside / str(step))
                shutil.move(str(self.directory / str(step)), str(aside / str(step)))
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"roformer_set_aside_{folder}_{'_'.join(map(str, steps))}")
        self.manager.reload()
        return aside

    def steps_after(self, step: int) -> list[int]:
        return [s for s in self.manager.all_steps() if s > step]

    def wait(self) -> None:
        """Wait for the save in flight; CheckpointSaveFailed if it failed."""
        if self._pending is None:
            self.manager.wait_until_finished()
            return
        try:
            self.manager.wait_until_finished()
        except Exception as error:  # noqa: BLE001
            self._failed(error)
        self._end()

    def close(self) -> None:
        """Waits for pending saves and stops orbax's background workers; safe to call twice.
        A save that failed in the meantime is reported (CheckpointSaveFailed)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait()
        finally:
            self.manager.close()


# --------------------------------------------------------------------------- reading a run


class PretrainWorkdir:
    """Read-only view of a pretraining workdir written by `train_and_evaluate`: the model
    config and parameters of a checkpoint step and the tokenizer the run used.

    The one reader of that layout (roformer.checkpoint_source for warm starts and GLUE init,
    convert, extrapolation and the ablation use it), kept beside the writer above so the two
    change together."""

    def __init__(self, path: str | Path):
        self.path = Path(path).expanduser().resolve()
        self.checkpoints = self.path / CHECKPOINTS
        if not self.path.is_dir():
            raise ConfigError(f"{path}: no such directory (expected a pretraining workdir)")
        if not self.checkpoints.is_dir():
            raise ConfigError(f"{path} is not a pretraining workdir: it has no checkpoints/ directory")

    @staticmethod
    def holds_run(path: str | Path) -> bool:
        """Whether `path` is a pretraining workdir (it has a checkpoints/ directory)."""
        return (Path(path).expanduser() / CHECKPOINTS).is_dir()

    def steps(self) -> list[int]:
        return sorted(int(p.name) for p in self.checkpoints.iterdir() if p.name.isdigit())

    def resolve_step(self, step: int = -1) -> int:
        """`step`, or the newest one when step < 0; a step without a checkpoint is refused."""
        steps = self.steps()
        if not steps:
            raise ConfigError(f"{self.path} has no checkpoint yet (checkpoints/ is empty)")
        if step < 0:
            return steps[-1]
        if step not in steps:
            raise ConfigError(f"{self.path} has no checkpoint at step {step} (it has steps {steps})")
        return step

    def _manager(self) -> ocp.CheckpointManager:
        _quiet_unrequested_items()   # model_config and params each read some of the items
        return ocp.CheckpointManager(self.checkpoints, item_names=ITEMS)

    def model_config(self, step: int = -1):
        step = self.resolve_step(step)
        with self._manager() as manager:
            saved = manager.restore(step, args=ocp.args.Composite(model_config=ocp.args.JsonRestore()))
        return ModelConfig.from_dict(ModelConfig.saved_fields(saved["model_config"]))

    def params(self, step: int = -1, *, encoder_only: bool = False) -> tuple[Any, dict]:
        """(ModelConfig, parameters as a pure nested dict on one local device) of `step`.

        The MLM model's parameters, or with `encoder_only` just `RoFormerModel`'s (the
        `roformer` subtree); the optimizer state is not read. Any mesh may have saved them."""
        step = self.resolve_step(step)
        config = self.model_config(step)
        # Plain shapes (jax.eval_shape of the pure dict): nnx.eval_shape would attach the
        # declared logical axes, which a caller's active mesh cannot resolve.
        abstract = jax.eval_shape(lambda: nnx.to_pure_dict(nnx.state(
            RoFormerForMaskedLM(config, rngs=nnx.Rngs(0)), nnx.Param)))
        if encoder_only:
            abstract = {"roformer": abstract["roformer"]}
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        target = {"params": jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                                         abstract)}
        with self._manager() as manager:
            restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
                item=target, partial_restore=True,
                restore_args=jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding), target))))
        params = restored["state"]["params"]
        return config, params["roformer"] if encoder_only else params

    def run_config(self) -> dict:
        """The resolved config the run wrote (config.json), or {} for a workdir without one."""
        path = self.path / "config.json"
        return json.loads(path.read_text()) if path.is_file() else {}

    @property
    def tokenizer_file(self) -> Path:
        return self.path / "tokenizer.json"

    def tokenizer(self):
        if not self.tokenizer_file.is_file():
            raise ConfigError(f"{self.path} has no tokenizer.json (pretraining writes it at start-up)")
        return WordPieceTokenizer.from_tokenizer_json(self.tokenizer_file)
