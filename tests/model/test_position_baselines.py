"""The position schemes' baselines in the form that works in training (docs/model.md)."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from roformer.model import ModelConfig, RoFormerForMaskedLM, positions
from roformer.train import optim, steps

TINY = dict(vocab_size=200, hidden_size=32, num_layers=1, num_heads=4, intermediate_size=64,
            max_position_embeddings=32, hidden_dropout=0.0, attention_dropout=0.0)


def _position_rms(model) -> float:
    table = model.roformer.position.embed(jnp.arange(32)[None], jnp.float32)
    return float(jnp.sqrt(jnp.mean(jnp.square(table))))


def topic_batches(steps_: int, rows: int = 16, length: int = 32, masked: int = 5):
    """MLM batches in which the context's words, never their places, tell the masked word:
    each row draws its words from one of 10 topics of 19 words, 5 of them masked ([MASK] = 3).
    Position terms are noise to such a model, so its gradient shrinks them from the start."""
    rng = np.random.default_rng(0)
    for _ in range(steps_):
        ids = 10 + rng.integers(0, 10, size=(rows, 1)) * 19 + rng.integers(0, 19, size=(rows, length))
        slots = np.stack([rng.permutation(length)[:masked] for _ in range(rows)])
        inputs = ids.copy()
        np.put_along_axis(inputs, slots, 3, axis=1)
        yield {"input_ids": jnp.asarray(inputs, jnp.int32), "token_type_ids": jnp.zeros((rows, length), jnp.int32),
               "positions": jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (rows, length)),
               "segment_ids": jnp.ones((rows, length), jnp.int32), "masked_positions": jnp.asarray(slots, jnp.int32),
               "masked_labels": jnp.asarray(np.take_along_axis(ids, slots, 1), jnp.int32),
               "masked_weights": jnp.ones((rows, masked), jnp.float32)}


def test_the_sinusoidal_scale_survives_a_short_high_rate_run():
    # Learnable, Cramming's scalar went from 1/sqrt(d) to about 0 within a few hundred steps
    # of the onset recipe: Adam moves a scalar by about the learning rate per step, whatever
    # its size. Here, at 1e-2 (held nearly constant) that takes a few dozen steps. The form
    # the ablation trains must keep its position term.
    config = ModelConfig(**TINY, position="sinusoidal")
    model = RoFormerForMaskedLM(config, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    params = nnx.to_pure_dict(params)
    before = _position_rms(model)
    tx, schedule = optim.make_optimizer(learning_rate=1e-2, warmup_steps=0, total_steps=400, decay="linear",
                                        weight_decay=0.01, b1=0.9, b2=0.98, eps=1e-6, clip_norm=1.0)
    step = jax.jit(steps.make_train_step(graphdef, tx, schedule, seed=0))
    state = {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}
    for batch in topic_batches(40):
        state, _ = step(state, rest, batch)
    nnx.update(model, nnx.State(state["params"]))
    assert _position_rms(model) > 0.5 * before


def test_t5_bias_starts_at_t5xs_scale():
    # T5X: variance_scaling(1.0, "fan_avg", "uniform") -> std sqrt(2 / (buckets + heads)).
    config = ModelConfig(**TINY, position="t5", t5_num_buckets=32)
    table = np.asarray(positions.T5Bias(config, rngs=nnx.Rngs(0)).relative_attention_bias.embedding[...])
    assert table.std() == pytest.approx(math.sqrt(2 / (32 + 4)), rel=0.15)
    assert np.abs(table).max() <= math.sqrt(3 * 2 / (32 + 4)) + 1e-6   # uniform


@pytest.mark.parametrize("position, names", [
    ("learned", {"table_rms", "table_rms_centred"}), ("sinusoidal", {"scale"}),
    ("t5", {"bias_rms", "bias_range"}), ("alibi", {"slope_max", "slope_min"}),
    ("shaw", {"key_rms", "value_rms"}), ("rope", set()), ("none", set())])
def test_every_scheme_reports_its_position_signal_as_jittable_scalars(position, names):
    model = RoFormerForMaskedLM(ModelConfig(**TINY, position=position), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    signal = jax.jit(lambda s: nnx.merge(graphdef, s).roformer.position.signal())(state)
    assert set(signal) == names
    assert all(np.ndim(v) == 0 and np.isfinite(v) and v > 0 for v in signal.values())


def test_signal_values_are_what_the_scheme_holds():
    sinusoidal = positions.SinusoidalAbsolute(ModelConfig(**TINY, position="sinusoidal"), rngs=nnx.Rngs(0))
    assert float(sinusoidal.signal()["scale"]) == pytest.approx(32 ** -0.5)
    alibi = positions.ALiBi(ModelConfig(**TINY, position="alibi"), rngs=nnx.Rngs(0))
    assert float(alibi.signal()["slope_max"]) == 0.25 and float(alibi.signal()["slope_min"]) == 2 ** -8
