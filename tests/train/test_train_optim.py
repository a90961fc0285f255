"""roformer.train.optim: the learning-rate schedules, weight decay's mask, global-norm clipping."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from roformer.train.optim import decay_mask, make_schedule

from helpers.train import optimizer

pytestmark = pytest.mark.fast   # the fast lane (docs/testing.md)


def test_schedule_warms_up_then_decays_linear_and_cosine():
    linear = make_schedule(learning_rate=1.0, warmup_steps=4, total_steps=12, decay="linear")
    np.testing.assert_allclose([linear(s) for s in (0, 2, 4, 8, 12)], [0, 0.5, 1, 0.5, 0], atol=1e-6)
    cosine = make_schedule(learning_rate=1.0, warmup_steps=4, total_steps=12, decay="cosine")
    np.testing.assert_allclose([cosine(s) for s in (4, 8, 12)], [1, 0.5, 0], atol=1e-6)
    with pytest.raises(ValueError, match="train.decay"):
        make_schedule(learning_rate=1.0, warmup_steps=1, total_steps=2, decay="step")


def test_no_weight_decay_on_layernorm_and_biases():
    tx, _ = optimizer(weight_decay=0.5, clip_norm=1.0)
    params = {"dense": {"kernel": jnp.ones((3, 4)), "bias": jnp.ones((4,))},
              "LayerNorm": {"scale": jnp.ones((4,)), "bias": jnp.ones((4,))}}
    assert decay_mask(params) == {"dense": {"kernel": True, "bias": False},
                                  "LayerNorm": {"scale": False, "bias": False}}
    zeros = jax.tree.map(jnp.zeros_like, params)
    _, state = tx.update(zeros, tx.init(params), params)   # step 0: warmup lr is 0
    updates, _ = tx.update(zeros, state, params)            # step 1: zero gradient -> decay only
    assert float(jnp.abs(updates["dense"]["kernel"]).max()) > 0
    for leaf in (updates["dense"]["bias"], updates["LayerNorm"]["scale"], updates["LayerNorm"]["bias"]):
        assert float(jnp.abs(leaf).max()) == 0.0


def test_global_norm_clipping_bounds_the_update():
    tx, _ = optimizer(clip_norm=1.0, weight_decay=0.0, warmup_steps=0)
    params = {"w": jnp.zeros((2, 2))}
    huge = {"w": jnp.full((2, 2), 1e6)}
    state = tx.init(params)
    clipped, _ = tx.update(huge, state, params)
    small, _ = tx.update(jax.tree.map(lambda g: g / 2e6, huge), state, params)  # norm 1 exactly
    np.testing.assert_allclose(clipped["w"], small["w"], rtol=1e-5)
