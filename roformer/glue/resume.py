"""A GLUE run's fine-tuning state on disk, so that a killed run resumes the task it stopped in
where it stopped (config.checkpoint_every), with the result an uninterrupted run gets.

Layout: `<workdir>/resume/<task>/seed<k>/<step>/`, written by pretraining's
`roformer.train.checkpoint.Checkpointer` (orbax; complete or absent; checksummed, a damaged
step set aside and the one before it used), the newest step kept. A step holds the state
(`params`, `opt_state`), the loss rows logged up to it (`data`), and what the state is of
(`model_config`: the task, seed, protocol, padding, model, init and training data): a state
of anything else is dropped with a warning and the seed trains from its start. A seed's last
state stays until its task's results are written, so a run killed in a later seed restores
it instead of training it again; then the task's folder goes.
"""
from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

import jax
import numpy as np

from roformer.train.checkpoint import Checkpointer

log = logging.getLogger("roformer.glue")

RESUME = "resume"   # <workdir>/resume/<task>/seed<k>


def task_dir(workdir: Path, task: str) -> Path:
    return Path(workdir) / RESUME / task


def remove_task(workdir: Path, task: str) -> None:
    """Drop `task`'s saved states: its results are written."""
    shutil.rmtree(task_dir(workdir, task), ignore_errors=True)
    root = Path(workdir) / RESUME
    if root.is_dir() and not any(root.iterdir()):
        root.rmdir()


def data_digest(input_ids: list[np.ndarray], labels: np.ndarray) -> str:
    """sha256 of a task's training inputs and labels: a state trained on other data (another
    tokenizer, max_train_examples) is not resumed."""
    digest = hashlib.sha256()
    for ids in input_ids:
        digest.update(np.asarray(ids, np.int32).tobytes() + b"|")
    digest.update(np.ascontiguousarray(labels).tobytes())
    return digest.hexdigest()


class SeedCheckpoints:
    """The saved fine-tuning states of one (task, seed): `restore` at the start, `save` after a
    call of the train program that passed a multiple of `every` steps, and at the end."""

    def __init__(self, directory: Path, identity: dict, every: int):
        self.directory, self.every = Path(directory), every
        self.identity = json.loads(json.dumps(identity, sort_keys=True, default=str))
        self._checkpointer = Checkpointer(self.directory, max_to_keep=1)
        saved = self._checkpointer.saved_model_config()
        if saved is not None and saved != self.identity:
            changed = sorted(k for k in {*saved, *self.identity} if saved.get(k) != self.identity.get(k))
            log.warning("%s holds a fine-tuning state of another %s than this run's; training this seed from "
                        "its start", self.directory, ", ".join(changed))
            self._checkpointer.close()
            shutil.rmtree(self.directory, ignore_errors=True)
            self._checkpointer = Checkpointer(self.directory, max_to_keep=1)

    def due(self, first: int, last: int) -> bool:
        """Whether the call that ran steps first+1..last passed a multiple of `every`."""
        return self.every > 0 and last // self.every > first // self.every

    def restore(self, abstract_params, abstract_opt_state) -> tuple[int, dict, object, dict] | None:
        """(step, params, opt_state, data) of the newest readable state, or None."""
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                                {"params": abstract_params, "opt_state": abstract_opt_state})
        restored = self._checkpointer.restore_latest(abstract)
        if restored is None:
            return None
        step, state, data = restored
        return step, state["params"], state["opt_state"], dict(data or {})

    def save(self, step: int, params, opt_state, data: dict) -> None:
        """Save the state after `step` (async: orbax copies the arrays before returning, so the
        next call may take them)."""
        self._checkpointer.save(step, {"params": params, "opt_state": opt_state}, data, self.identity)

    def close(self) -> None:
        self._checkpointer.close()
