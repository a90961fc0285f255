"""roformer.train.steps: the step's MLM sums, gradient accumulation, and the dropout keys (one mask
per site, each key implementation deterministic)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from roformer.model import RoFormerForMaskedLM
from roformer.train.steps import DROPOUT_RNG_IMPLS, make_train_step, mlm_sums, reseeded

from helpers.train import TINY, optimizer, synthetic_batch

pytestmark = pytest.mark.fast   # the fast lane (docs/testing.md)


def test_mlm_sums_are_optax_cross_entropy_and_argmax_accuracy():
    """The step's loss is optax's cross-entropy at the masked slots and its accuracy is
    argmax == label (computed from the loss's max), both weighted by the real slots."""
    import optax
    logits = jax.random.normal(jax.random.key(0), (3, 5, 50)) * 4
    labels = jax.random.randint(jax.random.key(1), (3, 5), 0, 50)
    labels = labels.at[0, :3].set(jnp.argmax(logits[0, :3], -1))     # some slots predicted
    weights = (jnp.arange(5) < jnp.array([[5], [4], [2]])).astype(jnp.float32)

    class Model:
        def __call__(self, input_ids, **unused):
            return logits

    sums = mlm_sums(Model(), {"input_ids": None, "token_type_ids": None, "positions": None, "segment_ids": None,
                              "masked_positions": None, "masked_labels": labels, "masked_weights": weights})
    expected_loss = jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, labels) * weights)
    expected_correct = jnp.sum((jnp.argmax(logits, -1) == labels) * weights)
    np.testing.assert_allclose(sums["loss_sum"], expected_loss, rtol=1e-6)
    assert float(sums["correct_sum"]) == float(expected_correct) >= 3
    assert float(sums["weight_sum"]) == 11


def test_gradient_accumulation_equals_full_batch():
    tx, schedule = optimizer(warmup_steps=0)
    model = RoFormerForMaskedLM(TINY, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    params = nnx.to_pure_dict(params)
    state = {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}
    batch = {k: jnp.asarray(v) for k, v in synthetic_batch(0).items()}
    full = jax.jit(make_train_step(graphdef, tx, schedule, seed=0))(state, rest, batch)
    accum = jax.jit(make_train_step(graphdef, tx, schedule, seed=0, grad_accum=4))(state, rest, batch)
    np.testing.assert_allclose(accum[1]["loss"], full[1]["loss"], rtol=1e-5)
    np.testing.assert_allclose(accum[1]["grad_norm"], full[1]["grad_norm"], rtol=1e-4)
    for a, b in zip(jax.tree.leaves(accum[0]["params"]), jax.tree.leaves(full[0]["params"])):
        np.testing.assert_allclose(a, b, atol=1e-5)   # Adam step of size lr=1e-2


@pytest.mark.parametrize("impl", DROPOUT_RNG_IMPLS)
def test_every_dropout_site_draws_its_own_mask(monkeypatch, impl):
    """Each nnx.Dropout has a stream of its own; a step's key reaches each as its own key, so
    the embeddings' and every layer's dropout do not drop the same features of a token."""
    config = dataclasses.replace(TINY, hidden_dropout=0.1, attention_dropout=0.1)
    graphdef, params, rest = nnx.split(RoFormerForMaskedLM(config, rngs=nnx.Rngs(0)), nnx.Param, ...)
    model = nnx.merge(graphdef, params, reseeded(rest, jax.random.fold_in(jax.random.key(0, impl=impl), 7)))
    draws, bernoulli = [], jax.random.bernoulli

    def recording(key, p=0.5, shape=None, **kwargs):
        draws.append(np.asarray(bernoulli(key, p, shape, **kwargs)))
        return draws[-1]

    monkeypatch.setattr(jax.random, "bernoulli", recording)
    batch = synthetic_batch(0)
    mlm_sums(model, {k: jnp.asarray(v) for k, v in batch.items()})
    by_shape = {}
    for mask in draws:
        by_shape.setdefault(mask.shape, []).append(mask)
    assert len(draws) >= 2 * TINY.num_layers + 1 and max(len(m) for m in by_shape.values()) >= 3
    for masks in by_shape.values():
        assert all(not np.array_equal(a, b) for i, a in enumerate(masks) for b in masks[:i])


def test_dropout_rng_impls_are_deterministic_and_distinct():
    """Every dropout key implementation gives the same step twice from the same state (what
    exact resume rests on), works with gradient accumulation, and draws its own masks."""
    config = dataclasses.replace(TINY, hidden_dropout=0.1, attention_dropout=0.1)
    tx, schedule = optimizer(warmup_steps=0)
    graphdef, params, rest = nnx.split(RoFormerForMaskedLM(config, rngs=nnx.Rngs(0)), nnx.Param, ...)
    params = nnx.to_pure_dict(params)
    state = {"params": params, "opt_state": tx.init(params), "step": jnp.full((), 3, jnp.int32)}
    batch = {k: jnp.asarray(v) for k, v in synthetic_batch(0).items()}
    losses = {}
    for impl in DROPOUT_RNG_IMPLS:
        step = jax.jit(make_train_step(graphdef, tx, schedule, seed=0, dropout_rng_impl=impl))
        first, again = step(state, rest, batch), step(state, rest, batch)
        for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again)):
            np.testing.assert_array_equal(a, b)
        accum = jax.jit(make_train_step(graphdef, tx, schedule, seed=0, grad_accum=2, dropout_rng_impl=impl))
        assert np.isfinite(accum(state, rest, batch)[1]["loss"])
        losses[impl] = float(first[1]["loss"])
    assert len(set(losses.values())) == len(DROPOUT_RNG_IMPLS)   # each draws its own masks
    with pytest.raises(ValueError, match="dropout RNG implementation 'philox'"):
        make_train_step(graphdef, tx, schedule, seed=0, dropout_rng_impl="philox")
