"""Position schemes: golden values, shift invariance, efficient == naive Shaw, registry errors."""
import functools
import importlib
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from roformer.config_files import CONFIG_DIR
from roformer.model import ModelConfig, RoFormerModel, attention, positions

pytestmark = pytest.mark.fast   # the fast lane (docs/testing.md)

TINY = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
            max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0)


@functools.cache  # models are only read (eval mode), so tests can share them
def tiny_model(position: str, max_position_embeddings: int = 64) -> RoFormerModel:
    config = ModelConfig(**{**TINY, "position": position, "max_position_embeddings": max_position_embeddings})
    model = RoFormerModel(config, rngs=nnx.Rngs(0))
    model.eval()
    return model


@nnx.jit
def encode(model, input_ids, positions):
    return model(input_ids, positions=positions)


def test_every_scheme_has_a_config_file_that_selects_it_and_unknown_lists_choices():
    from roformer.configs import SCHEME_FILES

    for name in positions.POSITION_SCHEMES:
        path = CONFIG_DIR / f"{SCHEME_FILES[name]}.py"
        assert path.is_file(), f"{name}: no {path}"
        # the config files are the `configs` package (pytest puts the repository root on sys.path)
        config_file = importlib.import_module(f"roformer.configs.{SCHEME_FILES[name]}")
        assert config_file.get_config().model.position == name
    with pytest.raises(ValueError, match=r"unknown position 'no such scheme'.*'alibi'.*'t5'"):
        ModelConfig(**TINY, position="no such scheme")


def test_t5_refuses_bucket_settings_it_cannot_build():
    # Half the buckets per direction, half of those exact: at least one exact bucket, and
    # log-spaced buckets that start below max_distance.
    with pytest.raises(ValueError, match="t5_num_buckets must be >= 4"):
        ModelConfig(**TINY, position="t5", t5_num_buckets=2)
    with pytest.raises(ValueError, match="t5_max_distance must exceed"):
        ModelConfig(**TINY, position="t5", t5_max_distance=8)


def test_t5_bucket_golden_values():
    # Bidirectional, 32 buckets, max distance 128 (relative = key - query).
    golden = {0: 0, **{-d: d for d in range(1, 8)}, **{-d: 8 for d in range(8, 12)},
              -12: 9, -90: 14, -91: 15, -128: 15, -1000: 15,
              **{d: 16 + d for d in range(1, 8)}, **{d: 24 for d in range(8, 12)},
              12: 25, 90: 30, 91: 31, 128: 31, 1000: 31}
    rel = np.array(sorted(golden))
    got = positions.t5_relative_bucket(jnp.asarray(rel), 32, 128)
    assert dict(zip(rel.tolist(), np.asarray(got).tolist())) == golden


def test_alibi_slopes_golden_values():
    np.testing.assert_allclose(positions.alibi_slopes(8),
                               [1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 32, 1 / 64, 1 / 128, 1 / 256])
    # 12 heads: the 8-head slopes, then every other slope of 16 heads (2^-0.5, 2^-1.5, ...).
    np.testing.assert_allclose(positions.alibi_slopes(12),
                               [0.5, 0.25, 0.125, 0.0625, 0.03125, 0.015625, 0.0078125, 0.00390625,
                                0.7071067811865476, 0.3535533905932738, 0.1767766952966369,
                                0.08838834764831845])
    assert positions.alibi_slopes(4).tolist() == [0.25, 0.0625, 0.015625, 0.00390625]


def test_alibi_bias_is_symmetric_distance_penalty():
    scheme = positions.ALiBi(ModelConfig(**TINY, position="alibi"), rngs=nnx.Rngs(0))
    bias = np.asarray(scheme.prepare(jnp.arange(5)[None]))
    assert bias.shape == (1, 4, 5, 5)
    np.testing.assert_allclose(bias, np.transpose(bias, (0, 1, 3, 2)))
    np.testing.assert_allclose(bias[0, 0, 1], [-0.25, 0, -0.25, -0.5, -0.75])


def test_t5_table_is_shared_by_all_layers():
    model = tiny_model("t5")
    names = [".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))]
    t5_params = [n for n in names if "relative_attention_bias" in n]
    assert t5_params == ["position.relative_attention_bias.embedding"]
    assert model.position.relative_attention_bias.embedding.shape == (32, 4)


def sinusoidal_table(scaling: str) -> tuple[positions.SinusoidalAbsolute, np.ndarray]:
    config = ModelConfig(**TINY, position="sinusoidal", sinusoidal_scaling=scaling)
    scheme = positions.SinusoidalAbsolute(config, rngs=nnx.Rngs(0))
    return scheme, np.asarray(scheme.embed(jnp.arange(50)[None], jnp.float32))[0]


@pytest.mark.parametrize("scaling", ["unscaled", "vaswani", "scaled"])
def test_sinusoidal_table_is_vaswanis_times_the_forms_scale(scaling):
    scheme, table = sinusoidal_table(scaling)
    scale = 32 ** -0.5 if scaling == "scaled" else 1.0   # Cramming's scalar's initial 1/sqrt(d), fixed
    pos, i = 37, 5
    assert table[pos, 2 * i] == pytest.approx(scale * math.sin(pos / 10000 ** (2 * i / 32)), abs=1e-5)
    assert table[pos, 2 * i + 1] == pytest.approx(scale * math.cos(pos / 10000 ** (2 * i / 32)), abs=1e-5)
    assert scheme.token_scale == (math.sqrt(32) if scaling == "vaswani" else 1.0)
    assert not jax.tree.leaves(nnx.state(scheme, nnx.Param))   # no form learns anything


def test_sinusoidal_default_is_the_scaled_form_and_unknown_forms_are_refused():
    assert ModelConfig(**TINY, position="sinusoidal").sinusoidal_scaling == "scaled"
    with pytest.raises(ValueError, match="unknown sinusoidal_scaling 'half'"):
        ModelConfig(**TINY, position="sinusoidal", sinusoidal_scaling="half")


def test_vaswani_form_multiplies_the_word_embeddings_by_sqrt_d():
    config = ModelConfig(**TINY, position="sinusoidal", sinusoidal_scaling="vaswani")
    model = RoFormerModel(config, rngs=nnx.Rngs(0))
    ids = jnp.array([[5, 6, 7]])
    emb = model.embeddings
    scaled = emb.word_embeddings(ids) * math.sqrt(32) + emb.token_type_embeddings(jnp.zeros_like(ids))
    expected = emb.LayerNorm(scaled + model.position.embed(jnp.arange(3)[None], jnp.float32))
    got = emb(ids, jnp.zeros_like(ids), model.position.embed(jnp.arange(3)[None], jnp.float32),
              token_scale=model.position.token_scale)
    np.testing.assert_allclose(got, expected, atol=1e-6)


def test_a_saved_sinusoidal_config_without_the_form_is_the_unscaled_table_it_was_trained_with():
    saved = {**TINY, "position": "sinusoidal"}
    assert ModelConfig.from_dict(ModelConfig.saved_fields(saved)).sinusoidal_scaling == "unscaled"
    assert "sinusoidal_scaling" not in ModelConfig.saved_fields({**TINY, "position": "rope"})


def adds_absolute_embeddings(position: str) -> bool:
    return positions.POSITION_SCHEMES[position].embed is not positions.PositionScheme.embed


@pytest.mark.parametrize("position", sorted(positions.POSITION_SCHEMES))
def test_a_scheme_is_shift_invariant_unless_it_adds_absolute_embeddings(position):
    model = tiny_model(position)
    if adds_absolute_embeddings(position):
        ids = jnp.ones((1, 8), jnp.int32)
        base = jnp.arange(8, dtype=jnp.int32)[None]
        assert not np.allclose(encode(model, ids, base), encode(model, ids, base + 5), atol=1e-3)
        return
    ids = jnp.asarray(np.random.default_rng(0).integers(1, 64, size=(2, 16)), jnp.int32)
    base = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (2, 16))
    out = encode(model, ids, base)
    shifted = encode(model, ids, base + jnp.asarray([[37], [250]], jnp.int32))
    np.testing.assert_allclose(out, shifted, atol=2e-4)


def test_none_is_permutation_equivariant():
    model = tiny_model("none")
    ids = jnp.asarray(np.random.default_rng(1).integers(1, 64, size=(1, 12)), jnp.int32)
    perm = np.random.default_rng(2).permutation(12)
    base = jnp.arange(12, dtype=jnp.int32)[None]
    out = encode(model, ids, base)
    np.testing.assert_allclose(encode(model, ids[:, perm], base), out[:, perm], atol=1e-5)


def naive_shaw(q, k, v, rel_index, key_table, value_table, mask):
    """Shaw et al. eq. 3-5 with the [L, L, D] relative tensors built explicitly (float64)."""
    q, k, v = (np.asarray(t, np.float64) for t in (q, k, v))
    a_key = np.asarray(key_table, np.float64)[rel_index]        # [B, L, L, D]
    a_value = np.asarray(value_table, np.float64)[rel_index]
    logits = (np.einsum("bqhd,bkhd->bhqk", q, k) + np.einsum("bqhd,bqkd->bhqk", q, a_key)) / math.sqrt(q.shape[-1])
    logits = np.where(mask, logits, -1e30)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", probs, v) + np.einsum("bhqk,bqkd->bqhd", probs, a_value)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**16), clip=st.sampled_from([1, 3, 16]))
def test_efficient_shaw_equals_naive(seed, clip):
    rng = np.random.default_rng(seed)
    q, k, v = rng.normal(size=(3, 2, 10, 2, 8)).astype(np.float32)
    key_table, value_table = rng.normal(size=(2, 2 * clip + 1, 8)).astype(np.float32)
    pos = np.stack([np.arange(10), np.r_[np.arange(6), np.arange(4)]])  # second row packed
    rel_index = np.clip(pos[:, None, :] - pos[:, :, None], -clip, clip) + clip
    key_mask = np.ones((2, 10), bool)
    key_mask[0, 8:] = False
    mask = key_mask[:, None, None, :]
    got = _shaw(q, k, v, rel_index, key_table, value_table, mask)
    np.testing.assert_allclose(got, naive_shaw(q, k, v, rel_index, key_table, value_table, mask), atol=1e-4)


@jax.jit
def _shaw(q, k, v, rel_index, key_table, value_table, mask):
    return attention.explicit_softmax_attention(q, k, v, mask=mask,
                                                relative=(rel_index, key_table, value_table))


def test_shaw_never_materialises_length_by_length_by_dim():
    batch, length, heads, dim, clip = 1, 128, 2, 64, 16
    args = (jnp.zeros((batch, length, heads, dim)),) * 3 + (
        jnp.zeros((batch, length, length), jnp.int32), jnp.zeros((2 * clip + 1, dim)),
        jnp.zeros((2 * clip + 1, dim)), jnp.ones((batch, 1, 1, length), bool))
    temp_bytes = _shaw.lower(*args).compile().memory_analysis().temp_size_in_bytes
    # A few [B, H, L, L] score-sized buffers are expected; one [B, L, L, D] would be 4x this bound.
    assert temp_bytes < batch * length * length * dim * 4 / 4, temp_bytes


def test_bias_schemes_go_through_dot_product_attention_equivalently():
    rng = np.random.default_rng(4)
    q, k, v = (jnp.asarray(t) for t in rng.normal(size=(3, 2, 6, 4, 8)).astype(np.float32))
    scheme = positions.T5Bias(ModelConfig(**TINY, position="t5"), rngs=nnx.Rngs(0))
    bias = scheme.prepare(jnp.broadcast_to(jnp.arange(6), (2, 6))) * 10
    mask = attention.attention_mask(jnp.asarray([[1] * 6, [1] * 4 + [0] * 2], bool), None)
    fused = jax.jit(attention.softmax_attention)(q, k, v, bias=bias, mask=mask)
    explicit = jax.jit(attention.explicit_softmax_attention)(q, k, v, bias=bias, mask=mask)
    np.testing.assert_allclose(fused, explicit, atol=1e-5)


def test_learned_table_too_short_is_a_clear_error():
    model = tiny_model("learned", max_position_embeddings=8)
    with pytest.raises(ValueError, match="longer than the learned position table"):
        model(jnp.ones((1, 9), jnp.int32))
