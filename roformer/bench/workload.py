"""The measured workload: one jitted MLM train step of our model on a synthetic batch.

Shared by the `step`, `scaling` and `hf` benchmarks. It reuses the training code's pieces
(roformer.train.state.TrainSetup, optim.make_optimizer, flops, sharding), so what is
timed is exactly the step `python -m roformer.pretrain` runs: AdamW with clipping,
dropout on, sparse MLM head at the masked positions, state donated.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import numpy as np

from roformer.model import ModelConfig
from roformer.train import flops as train_flops
from roformer.train import optim, sharding
from roformer.train.state import TrainSetup

MASK_RATE = 0.15


def num_predictions(seq_len: int) -> int:
    """Masked slots per sequence, as the data pipeline's default: round(rate * L) + 1."""
    return round(MASK_RATE * seq_len) + 1


def synthetic_batch(config: ModelConfig, batch_size: int, seq_len: int, seed: int = 0) -> dict[str, np.ndarray]:
    """A pretraining batch in the contract's format: one full document per row (so no
    segment ids and no attention mask, roformer.train.steps.padding_inputs), 15% of
    positions masked (distinct positions per row), random token ids."""
    rng = np.random.default_rng(seed)
    slots = num_predictions(seq_len)
    masked = np.stack([np.sort(rng.choice(seq_len, size=slots, replace=False)) for _ in range(batch_size)])
    return {
        "input_ids": rng.integers(5, config.vocab_size, (batch_size, seq_len), dtype=np.int32),
        "token_type_ids": np.zeros((batch_size, seq_len), np.int32),
        "positions": np.broadcast_to(np.arange(seq_len, dtype=np.int32), (batch_size, seq_len)).copy(),
        "masked_positions": masked.astype(np.int32),
        "masked_labels": rng.integers(5, config.vocab_size, (batch_size, slots), dtype=np.int32),
        "masked_weights": np.ones((batch_size, slots), np.float32),
    }


def train_config(learning_rate: float = 1e-4) -> dict:
    """AdamW settings of configs/base.py (b1, b2, eps, weight decay, clip 1.0); the schedule
    length only shapes the learning rate, which does not change the step's cost."""
    return dict(learning_rate=learning_rate, warmup_steps=100, total_steps=10_000, decay="linear",
                weight_decay=0.01, b1=0.9, b2=0.999, eps=1e-6, clip_norm=1.0)


@dataclasses.dataclass
class TrainWorkload:
    """A model, its optimizer state and one batch on device, plus the jitted step."""

    config: ModelConfig
    batch_size: int
    seq_len: int
    step_fn: Callable
    state: dict
    rest_state: object
    batch: dict
    flops_per_step: float
    num_params: int

    def step(self):
        """One optimizer step; the state is donated and replaced. Returns (state, metrics)
        so that blocking on the result waits for the parameter update too."""
        self.state, metrics = self.step_fn(self.state, self.rest_state, self.batch)
        return self.state, metrics

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len


def build_train_workload(config: ModelConfig, *, batch_size: int, seq_len: int,
                         attention_impl: str = "auto", seed: int = 0,
                         dropout_rng_impl: str = "threefry2x32", segment_mask: bool = False) -> TrainWorkload:
    """Initialise the model and AdamW state on one device (roformer.train's TrainSetup on a 1x1x1
    mesh; op by op, which spares a compilation that on a GPU takes longer than the train
    step's), put a synthetic batch there and compile the train step, all outside any timing.
    `segment_mask`: the batch carries segment ids (one segment per row), so attention gets the
    [B, 1, L, L] mask of packed rows, as the pretraining loop's packed batches do."""
    config = dataclasses.replace(config, attention_impl=attention_impl)   # before the model is built
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, devices=jax.devices()[:1])
    tx, schedule = optim.make_optimizer(**train_config())
    setup = TrainSetup(config, tx, schedule, mesh, seed=seed, dropout_rng_impl=dropout_rng_impl)
    with jax.set_mesh(mesh):
        state, rest_state = setup.init_state(compiled=False), setup.init_rest()
        rows = synthetic_batch(config, batch_size, seq_len, seed)
        if segment_mask:
            rows["segment_ids"] = np.ones((batch_size, seq_len), np.int32)
        batch = sharding.global_batch(rows, mesh)
        step_fn = setup.jit_train_step().lower(state, rest_state, batch).compile()
    flops = train_flops.train_flops_per_step(config, batch_size=batch_size, seq_len=seq_len,
                                             num_predictions=num_predictions(seq_len))
    num_params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(state["params"]))
    return TrainWorkload(config, batch_size, seq_len, step_fn, state, rest_state, batch, flops, num_params)
