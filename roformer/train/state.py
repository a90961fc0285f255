"""Sharded training state and compiled steps for one model config on one mesh.

Used by the training loop, the sharding tests and the step benchmark, so all of
them build, shard and jit the state the same way.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from roformer.model import ModelConfig, RoFormerForMaskedLM
from roformer.train import sharding, steps


def _init_state(model_cfg: ModelConfig, tx: optax.GradientTransformation, key: jax.Array) -> dict:
    """Fresh training state: params from the model's initialisers, optimizer state, step 0."""
    model = RoFormerForMaskedLM(model_cfg, rngs=nnx.Rngs(key))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    return {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}


def _init_rest(model_cfg: ModelConfig, key: jax.Array):
    """The model's non-parameter state (RNG streams); under jit the unused parameter
    initialisation is dead code and is dropped."""
    return nnx.split(RoFormerForMaskedLM(model_cfg, rngs=nnx.Rngs(key)), nnx.Param, ...)[2]


def _host_cpu() -> jax.Device | None:
    """This process's first CPU device, or None where jax runs without its CPU backend
    (JAX_PLATFORMS naming only an accelerator)."""
    try:
        return jax.local_devices(backend="cpu")[0]
    except RuntimeError:
        return None


@dataclasses.dataclass
class TrainSetup:
    """Graph, shardings and jitted functions of an MLM training run on `mesh`."""
    model_cfg: ModelConfig
    tx: optax.GradientTransformation
    schedule: optax.Schedule
    mesh: Mesh
    seed: int = 0
    dropout_rng_impl: str = "threefry2x32"   # steps.DROPOUT_RNG_IMPLS
    _sharded_init: Any = dataclasses.field(default=None, init=False, repr=False)
    _host_init: Any = dataclasses.field(default=None, init=False, repr=False)

    def __post_init__(self):
        replicated = NamedSharding(self.mesh, P())
        abstract_model = nnx.eval_shape(lambda: RoFormerForMaskedLM(self.model_cfg, rngs=nnx.Rngs(self.seed)))
        self.graphdef, abstract_params, abstract_rest = nnx.split(abstract_model, nnx.Param, ...)
        self.abstract_state = jax.eval_shape(lambda: _init_state(self.model_cfg, self.tx, jax.random.key(self.seed)))
        logical = sharding.param_logical_axes(abstract_params)
        param_shardings = sharding.state_shardings(self.abstract_state["params"], logical, self.mesh)
        opt_shardings = optax.tree_map_params(
            self.tx, lambda _, s: s, self.abstract_state["opt_state"], param_shardings,
            transform_non_params=lambda _: replicated)
        self.state_shardings = {"params": param_shardings, "opt_state": opt_shardings, "step": replicated}
        self.rest_shardings = jax.tree.map(lambda _: replicated, abstract_rest)
        self.replicated = replicated

    def sharded_abstract_state(self):
        """Shapes, dtypes and shardings to restore a checkpoint into."""
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            self.abstract_state, self.state_shardings)

    def sharded_abstract_rest(self):
        """The model's non-parameter state (its RNG streams) as shapes, dtypes and shardings:
        what a step compiled ahead of its devices takes (roformer.deviceless)."""
        abstract = jax.eval_shape(lambda: _init_rest(self.model_cfg, jax.random.key(self.seed)))
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            abstract, self.rest_shardings)

    # The key is an argument of the jitted initialisers, not a constant inside them: a program
    # without inputs is all constants, and XLA's GPU pipeline then tries to constant-fold the
    # random initialisers at compile time (the same values, far slower to compile).
    def _jitted_init_state(self, **jit_options):
        return jax.jit(lambda key: _init_state(self.model_cfg, self.tx, key), **jit_options)

    def init_state(self, *, compiled: bool = True, seed: int | None = None, on_host: bool | None = None) -> dict:
        """The initial state, made by one compiled program (each parameter sharded as it is
        made), or with `compiled=False` op by op and then placed: no compilation of a program
        with one inlined random-bits generator per parameter, which for a base model takes
        tens of seconds, but the whole state passes through the default device first, so
        it is for one-device use (benchmarks). Equal to float rounding (test). `seed`: another
        seed's initial state (vmapped seeds), default the setup's.

        `on_host` (default: in a single process whose devices are not the CPU) makes it with
        the program compiled for the host's CPU, then places it: XLA's GPU pipeline compiles
        that program several times slower than its CPU pipeline, and a single process's host
        can hold the whole state on its way to the devices. Where jax has no CPU backend,
        the device's program."""
        key = jax.random.key(self.seed if seed is None else seed)
        if not compiled:
            return jax.device_put(_init_state(self.model_cfg, self.tx, key), self.state_shardings)
        if on_host is None:
            on_host = jax.process_count() == 1 and jax.default_backend() != "cpu"
        host = _host_cpu() if on_host else None
        if host is not None:
            if self._host_init is None:
                self._host_init = self._jitted_init_state()
            with jax.set_mesh(Mesh([host], ("host",))):   # not the caller's mesh of other devices
                state = self._host_init(jax.device_put(key, host))
            return jax.device_put(state, self.state_shardings)
        if self._sharded_init is None:   # compiled once, then called with each seed's key
            self._sharded_init = self._jitted_init_state(out_shardings=self.state_shardings)
        return self._sharded_init(key)

    def init_states(self, seeds) -> dict:
        """The initial states of `seeds` stacked on a leading axis (vmapped seeds), each
        `TrainSetup(seed=...).init_state()`, from one compiled program called once per seed
        (a vmapped initialiser would hold every seed's random draws at once; so would calls
        left in flight together, hence the wait after each)."""
        init = self._jitted_init_state()
        states = [jax.block_until_ready(init(jax.random.key(seed))) for seed in seeds]
        return jax.tree.map(lambda *leaves: jnp.stack(leaves), *states)

    def init_rest(self):
        return jax.jit(lambda key: _init_rest(self.model_cfg, key),
                       out_shardings=self.rest_shardings)(jax.random.key(self.seed))

    def jit_train_step(self, *, grad_accum: int = 1, debug_nan_step: int = -1):
        """`(state, rest, batch) -> (state, metrics)`, donating the old state."""
        return jax.jit(
            steps.make_train_step(self.graphdef, self.tx, self.schedule, seed=self.seed,
                                  grad_accum=grad_accum, debug_nan_step=debug_nan_step,
                                  dropout_rng_impl=self.dropout_rng_impl),
            in_shardings=(self.state_shardings, self.rest_shardings, sharding.batch_sharding(self.mesh)),
            out_shardings=(self.state_shardings, self.replicated), donate_argnums=0)

    # Seeds stacked on a leading axis (roformer.train.seeds): one device, no shardings.
    def jit_seeds_train_step(self, *, grad_accum: int = 1, debug_nan_step: int = -1):
        """`(states, rest, batches, base_keys) -> (states, metrics)` for stacked seeds, each its
        own dropout base key (steps.dropout_base_key); donates the old states."""
        step = steps.make_keyed_train_step(self.graphdef, self.tx, self.schedule, grad_accum=grad_accum,
                                           debug_nan_step=debug_nan_step)
        return jax.jit(jax.vmap(step, in_axes=(0, None, 0, 0)), donate_argnums=0)

    def jit_seeds_eval_step(self):
        """`(stacked params, rest, batch) -> stacked sums`: every seed on the same batch."""
        return jax.jit(jax.vmap(steps.make_eval_step(self.graphdef), in_axes=(0, None, None)))

    def jit_seeds_attention_stats_step(self):
        return jax.jit(jax.vmap(steps.make_attention_stats_step(self.graphdef), in_axes=(0, None, None)))

    def jit_attention_stats_step(self):
        """`(params, rest, batch) -> roformer.model.attention_stats` (attention distance, hidden cosine)."""
        return jax.jit(steps.make_attention_stats_step(self.graphdef), out_shardings=self.replicated)

    def jit_eval_step(self):
        """`(params, rest, batch) -> sums of loss, correct and weight`."""
        return jax.jit(steps.make_eval_step(self.graphdef), out_shardings=self.replicated)
