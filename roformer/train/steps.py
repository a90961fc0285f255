"""MLM train and eval step functions (jitted by the caller) over an explicit, pure-pytree training state.

The state is `{"params", "opt_state", "step"}` (plain nested dicts of arrays), so it
can be donated, sharded with NamedSharding and checkpointed by orbax as is. The
NNX model is rebuilt inside the step with `nnx.merge`; dropout keys are derived
from (seed, step), which makes a resumed run bit-identical to an uninterrupted one
without checkpointing RNG streams.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from roformer.errors import ConfigError
from roformer.model import backend
from roformer.model.attention_stats import attention_stats

TrainState = dict[str, Any]
Batch = dict[str, jax.Array]
# jax's PRNG implementations for the dropout keys. threefry2x32 (jax's default) hashes a
# counter per element; rbg and unsafe_rbg draw the mask bits from XLA's RngBitGenerator
# (what MaxText and T5X use for dropout), usually cheaper on accelerators. Each is a
# deterministic function of (seed, step) on one backend and mesh, so resumes stay exact
# with any of them; the masks differ between them, and rbg's bits may also differ
# between meshes.
DROPOUT_RNG_IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")

def padding_inputs(batch: Batch) -> dict[str, jax.Array]:
    """How a batch's rows are padded, as the model takes it: `segment_ids` for packed rows,
    `lengths` for right-padded rows of one document each, neither when every row is one
    whole document (attention then needs no mask at all)."""
    if "lengths" in batch:
        return {"lengths": batch["lengths"]}
    return {"segment_ids": batch["segment_ids"]} if "segment_ids" in batch else {}


def mlm_sums(model, batch: Batch) -> dict[str, jax.Array]:
    """Sparse MLM loss: logits only at the masked positions, summed over real slots.

    Returns sums (not means) so micro-batches and eval batches combine exactly."""
    logits = model(batch["input_ids"], token_type_ids=batch["token_type_ids"],
                   positions=batch["positions"], masked_positions=batch["masked_positions"],
                   **padding_inputs(batch))
    labels = batch["masked_labels"]
    weights = batch["masked_weights"].astype(jnp.float32)
    if backend.fused_mlm_loss():
        losses, correct = backend.label_losses(logits, labels)
    else:
        logits = logits.astype(jnp.float32)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        # A label is predicted when its logit is the maximum (argmax == label, except that a tie
        # with the maximum counts): XLA shares this max with the loss's, where an argmax is a
        # second, variadic reduction over the vocabulary (4% of a mini train step on CPU).
        label_logits = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
        correct = (label_logits >= jnp.max(logits, axis=-1)).astype(jnp.float32)
    return {"loss_sum": jnp.sum(losses * weights), "correct_sum": jnp.sum(correct * weights),
            "weight_sum": jnp.sum(weights)}


def mlm_row_sums(model, batch: Batch) -> dict[str, jax.Array]:
    """Per row: the summed MLM loss and correct predictions (`mlm_sums` by row), for a
    measurement that resamples rows or groups of them (the study's bootstrap)."""
    logits = model(batch["input_ids"], token_type_ids=batch["token_type_ids"], positions=batch["positions"],
                   segment_ids=batch["segment_ids"], masked_positions=batch["masked_positions"]).astype(jnp.float32)
    labels, weights = batch["masked_labels"], batch["masked_weights"]
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    label_logits = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    correct = (label_logits >= jnp.max(logits, axis=-1)).astype(jnp.float32)
    return {"loss": jnp.sum(losses * weights, -1), "correct": jnp.sum(correct * weights, -1)}


def reseeded(rest_state, key: jax.Array):
    """Fresh copy of the model's RNG state: the i-th stream (in the state's flattening order)
    keyed by fold_in(key, i), its count reset to 0.

    Every nnx.Dropout holds a stream of its own; one key for all of them would draw the same
    mask at every dropout site of a step (the same features of a token dropped in every
    layer). Building new Variables (rather than `nnx.reseed` on shared ones) keeps them in
    the current trace, so dropout can advance its counters inside `jax.grad`."""
    leaves, treedef = jax.tree.flatten(rest_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    fresh, streams = [], 0
    for var in leaves:
        if isinstance(var, nnx.RngKey):
            fresh.append(var.replace(jax.random.fold_in(key, streams)))
            streams += 1
        elif isinstance(var, nnx.RngCount):
            fresh.append(var.replace(jnp.zeros_like(var.get_value())))
        else:
            fresh.append(var.replace(var.get_value()))
    return jax.tree.unflatten(treedef, fresh)


def _split_microbatches(batch: Batch, num: int) -> Batch:
    """[B, ...] -> [num, B/num, ...] taking rows i::num, so every micro-batch keeps
    rows from every data shard (no resharding of the batch dimension)."""
    def split(x):
        if x.shape[0] % num:
            raise ConfigError(f"train.grad_accum={num} must divide the global batch {x.shape[0]}")
        return jnp.swapaxes(x.reshape(x.shape[0] // num, num, *x.shape[1:]), 0, 1)
    return jax.tree.map(split, batch)


def dropout_base_key(seed, dropout_rng_impl: str = "threefry2x32") -> jax.Array:
    """The key every step's dropout key is folded from (`seed` may be traced: vmapped seeds)."""
    if dropout_rng_impl not in DROPOUT_RNG_IMPLS:
        raise ConfigError(f"unknown dropout RNG implementation {dropout_rng_impl!r}; "
                          f"choose one of {DROPOUT_RNG_IMPLS}")
    return jax.random.key(seed, impl=dropout_rng_impl)


def make_train_step(graphdef, tx: optax.GradientTransformation,
                    schedule: optax.Schedule, *, seed: int, grad_accum: int = 1,
                    debug_nan_step: int = -1,
                    dropout_rng_impl: str = "threefry2x32") -> Callable[..., tuple[TrainState, dict]]:
    """Build `train_step(state, rest_state, batch) -> (state, metrics)` (not jitted).

    `rest_state` is the model's non-parameter state (RNG streams), passed in
    unchanged: dropout keys are re-derived from (seed, step) every step, with the
    PRNG implementation `dropout_rng_impl` (one of DROPOUT_RNG_IMPLS).

    `debug_nan_step` (>0) poisons the loss and gradients of that step, to test the
    non-finite-loss guard."""
    base_key = dropout_base_key(seed, dropout_rng_impl)
    keyed = make_keyed_train_step(graphdef, tx, schedule, grad_accum=grad_accum, debug_nan_step=debug_nan_step)

    def train_step(state: TrainState, rest_state, batch: Batch):
        return keyed(state, rest_state, batch, base_key)

    return train_step


def make_keyed_train_step(graphdef, tx: optax.GradientTransformation, schedule: optax.Schedule, *,
                          grad_accum: int = 1, debug_nan_step: int = -1) -> Callable[..., tuple[TrainState, dict]]:
    """`train_step(state, rest_state, batch, base_key) -> (state, metrics)`: make_train_step's
    step with the dropout base key (`dropout_base_key`) an argument, so that vmapped seeds
    each bring their own."""

    def loss_fn(params, rest_state, micro_batch, dropout_key):
        model = nnx.merge(graphdef, nnx.State(params), reseeded(rest_state, dropout_key))
        model.train()
        sums = mlm_sums(model, micro_batch)
        return sums["loss_sum"], sums

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def train_step(state: TrainState, rest_state, batch: Batch, base_key: jax.Array):
        params, step = state["params"], state["step"]
        step_key = jax.random.fold_in(base_key, step)
        if grad_accum == 1:
            (_, sums), grads = grad_fn(params, rest_state, batch, step_key)
        else:
            def accumulate(carry, xs):
                index, micro_batch = xs
                (_, sums), grads = grad_fn(params, rest_state, micro_batch,
                                           jax.random.fold_in(step_key, index))
                return jax.tree.map(jnp.add, carry, (sums, grads)), None
            zero_sums = {k: jnp.zeros((), jnp.float32) for k in ("loss_sum", "correct_sum", "weight_sum")}
            zeros = (zero_sums, jax.tree.map(jnp.zeros_like, params))
            (sums, grads), _ = jax.lax.scan(
                accumulate, zeros, (jnp.arange(grad_accum), _split_microbatches(batch, grad_accum)))
        weight = jnp.maximum(sums["weight_sum"], 1.0)
        grads = jax.tree.map(lambda g: g / weight, grads)
        loss = sums["loss_sum"] / weight
        if debug_nan_step > 0:
            poison = jnp.where(step + 1 == debug_nan_step, jnp.nan, 1.0)
            loss = loss * poison
            grads = jax.tree.map(lambda g: g * poison, grads)
        updates, opt_state = tx.update(grads, state["opt_state"], params)
        new_state = {"params": optax.apply_updates(params, updates), "opt_state": opt_state,
                     "step": step + 1}
        metrics = {"loss": loss, "mlm_accuracy": sums["correct_sum"] / weight,
                   "grad_norm": optax.tree.norm(grads), "learning_rate": schedule(step),
                   "num_predictions": sums["weight_sum"]}
        return new_state, metrics

    return train_step


def make_eval_step(graphdef) -> Callable[..., dict]:
    """`eval_step(params, rest_state, batch) -> sums` with dropout off."""
    def eval_step(params, rest_state, batch: Batch):
        model = nnx.merge(graphdef, nnx.State(params), reseeded(rest_state, jax.random.key(0)))
        model.eval()
        return mlm_sums(model, batch)
    return eval_step


def make_attention_stats_step(graphdef) -> Callable[..., dict]:
    """`stats_step(params, rest_state, batch) -> roformer.model.attention_stats` of the encoder,
    dropout off."""
    def stats_step(params, rest_state, batch: Batch):
        model = nnx.merge(graphdef, nnx.State(params), reseeded(rest_state, jax.random.key(0)))
        model.eval()
        return attention_stats(model.roformer, batch["input_ids"], token_type_ids=batch["token_type_ids"],
                               positions=batch["positions"], segment_ids=batch.get("segment_ids"))
    return stats_step


def summarize_eval(sums: dict[str, float], prefix: str = "eval_") -> dict[str, float]:
    weight = max(float(sums["weight_sum"]), 1.0)
    loss = float(sums["loss_sum"]) / weight
    return {f"{prefix}loss": loss, f"{prefix}mlm_accuracy": float(sums["correct_sum"]) / weight,
            f"{prefix}perplexity": float(jnp.exp(jnp.minimum(loss, 80.0)))}
