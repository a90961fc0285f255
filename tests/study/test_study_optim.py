"""The study's schedule and optimizer (roformer/train/optim.py): the cooldown branches of the
warmup-stable-decay schedule, and one Adam per member at its own rate."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from roformer.errors import ConfigError
from roformer.train import optim


def test_cooldown_branches_and_the_wsd_factor():
    assert optim.cooldown_branches([625, 1250, 2500], 0.2) == [(500, 625), (1000, 1250), (2000, 2500)]
    factor = lambda s, start, end: float(optim.wsd_factor(s, warmup_steps=10, decay_start=start, decay_end=end))  # noqa: E731
    assert factor(0, 80, 100) == pytest.approx(0.1) and factor(50, 80, 100) == 1.0
    assert factor(90, 80, 100) == pytest.approx(0.5) and factor(99, 80, 100) == pytest.approx(0.05)
    with pytest.raises(ConfigError):
        optim.cooldown_branches([100, 100], 0.2)


def test_member_optimizer_takes_each_members_rate():
    tx = optim.make_member_optimizer(weight_decay=0.0, b1=0.9, b2=0.98, eps=1e-8, clip_norm=0.0)
    params = {"w": jnp.ones((3,))}

    def update(rate):
        state = optim.with_learning_rate(tx.init(params), rate)
        return tx.update({"w": jnp.ones((3,))}, state, params)[0]["w"]

    rates = jnp.asarray([1e-3, 4e-3])
    updates = jax.vmap(update)(rates)   # Adam's first step moves by the rate
    np.testing.assert_allclose(updates, -rates[:, None] * jnp.ones((2, 3)), rtol=1e-4)
