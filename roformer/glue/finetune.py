"""Fine-tune one sequence-classification model on one task with one seed, and predict."""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx
from tqdm.auto import tqdm

from roformer.errors import ConfigError
from roformer.glue.features import Features, eval_batches, train_batches
from roformer.model import ModelConfig, RoFormerForSequenceClassification
from roformer.train.optim import make_optimizer

MODEL_INPUTS = ("input_ids", "token_type_ids", "attention_mask")


@dataclasses.dataclass(frozen=True)
class Protocol:
    """The hyper-parameters of one task's fine-tuning (global config + per-task override)."""
    learning_rate: float
    batch_size: int
    num_epochs: float
    max_steps: int
    warmup_fraction: float
    weight_decay: float
    max_seq_len: int
    max_train_examples: int
    decay: str
    b1: float
    b2: float
    eps: float
    clip_norm: float

    @classmethod
    def from_config(cls, config: ml_collections.ConfigDict, task: str) -> "Protocol":
        override = config.per_task.get(task, {}) if "per_task" in config else {}
        values = {}
        for field in dataclasses.fields(cls):
            value = override.get(field.name) if field.name in override else None
            values[field.name] = config[field.name] if value is None else value
        return cls(**values)

    def check(self, task: str) -> None:
        """Refuse settings no fine-tuning can run with; run_glue asks before it writes anything."""
        where = f"GLUE protocol of {task}:"
        if self.max_seq_len < 8:
            raise ConfigError(f"{where} max_seq_len must be at least 8, got {self.max_seq_len}")
        if self.batch_size < 1:
            raise ConfigError(f"{where} batch_size must be at least 1, got {self.batch_size}")
        if self.num_epochs <= 0 and self.max_steps <= 0:
            raise ConfigError(f"{where} no training steps: num_epochs={self.num_epochs}, max_steps={self.max_steps}")
        if self.decay not in ("linear", "cosine"):
            raise ConfigError(f"{where} decay must be 'linear' or 'cosine', got {self.decay!r}")

    def total_steps(self, num_train: int) -> int:
        steps = math.ceil(self.num_epochs * math.ceil(num_train / self.batch_size))
        if self.max_steps > 0:
            steps = min(steps, self.max_steps)
        if steps <= 0:
            raise ConfigError(f"no training steps: {num_train} training examples, "
                              f"num_epochs={self.num_epochs}, max_steps={self.max_steps}")
        return steps


@functools.lru_cache(maxsize=32)
def build_optimizer(protocol: Protocol, total_steps: int):
    """AdamW + warmup/decay + clipping, built by the pretraining optimizer helper.

    Cached: the transform is static state of `nnx.Optimizer`, so reusing the same
    object across seeds lets the jitted train step hit its compilation cache."""
    return make_optimizer(
        learning_rate=protocol.learning_rate, total_steps=total_steps,
        warmup_steps=int(round(protocol.warmup_fraction * total_steps)), decay=protocol.decay,
        weight_decay=protocol.weight_decay, b1=protocol.b1, b2=protocol.b2, eps=protocol.eps,
        clip_norm=protocol.clip_norm)


def classification_loss(logits: jax.Array, labels: jax.Array, weights: jax.Array,
                        regression: bool) -> jax.Array:
    """Weighted mean cross-entropy, or squared error for a regression head."""
    if regression:
        per_example = jnp.square(logits[:, 0] - labels.astype(jnp.float32))
    else:
        per_example = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return jnp.sum(per_example * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def _forward(model, batch):
    return model(batch["input_ids"], token_type_ids=batch["token_type_ids"],
                 attention_mask=batch["attention_mask"])


@functools.lru_cache(maxsize=2)
def _make_train_step(regression: bool):
    @nnx.jit
    def train_step(model, optimizer, batch):
        def loss_fn(model):
            return classification_loss(_forward(model, batch), batch["labels"],
                                       batch["weights"], regression)
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss
    return train_step


@nnx.jit
def _logits_step(model, batch):
    return _forward(model, batch)


def create_model(model_config: ModelConfig, num_labels: int, seed: int,
                 encoder_state: nnx.State | None = None) -> RoFormerForSequenceClassification:
    """A fresh classifier; the encoder is overwritten with `encoder_state` when given
    (pretrained init), the head always starts from the seed."""
    model = RoFormerForSequenceClassification(model_config, num_labels, rngs=nnx.Rngs(seed))
    if encoder_state is not None:
        nnx.update(model.roformer, encoder_state)
    return model


def finetune(model, features: Features, protocol: Protocol, *, regression: bool, seed: int,
             pad_id: int, desc: str = "", log_every: int = 50,
             log_fn: Callable[[dict], None] | None = None) -> dict:
    """Train `model` in place; returns {"steps", "final_loss"}."""
    total_steps = protocol.total_steps(len(features))
    tx, schedule = build_optimizer(protocol, total_steps)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    train_step = _make_train_step(regression)
    rng = np.random.default_rng(seed)
    model.train()
    step, loss_sum, loss_count, last_loss = 0, 0.0, 0, float("nan")
    with tqdm(total=total_steps, desc=desc, unit="step", leave=False, dynamic_ncols=True) as bar:
        while step < total_steps:
            for batch in train_batches(features, protocol.batch_size, protocol.max_seq_len,
                                       pad_id, rng):
                loss = train_step(model, optimizer, batch)
                step += 1
                bar.update(1)
                if step % log_every == 0 or step == total_steps:
                    last_loss = float(loss)
                    if not math.isfinite(last_loss):
                        raise FloatingPointError(f"{desc}: loss is {last_loss} at step {step}")
                    loss_sum, loss_count = loss_sum + last_loss, loss_count + 1
                    bar.set_postfix(loss=f"{last_loss:.4f}")
                    if log_fn:
                        log_fn({"step": step, "loss": last_loss,
                                "learning_rate": float(schedule(step - 1))})
                if step >= total_steps:
                    break
    model.eval()
    return {"steps": total_steps, "final_loss": last_loss}


def predict(model, features: Features, *, batch_size: int, max_seq_len: int, pad_id: int,
            regression: bool) -> np.ndarray:
    """Predicted class ids (or scores) in the order of `features`."""
    model.eval()
    out = np.zeros(len(features), np.float32 if regression else np.int64)
    for rows, batch in eval_batches(features, batch_size, max_seq_len, pad_id):
        inputs = {k: batch[k] for k in MODEL_INPUTS}
        logits = np.asarray(_logits_step(model, inputs))[:len(rows)]
        out[rows] = logits[:, 0] if regression else np.argmax(logits, axis=-1)
    return out
