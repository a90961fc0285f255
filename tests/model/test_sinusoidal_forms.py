"""Sinusoidal positions in their published forms (Vaswani's, Cramming's learnable scaled form)
stay in use through training: a short run of the real train step, then the scale and the
position-to-token ratio at its last step (roformer.model.position_signal)."""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from roformer.convert import check_hf_expressible, load_converted, save_converted
from roformer.errors import ConfigError
from roformer.model import ModelConfig, RoFormerForMaskedLM, positions
from roformer.model.position_signal import position_signal, position_to_token_ratio
from roformer.train import optim, steps

TINY = dict(vocab_size=200, hidden_size=32, num_layers=1, num_heads=4, intermediate_size=64,
            max_position_embeddings=32, hidden_dropout=0.0, attention_dropout=0.0)
LENGTH = 32
# "In use": the position term keeps at least half of its starting size against the tokens.
FLOOR = 0.5


def random_batches(steps_: int, rows: int = 8, masked: int = 5):
    rng = np.random.default_rng(0)
    for _ in range(steps_):
        ids = rng.integers(5, TINY["vocab_size"], size=(rows, LENGTH))
        slots = np.stack([rng.permutation(LENGTH)[:masked] for _ in range(rows)])
        inputs = ids.copy()
        np.put_along_axis(inputs, slots, 3, axis=1)
        yield {"input_ids": jnp.asarray(inputs, jnp.int32), "token_type_ids": jnp.zeros((rows, LENGTH), jnp.int32),
               "positions": jnp.broadcast_to(jnp.arange(LENGTH, dtype=jnp.int32), (rows, LENGTH)),
               "segment_ids": jnp.ones((rows, LENGTH), jnp.int32), "masked_positions": jnp.asarray(slots, jnp.int32),
               "masked_labels": jnp.asarray(np.take_along_axis(ids, slots, 1), jnp.int32),
               "masked_weights": jnp.ones((rows, masked), jnp.float32)}


def ratio(model) -> float:
    ids = jnp.asarray(np.random.default_rng(1).integers(5, TINY["vocab_size"], size=(4, LENGTH)), jnp.int32)
    return position_to_token_ratio(model, ids, jnp.broadcast_to(jnp.arange(LENGTH), (4, LENGTH)))


@functools.lru_cache(maxsize=None)   # one run per form, read by several tests
def train(scaling: str, steps_: int = 30, learning_rate: float = 1e-3) -> tuple[RoFormerForMaskedLM, dict]:
    """The model after `steps_` train steps, and its scale and ratio at the first and last step."""
    model = RoFormerForMaskedLM(ModelConfig(**TINY, position="sinusoidal", sinusoidal_scaling=scaling),
                                rngs=nnx.Rngs(0))
    start = {"scale": float(model.roformer.position.signal()["scale"]), "ratio": ratio(model)}
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    params = nnx.to_pure_dict(params)
    tx, schedule = optim.make_optimizer(learning_rate=learning_rate, warmup_steps=5, total_steps=steps_,
                                        decay="linear", weight_decay=0.01, b1=0.9, b2=0.98, eps=1e-6,
                                        clip_norm=1.0)
    step = jax.jit(steps.make_train_step(graphdef, tx, schedule, seed=0))
    state = {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}
    for batch in random_batches(steps_):
        state, _ = step(state, rest, batch)
    nnx.update(model, nnx.State(state["params"]))
    end = {"scale": float(model.roformer.position.signal()["scale"]), "ratio": ratio(model)}
    return model, {"start": start, "end": end}


def in_use(figures: dict) -> bool:
    """The position term at the last step is at least FLOOR of its start, in scale and in ratio."""
    return (figures["end"]["ratio"] > FLOOR * figures["start"]["ratio"]
            and figures["end"]["scale"] > FLOOR * figures["start"]["scale"])


@pytest.mark.parametrize("scaling", ["vaswani", "cramming"])
def test_each_published_form_keeps_its_position_term_through_a_short_run(scaling, record_property):
    _, figures = train(scaling)
    # Reported (pytest's junit properties and -s output) as well as checked.
    record_property(f"{scaling}_last_step", figures["end"])
    print(f"{scaling}: start {figures['start']}, last step {figures['end']}")
    assert in_use(figures)


def test_the_check_fails_when_the_table_is_dropped(monkeypatch):
    # The same run with the table dropped (its embeddings zero): the ratio check must fail.
    monkeypatch.setattr(positions.SinusoidalAbsolute, "embed",
                        lambda self, p, dtype: jnp.zeros((*p.shape, TINY["hidden_size"]), dtype))
    _, figures = train.__wrapped__("cramming", steps_=3)
    assert figures["end"]["ratio"] == 0 and not in_use(figures)


def test_cramming_scale_is_a_learned_parameter_that_training_moves():
    model, figures = train("cramming")
    scheme = model.roformer.position
    leaves = jax.tree.leaves(nnx.state(scheme, nnx.Param))
    assert len(leaves) == 1 and leaves[0].shape == ()
    assert figures["start"]["scale"] == pytest.approx(32 ** -0.5)
    assert figures["end"]["scale"] != pytest.approx(figures["start"]["scale"], abs=1e-6)
    # A 0-d parameter, outside the weight-decay mask (as the norms' scales).
    assert not optim.decay_mask(nnx.to_pure_dict(nnx.state(scheme, nnx.Param)))["scale_factor"]


def test_cramming_table_is_the_fixed_table_times_the_learned_scalar():
    config = ModelConfig(**TINY, position="sinusoidal", sinusoidal_scaling="cramming")
    scheme = positions.SinusoidalAbsolute(config, rngs=nnx.Rngs(0))
    scheme.scale_factor[...] = jnp.asarray(0.3)
    table = np.asarray(scheme.embed(jnp.arange(50)[None], jnp.float32))[0]
    pos, i = 37, 5
    assert table[pos, 2 * i] == pytest.approx(0.3 * math.sin(pos / 10000 ** (2 * i / 32)), abs=1e-5)
    assert table[pos, 2 * i + 1] == pytest.approx(0.3 * math.cos(pos / 10000 ** (2 * i / 32)), abs=1e-5)
    assert float(scheme.signal()["scale"]) == pytest.approx(0.3)


@pytest.mark.parametrize("scaling, expected", [
    # sigma = initializer_range = 0.02, d = 128; the class docstring's formulas (the type
    # embedding is one random row, so its RMS, and the ratio, vary by a few percent).
    ("scaled", 1 / (2 * 0.02 * math.sqrt(128))),
    ("cramming", 1 / (2 * 0.02 * math.sqrt(128))),
    ("vaswani", 1 / (math.sqrt(2) * 0.02 * math.sqrt(129))),
    ("unscaled", 1 / (2 * 0.02))])
def test_position_to_token_ratio_at_initialisation_is_the_docstrings(scaling, expected):
    config = ModelConfig(vocab_size=500, hidden_size=128, num_layers=1, num_heads=2, intermediate_size=128,
                         max_position_embeddings=64, position="sinusoidal", sinusoidal_scaling=scaling)
    assert position_signal(config, length=64, batch=4)["input"] == pytest.approx(expected, rel=0.08)


def test_hf_export_refuses_the_cramming_form_in_one_line_and_our_format_keeps_its_scale(tmp_path):
    config = ModelConfig(**TINY, position="sinusoidal", sinusoidal_scaling="cramming")
    with pytest.raises(ConfigError, match="HF RoFormer cannot express") as error:
        check_hf_expressible(config)
    assert "\n" not in str(error.value)
    model = RoFormerForMaskedLM(config, rngs=nnx.Rngs(0))
    model.roformer.position.scale_factor[...] = jnp.asarray(0.123)
    _, loaded = load_converted(save_converted(model, tmp_path / "ours"))
    assert float(loaded.roformer.position.signal()["scale"]) == pytest.approx(0.123)
