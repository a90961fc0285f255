"""roformer.train.state: the initial training state, jitted, stacked for seeds, op by op, and made
on the host."""

import pytest

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from roformer.model import RoFormerForMaskedLM

from helpers.train import TINY, optimizer


pytestmark = pytest.mark.fast   # the fast lane (docs/testing.md)

def test_the_jitted_initial_state_is_the_seeds_model_and_takes_the_key_as_input(monkeypatch):
    """TrainSetup's state and RNG streams are those of RoFormerForMaskedLM(rngs=nnx.Rngs(seed)),
    and its jitted initialisers read the key as an argument: with no input a program is all
    constants, which XLA's GPU pipeline tries to fold at compile time."""
    from roformer.train import sharding
    from roformer.train.state import TrainSetup

    jit, arguments = jax.jit, []

    def recording_jit(fun, **options):
        jitted = jit(fun, **options)

        def call(*args):
            arguments.append(args)
            return jitted(*args)
        return call

    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    setup = TrainSetup(TINY, *optimizer(), mesh, seed=5)
    monkeypatch.setattr(jax, "jit", recording_jit)
    with jax.set_mesh(mesh):
        state, rest = setup.init_state(), setup.init_rest()
    monkeypatch.undo()
    assert [len(args) for args in arguments] == [1, 1]
    assert all(jnp.issubdtype(args[0].dtype, jax.dtypes.prng_key) for args in arguments)

    _, params, expected_rest = nnx.split(RoFormerForMaskedLM(TINY, rngs=nnx.Rngs(5)), nnx.Param, ...)

    # The same draws; jitted and eager initialisers round the last bit differently.
    for got, want in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(nnx.to_pure_dict(params)), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    for got, want in zip(jax.tree.leaves(rest), jax.tree.leaves(expected_rest), strict=True):
        if jnp.issubdtype(got.dtype, jax.dtypes.prng_key):
            got, want = jax.random.key_data(got), jax.random.key_data(want)
        np.testing.assert_array_equal(got, want)


def test_stacked_initial_states_are_each_seeds_state():
    from roformer.train import sharding
    from roformer.train.state import TrainSetup

    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    stacked = TrainSetup(TINY, *optimizer(), mesh).init_states([3, 8])
    for index, seed in enumerate([3, 8]):
        setup = TrainSetup(TINY, *optimizer(), mesh, seed=seed)
        with jax.set_mesh(mesh):
            alone = setup.init_state()
        for got, want in zip(jax.tree.leaves(stacked), jax.tree.leaves(alone), strict=True):
            np.testing.assert_array_equal(got[index], want)


def test_initial_state_op_by_op_equals_the_compiled_one():
    from roformer.train import sharding
    from roformer.train.state import TrainSetup

    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    setup = TrainSetup(TINY, *optimizer(), mesh, seed=4)
    with jax.set_mesh(mesh):
        compiled, op_by_op = setup.init_state(), setup.init_state(compiled=False)
    assert jax.tree.structure(op_by_op) == jax.tree.structure(compiled)
    for got, want in zip(jax.tree.leaves(op_by_op), jax.tree.leaves(compiled), strict=True):
        assert got.sharding == want.sharding and got.dtype == want.dtype
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_initial_state_made_on_the_host_equals_the_one_made_sharded_on_the_mesh():
    """on_host: the host CPU's compiled initialiser, then placed with the state's shardings
    (on a GPU the device's program is far slower to compile); the same state, on a mesh of
    devices other than the host's first, inside the mesh's context as the loop calls it."""
    from roformer.train import sharding
    from roformer.train.state import TrainSetup

    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 1}, jax.devices()[4:8])
    setup = TrainSetup(TINY, *optimizer(), mesh, seed=5)
    with jax.set_mesh(mesh):
        on_mesh, on_host = setup.init_state(on_host=False), setup.init_state(on_host=True)
    assert jax.tree.structure(on_host) == jax.tree.structure(on_mesh)
    for got, want in zip(jax.tree.leaves(on_host), jax.tree.leaves(on_mesh), strict=True):
        assert got.sharding == want.sharding and got.dtype == want.dtype
        assert jax.devices()[0] not in got.devices()
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    fsdp = [leaf for leaf in jax.tree.leaves(on_host) if leaf.ndim and not leaf.sharding.is_fully_replicated]
    assert fsdp    # some leaves are split over the mesh, not copies
