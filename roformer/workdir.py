"""A pretraining run's workdir: its layout and its one reader, `PretrainWorkdir`.

Layout (written by roformer.train: `train_and_evaluate`, the vmapped seeds):

    workdir/config.json            the config as run, plus the resolved ModelConfig
    workdir/tokenizer.json         the run's tokenizer (and vocab.txt)
    workdir/checkpoints/<step>/    orbax items ITEMS (+ metrics of a checkpoint taken after an evaluation)
    workdir/metrics.jsonl, summary.json, tensorboard/
    workdir/eval_<step>.json       a checkpoint's held-out metrics, evaluated afterwards (python -m roformer.evaluate)

Below train/, convert and checkpoint_source, which all read it through this module.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx

from roformer import checksums, orbax_logs
from roformer.data.tokenizer import WordPieceTokenizer
from roformer.errors import ConfigError
from roformer.model import ModelConfig, RoFormerForMaskedLM

ITEMS = ("state", "data", "model_config")   # a checkpoint step's orbax items
CHECKPOINTS = "checkpoints"   # a pretraining workdir's checkpoint directory
# What orbax's CheckpointManager reads of every step when it opens a checkpoint directory
# (each step's metadata and retention metrics): one damaged file there fails the open.
READ_AT_OPEN = ("_CHECKPOINT_METADATA", "metrics/metrics")

log = logging.getLogger("roformer")


def damage_read_at_open(step_dir: Path) -> str | None:
    """Why orbax could not open a checkpoint directory holding the step `step_dir`, or None:
    a file it reads at open (READ_AT_OPEN) differs from its checksum (roformer.checksums), or,
    in a step saved without checksums, fails to parse as orbax parses it. Checked before a
    CheckpointManager opens the directory, so that one damaged step is set aside (training) or
    passed over (readers) like any other damage, instead of failing every step's restore."""
    try:
        checksums.verify(step_dir, READ_AT_OPEN)
    except checksums.ChecksumMismatch as error:
        return f"does not match the checksums saved with it ({error})"
    try:
        _ = ocp.path.step.Metadata(step=int(step_dir.name), path=step_dir).commit_timestamp_nsecs   # parses the metadata
        metrics = step_dir / "metrics" / "metrics"
        if metrics.is_file():
            json.loads(metrics.read_bytes())
    except Exception as error:  # noqa: BLE001 - whatever orbax would fail on at open
        return f"has unreadable step metadata ({type(error).__name__}: {str(error).splitlines()[0][:200]})"
    return None


class PretrainWorkdir:
    """Read-only view of a pretraining workdir written by `train_and_evaluate`: the model
    config and parameters of a checkpoint step and the tokenizer the run used.

    The one reader of that layout (roformer.checkpoint_source for warm starts and GLUE init,
    convert, extrapolation and the ablation use it); roformer.train.checkpoint writes it
    (its item names are ITEMS)."""

    def __init__(self, path: str | Path):
        self.path = Path(path).expanduser().resolve()
        self.checkpoints = self.path / CHECKPOINTS
        self._verified: set[int] = set()   # steps whose files matched their checksums
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
        """`step`, or when step < 0 the newest intact one (a damaged newer step is passed over
        with a warning line and left where it is: a reader changes nothing); a step without a
        checkpoint, or a workdir with none intact, is refused."""
        steps = self.steps()
        if not steps:
            raise ConfigError(f"{self.path} has no checkpoint yet (checkpoints/ is empty)")
        if step >= 0:
            if step not in steps:
                raise ConfigError(f"{self.path} has no checkpoint at step {step} (it has steps {steps})")
            return step
        for index in range(len(steps) - 1, -1, -1):
            why = self._damage(steps[index])
            if why is None:
                return steps[index]
            if index == 0:
                raise ConfigError(f"{self.path} has no intact checkpoint: the oldest, step {steps[0]}, {why}")
            log.warning("%s: the checkpoint at step %d %s; using step %d, the newest before it",
                        self.path, steps[index], why, steps[index - 1])
        raise AssertionError("unreachable")

    def verify(self, step: int) -> None:
        """Refuse a checkpoint step whose files differ from the checksums saved with them
        (roformer.checksums), or whose step metadata orbax cannot read, in one line: it would
        load silently changed values, or fail."""
        why = self._damage(step)
        if why is not None:
            raise ConfigError(f"{self.path}: the checkpoint at step {step} {why}; it is damaged: choose another step")

    def _damage(self, step: int) -> str | None:
        """Why checkpoint `step` cannot be trusted, or None (checked once per step)."""
        if step in self._verified:
            return None
        step_dir = self.checkpoints / str(step)
        try:
            checksums.verify(step_dir)
        except checksums.ChecksumMismatch as error:
            return f"does not match the checksums saved with it ({error})"
        why = damage_read_at_open(step_dir)
        if why is None:
            self._verified.add(step)
        return why

    def _manager(self) -> ocp.CheckpointManager:
        orbax_logs.quiet_unrequested_items(ITEMS)   # model_config and params each read some of the items
        # Without reading every step's metadata at open: a damaged step other
        # than the one restored (verify) cannot fail the restore.
        options = ocp.CheckpointManagerOptions(create=False, lightweight_initialize=True)
        return ocp.CheckpointManager(self.checkpoints, item_names=ITEMS, options=options)

    def model_config(self, step: int = -1):
        step = self.resolve_step(step)
        self.verify(step)
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

    def eval_file(self, step: int) -> Path:
        """Where `python -m roformer.evaluate` writes checkpoint `step`'s held-out metrics."""
        return self.path / f"eval_{step}.json"

    def run_config(self) -> dict:
        """The resolved config the run wrote (config.json), or {} for a workdir without one."""
        path = self.path / "config.json"
        return json.loads(path.read_text()) if path.is_file() else {}

    def longest_seq_len(self) -> int | None:
        """The longest sequence the run trained on, by its config.json: train.seq_len and each
        phase's (train.phases items 'steps:seq_len:batch_size[:key=value]', as
        roformer.train.config.parse_phases reads them); None for a workdir without one."""
        train = self.run_config().get("train") or {}
        lengths = [int(train["seq_len"])] if train.get("seq_len") else []
        lengths += [int(item.split(":")[1]) for item in str(train.get("phases") or "").split(",")
                    if item.count(":") >= 2 and item.split(":")[1].strip().isdigit()]
        return max(lengths, default=None)

    @property
    def tokenizer_file(self) -> Path:
        return self.path / "tokenizer.json"

    def tokenizer(self):
        if not self.tokenizer_file.is_file():
            raise ConfigError(f"{self.path} has no tokenizer.json (pretraining writes it at start-up)")
        return WordPieceTokenizer.from_tokenizer_json(self.tokenizer_file)
