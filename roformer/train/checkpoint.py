"""Orbax checkpoints of the training state, data-iterator state and model config.

Layout: `workdir/checkpoints/<step>/{state,data,model_config[,metrics]}` (read by
roformer.workdir). Saves are async and keep the last K, plus the one with the lowest
held-out loss (`metrics`, saved with a checkpoint taken right after an evaluation), so a
run that diverged cannot rotate its best checkpoint away. A save that fails (a full disk) stops the run at that save, or
at the first log row after it, with one line; orbax's own errors of that save are not echoed
(its writer threads may report theirs after the first has failed the save: they are waited
for when the Checkpointer closes), and its partial step directory is removed, again at close
and, for a run killed meanwhile, when the next run opens the directory.
Once a save is complete its files' checksums are recorded beside them (roformer.checksums)
and checked before any restore, so damage that still decodes (a flipped bit) is found too.
Restore walks back from the newest step, so a corrupt, partial or damaged newest checkpoint
is moved aside with a warning and the previous one is used; when none is readable,
training starts from step 0 with a warning that says so.
"""
from __future__ import annotations

import errno
import logging
import math
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from roformer import checksums, orbax_logs
from roformer.distributed import allgather_json
from roformer.errors import ConfigError
from roformer.train.guard import CheckpointSaveFailed
from roformer.workdir import ITEMS, damage_read_at_open

# What orbax says when a checkpoint's state has another tree than the one restored into.
STRUCTURE_MISMATCH = "tree structures do not match"

log = logging.getLogger("roformer.train")


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
    # How long close() waits for orbax's writer threads of a failed save to end.
    FAILED_SAVE_WAIT_S = 30.0

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
        orbax_logs.quiet_unrequested_items(ITEMS)   # saved_model_config and restore_latest each read some of the items
        self._set_aside_unopenable()
        self._remove_partial(None)   # what a save in flight when a run was killed left
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)
        self._closed = False
        self._failed_step: int | None = None   # the step whose save failed (CheckpointSaveFailed raised)
        self._pending: dict | None = None   # the save in flight: step, bytes, free space
        self._verified: set[int] = set()      # steps whose files matched their checksums
        self._save_errors = orbax_logs.save_errors()

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
        # data iterators are per process, while orbax writes JSON items from process 0 only
        data_states = {f"process_{i}": s for i, s in enumerate(allgather_json(data_state))}
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
        self._save_errors.pending += 1

    def _end(self) -> None:
        """The save in flight completed: record its checksums (roformer.checksums), which every
        restore checks, then forget it."""
        if self._pending is not None:
            if jax.process_index() == 0:
                try:
                    checksums.write(self.directory / str(self._pending["step"]))
                except OSError as error:   # a full disk: the step stays, unverified
                    self._failed(error)
            self._pending = None
            self._save_errors.pending -= 1

    def _failed(self, error: Exception) -> None:
        # orbax's errors stay quiet (save_errors) until close(): its other writer threads of
        # this save may still be running, and report their own failures when they end.
        pending, self._pending = self._pending or {}, None
        step = pending.get("step")
        if pending:
            self._failed_step = step
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
        """Remove what the failed save of `step` (None: of any step, before the manager opens)
        left: orbax's temporary directory, so the next run neither trips on it nor counts it
        as a checkpoint."""
        if jax.process_index() != 0 or not self.directory.is_dir():
            return
        for path in self.directory.glob(f"{'*' if step is None else step}.orbax-checkpoint-tmp*"):
            shutil.rmtree(path, ignore_errors=True)
        if step is None:
            return
        finished = self.directory / str(step)
        if finished.exists() and step not in self.manager.all_steps():
            shutil.rmtree(finished, ignore_errors=True)
        self.manager.reload()

    def saved_model_config(self) -> dict | None:
        """Model config of the newest readable checkpoint, or None when there is none."""
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                self._verify(step)
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
        orbax_logs.quiet_failed_restores()
        steps = sorted(self.manager.all_steps(), reverse=True)
        for index, step in enumerate(steps):
            try:
                self._verify(step)
                restored = self.manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state),
                    data=ocp.args.JsonRestore()))
            except Exception as error:  # noqa: BLE001 - any unreadable step is skipped
                if STRUCTURE_MISMATCH in str(error):
                    # Intact (its checksums passed) but not this program's state: another
                    # optimizer's, say. Moving it aside would lose a run that is not damaged.
                    raise ConfigError(
                        f"checkpoint at step {step} in {self.directory} holds a train state of another structure "
                        "than this run's (another optimizer: e.g. a group of seeds at rates of their own, "
                        "roformer.train.seeds, keeps each member's rate in its optimizer state); left as it is. "
                        "Resume it with the command that wrote it, or train in another workdir") from error
                self._move_aside(step, error, next_step=steps[index + 1] if index + 1 < len(steps) else None)
                continue
            data = restored["data"] or {}
            return step, restored["state"], data.get(f"process_{jax.process_index()}")
        if steps:
            log.warning("no readable checkpoint in %s; starting from step 0 (the unreadable ones are in %s)",
                        self.directory, self.directory.parent / "corrupt_checkpoints")
        return None

    def _verify(self, step: int) -> None:
        """Check `step`'s files against the checksums saved with them, once per step
        (ChecksumMismatch when they differ; a step saved without checksums passes)."""
        if step not in self._verified:
            checksums.verify(self.directory / str(step))
            self._verified.add(step)

    def _set_aside_unopenable(self) -> None:
        """Move aside the steps whose metadata orbax reads when it opens the directory, before
        it does: one damaged byte there would fail the open, and so every restore
        (roformer.workdir.damage_read_at_open)."""
        # Every process syncs below whatever it sees: the directory may exist for one process
        # (made by another) and not yet for another, and a sync only some processes reach hangs
        # or mismatches the next one.
        steps = sorted((int(p.name) for p in self.directory.iterdir() if p.name.isdigit() and p.is_dir()),
                       reverse=True) if self.directory.is_dir() else []
        damaged = {step: why for step in steps if (why := damage_read_at_open(self.directory / str(step)))}
        if jax.process_count() > 1:   # every process has looked before any step moves
            multihost_utils.sync_global_devices("roformer_checkpoints_screened")
        for step, why in damaged.items():
            older = [s for s in steps if s < step and s not in damaged]
            self._warn_aside(step, f"it {why}", next_step=older[0] if older else None)
        if damaged:
            self._move_to(sorted(damaged), "corrupt_checkpoints")

    def _move_aside(self, step: int, error: Exception, *, next_step: int | None) -> None:
        if isinstance(error, checksums.ChecksumMismatch):
            why = f"it does not match the checksums saved with it ({error})"
        else:
            why = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
        self._warn_aside(step, why, next_step=next_step)
        self.set_aside([step], "corrupt_checkpoints")
        self._verified.discard(step)

    def _warn_aside(self, step: int, why: str, *, next_step: int | None) -> None:
        aside = self.directory.parent / "corrupt_checkpoints" / str(step)
        log.warning("checkpoint at step %d in %s is unreadable: %s; moving it to %s%s", step, self.directory, why,
                    aside, "" if next_step is None else f" and trying step {next_step}")

    def set_aside(self, steps: list[int], folder: str) -> Path:
        """Move the checkpoints of `steps` to `workdir/<folder>/<step>` (collective), so the
        next run resumes from an earlier one; returns that folder."""
        aside = self._move_to(steps, folder)
        self.manager.reload()
        return aside

    def _move_to(self, steps: list[int], folder: str) -> Path:
        aside = self.directory.parent / folder
        if jax.process_index() == 0:
            for step in steps:
                aside.mkdir(parents=True, exist_ok=True)
                if (aside / str(step)).exists():
                    shutil.rmtree(aside / str(step))
                shutil.move(str(self.directory / str(step)), str(aside / str(step)))
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"roformer_set_aside_{folder}_{'_'.join(map(str, steps))}")
        return aside

    def steps_after(self, step: int) -> list[int]:
        return [s for s in self.manager.all_steps() if s > step]

    def wait(self) -> None:
        """Wait for the save in flight; CheckpointSaveFailed if it failed."""
        if self._pending is None:
            try:
                self.manager.wait_until_finished()
            except Exception:
                if self._failed_step is None:
                    raise
                # the failed save's error again: it was reported (CheckpointSaveFailed) once
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
            try:
                self.manager.close()
            except Exception:
                if self._failed_step is None:
                    raise
            finally:
                if self._failed_step is not None:
                    self._after_failed_save()

    def _after_failed_save(self) -> None:
        """Once the failed save's writer threads have ended (or FAILED_SAVE_WAIT_S passed):
        remove what they wrote meanwhile, and let orbax's errors show again."""
        deadline = time.monotonic() + self.FAILED_SAVE_WAIT_S
        for thread in threading.enumerate():
            if thread is not threading.current_thread() and type(thread).__module__.startswith("orbax."):
                thread.join(max(0.0, deadline - time.monotonic()))
        self._remove_partial(None)
        self._save_errors.pending -= 1
        self._failed_step = None
