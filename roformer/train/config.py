"""The `train` config section: every pretraining setting and its default, in one place.

configs/base.py builds its `train` section from `TrainConfig()`; the loop reads a section
back through `TrainConfig.from_section`, which refuses unknown keys and names the new
key of a retired one.
"""
from __future__ import annotations

import dataclasses

# Keys earlier versions had in the `train` section -> the key that replaced them. They stay
# in the section as unset placeholders, so `--config.train.<old>=...` reaches the refusal.
RETIRED_KEYS = {"dtype": "model.dtype"}


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 100_000
    batch_size: int = 256            # global, over all processes
    seq_len: int = 512
    learning_rate: float = 1e-4
    warmup_steps: int = 10_000
    decay: str = "linear"            # linear | cosine
    decay_steps: int = 0             # schedule length; 0 -> all steps (set it to extend a run
                                     # past its schedule without changing the learning rates so far)
    weight_decay: float = 0.01
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-6
    clip_norm: float = 1.0
    grad_accum: int = 1              # micro-batches per optimizer step
    seed: int = 0
    phases: str = ""                 # 'steps:seq_len:batch_size[:key=value...],...' phases run in
                                     # order (override steps/seq_len/batch_size), see loop.parse_phases
    init_from: str = ""              # warm start (parameters only, step 0): a pretraining workdir, an
                                     # HF RoFormer directory or a roformer.convert output
    init_step: int = -1              # its checkpoint step (pretraining workdir); -1 = newest
    init_grow_positions: str = ""    # "copy": repeat a shorter learned position table's rows
    log_every: int = 100
    eval_every: int = 2_000
    eval_batches: int = 20
    eval_shuffled: bool = True       # also evaluate with each document's tokens shuffled: the loss
                                     # increase (eval_order_gap) says how much the model uses word order
    checkpoint_every: int = 2_000
    keep_checkpoints: int = 3
    async_checkpoints: bool = True
    peak_flops_per_device: float = 0.0   # 0 -> table (TPU/GPU) or a measured matmul peak (CPU)
    progress_bar: bool = True
    debug_nan_step: int = -1         # testing aid: poison the loss at this step

    @classmethod
    def from_section(cls, section) -> "TrainConfig":
        """The settings of a `train` config section (a ConfigDict or a mapping)."""
        values = dict(section.to_dict() if hasattr(section, "to_dict") else section)
        for old, new in RETIRED_KEYS.items():
            if values.pop(old, None) is not None:
                raise ValueError(f"train.{old} is now {new}: set --config.{new} instead")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown train settings {unknown}; known: {sorted(known)}")
        return cls(**values)

    @property
    def schedule_steps(self) -> int:
        """Length of the learning-rate schedule."""
        return self.decay_steps or self.steps
