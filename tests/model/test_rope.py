"""Complex-multiplication RoPE against the paper's rotation matrix and its properties."""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from roformer.model import rope

pytestmark = pytest.mark.fast   # the fast lane (docs/testing.md)

SETTINGS = settings(max_examples=25, deadline=None)


def rotate(x, positions, *, base=10000.0, layout="interleaved", rotary_dim=None, **scaling):
    """x [B, L, H, D] rotated at positions [B, L] (test helper around the public functions)."""
    rotary_dim = rotary_dim or x.shape[-1]
    inv_freq, magnitude = rope.rope_frequencies(rotary_dim, base, **scaling)
    return np.asarray(_rotate(jnp.asarray(x), jnp.asarray(positions), jnp.asarray(inv_freq, jnp.float32),
                              magnitude=magnitude, layout=layout))


@functools.partial(jax.jit, static_argnames=("magnitude", "layout"))
def _rotate(x, positions, inv_freq, *, magnitude, layout):
    # Jitted, as the model runs it: op by op, the table's conditional (backend.shared_table)
    # would compile anew at every call, and the hypothesis tests make hundreds.
    return rope.apply_rope(x, rope.rope_cis(positions, inv_freq, magnitude), layout)


def paper_rotation_matrix(position: float, dim: int, base: float) -> np.ndarray:
    """R_{Theta,m} of eq. 15: block-diagonal 2x2 rotations by m * theta_j, float64."""
    matrix = np.zeros((dim, dim))
    for j in range(dim // 2):
        angle = position * base ** (-2 * j / dim)
        c, s = math.cos(angle), math.sin(angle)
        matrix[2 * j:2 * j + 2, 2 * j:2 * j + 2] = [[c, -s], [s, c]]
    return matrix


@SETTINGS
@given(dim=st.sampled_from([2, 4, 8, 16, 32]), position=st.integers(0, 2048),
       base=st.sampled_from([100.0, 10000.0, 500000.0]), seed=st.integers(0, 2**16))
def test_equals_paper_rotation_matrix(dim, position, base, seed):
    x = np.random.default_rng(seed).normal(size=dim).astype(np.float32)
    expected = paper_rotation_matrix(position, dim, base) @ x.astype(np.float64)
    got = rotate(x[None, None, None], [[position]], base=base)[0, 0, 0]
    np.testing.assert_allclose(got, expected, atol=5e-4 * max(1.0, position / 512), rtol=1e-4)


@SETTINGS
@given(m=st.integers(0, 512), n=st.integers(0, 512), shift=st.integers(-256, 512),
       seed=st.integers(0, 2**16))
def test_scores_depend_only_on_relative_position(m, n, shift, seed):
    if min(m, n) + shift < 0:
        shift = -min(m, n)
    q, k = np.random.default_rng(seed).normal(size=(2, 1, 1, 1, 32)).astype(np.float32)
    score = lambda a, b: float(np.sum(rotate(q, [[a]]) * rotate(k, [[b]])))  # noqa: E731
    assert score(m, n) == pytest.approx(score(m + shift, n + shift), abs=2e-4, rel=1e-4)


@SETTINGS
@given(position=st.integers(0, 100_000), seed=st.integers(0, 2**16),
       layout=st.sampled_from(rope.ROPE_LAYOUTS))
def test_norm_preserved(position, seed, layout):
    x = np.random.default_rng(seed).normal(size=(1, 1, 3, 16)).astype(np.float32)
    got = rotate(x, [[position]], layout=layout)
    np.testing.assert_allclose(np.linalg.norm(got, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)


@SETTINGS
@given(seed=st.integers(0, 2**16), rotary_dim=st.sampled_from([4, 8, 16]))
def test_interleaved_equals_half_after_permutation(seed, rotary_dim):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(2, 5, 2, 16)).astype(np.float32)
    positions = rng.integers(0, 1000, size=(2, 5))
    interleaved = rotate(x, positions, layout="interleaved", rotary_dim=rotary_dim)
    half = rotate(rope.interleaved_to_half(x, rotary_dim), positions, layout="half", rotary_dim=rotary_dim)
    np.testing.assert_allclose(rope.interleaved_to_half(interleaved, rotary_dim), half, atol=1e-6)
    np.testing.assert_array_equal(rope.half_to_interleaved(rope.interleaved_to_half(x, rotary_dim), rotary_dim), x)


def test_partial_rotary_passes_the_rest_through():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 7, 2, 16)).astype(np.float32)
    positions = np.tile(np.arange(7), (2, 1)) + 3
    got = rotate(x, positions, rotary_dim=8)
    np.testing.assert_array_equal(got[..., 8:], x[..., 8:])
    np.testing.assert_allclose(got[..., :8], rotate(x[..., :8], positions), atol=1e-6)
    assert not np.allclose(got[..., :8], x[..., :8])


def test_linear_interpolation_equals_scaled_positions():
    x = np.random.default_rng(1).normal(size=(1, 8, 2, 16)).astype(np.float32)
    positions = np.arange(0, 4096, 512)[None].astype(np.int32)
    interpolated = rotate(x, positions, scaling="linear", factor=4.0)
    scaled = rotate(x, positions.astype(np.float32) / 4.0)
    np.testing.assert_allclose(interpolated, scaled, atol=2e-5)


def test_ntk_scales_the_base():
    inv_freq, magnitude = rope.rope_frequencies(16, 10000.0, scaling="ntk", factor=8.0)
    expected, _ = rope.rope_frequencies(16, 10000.0 * 8.0 ** (16 / 14))
    np.testing.assert_allclose(inv_freq, expected)
    assert magnitude == 1.0
    assert inv_freq[0] == 1.0  # the highest frequency is untouched


def test_yarn_interpolates_low_frequencies_only():
    plain, _ = rope.rope_frequencies(64, 10000.0)
    yarn, magnitude = rope.rope_frequencies(64, 10000.0, scaling="yarn", factor=4.0, original_max_len=512)
    # Ramp ends for d=64, base 1e4, 512 positions: 64 ln(512 / (2 pi beta)) / (2 ln 1e4)
    # = 3.25 for beta_fast=32 (floor -> 3) and 15.29 for beta_slow=1 (ceil -> 16).
    np.testing.assert_allclose(yarn[:4], plain[:4])
    np.testing.assert_allclose(yarn[16:], plain[16:] / 4.0)
    ratio = yarn / plain
    np.testing.assert_allclose(ratio[4:16], 1.0 - 0.75 * (np.arange(4, 16) - 3) / 13)
    assert magnitude == pytest.approx(0.1 * math.log(4.0) + 1.0)
    # The magnitude multiplies q and k, so logits are scaled by its square.
    x = np.ones((1, 1, 1, 64), np.float32)
    got = rotate(x, [[0]], scaling="yarn", factor=4.0, original_max_len=512)
    np.testing.assert_allclose(got, x * magnitude, rtol=1e-6)


def test_yarns_temperature_scales_the_logits_only():
    """YaRN's magnitude is a softmax temperature: q and k carry it, values rotated with
    rotary_value do not, and linear attention (no softmax) takes the frequencies only."""
    from roformer.model import ModelConfig
    from roformer.model.positions import Rotary
    from flax import nnx

    keys = dict(vocab_size=64, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64,
                position="rope", rope_scaling="yarn", rope_scaling_factor=4.0, rope_original_max_len=16)
    magnitude = 0.1 * math.log(4.0) + 1.0
    softmax = Rotary(ModelConfig(**keys, rotary_value=True), rngs=nnx.Rngs(0))
    linear = Rotary(ModelConfig(**keys, attention="linear"), rngs=nnx.Rngs(0))
    assert softmax.magnitude == pytest.approx(magnitude) and linear.magnitude == 1.0
    assert linear.inv_freq == softmax.inv_freq
    x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 5, 2, 16)), jnp.float32)
    cis = softmax.prepare(jnp.arange(5)[None])
    q, k, v = softmax.rotate(x, x, x, cis)
    norm = lambda a: np.linalg.norm(np.asarray(a), axis=-1)  # noqa: E731
    np.testing.assert_allclose(norm(q), magnitude * norm(x), rtol=1e-5)
    np.testing.assert_allclose(norm(v), norm(x), rtol=1e-5)
    np.testing.assert_allclose(norm(linear.rotate(x, x, x, linear.prepare(jnp.arange(5)[None]))[0]), norm(x),
                               rtol=1e-5)


def test_bf16_at_large_position_rotated_by_the_right_angle():
    x = np.random.default_rng(2).normal(size=(1, 1, 1, 64)).astype(np.float32)
    x_bf16 = jnp.asarray(x, jnp.bfloat16)
    inv_freq, _ = rope.rope_frequencies(64)
    got = rope.apply_rope(x_bf16, rope.rope_cis(jnp.array([[10_000]], jnp.int32), inv_freq))
    assert got.dtype == jnp.bfloat16
    reference = paper_rotation_matrix(10_000, 64, 10000.0) @ np.asarray(x_bf16, np.float64)[0, 0, 0]
    np.testing.assert_allclose(np.asarray(got, np.float32)[0, 0, 0], reference, atol=2e-2, rtol=1e-2)
    # Forming the angle in bf16 instead would be far off (10000 is not exact in bf16 steps).
    assert float(jnp.asarray(10_001, jnp.bfloat16)) != 10_001


def test_jit_matches_eager_and_positions_are_per_row():
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(2, 6, 2, 8)).astype(np.float32))
    positions = jnp.asarray([[0, 1, 2, 0, 1, 2], [5, 6, 7, 8, 9, 10]], jnp.int32)
    inv_freq, _ = rope.rope_frequencies(8)
    fn = jax.jit(lambda x, p: rope.apply_rope(x, rope.rope_cis(p, inv_freq)))
    eager = rope.apply_rope(x, rope.rope_cis(positions, inv_freq))
    np.testing.assert_allclose(fn(x, positions), eager, atol=1e-6)
    # Packed rows restart at 0: the token at position 0 is unrotated.
    np.testing.assert_allclose(eager[0, 3], x[0, 3], atol=1e-7)


def plain_rope(x, cis, layout):
    """The reference: the complex product written plainly, differentiated by autodiff."""
    rotary_dim = 2 * cis.shape[-1]
    rot = x[..., :rotary_dim].astype(jnp.float32)
    pairs = (rot.reshape(*rot.shape[:-1], rotary_dim // 2, 2) if layout == "interleaved"
             else jnp.stack([rot[..., :rotary_dim // 2], rot[..., rotary_dim // 2:]], axis=-1))
    z = jax.lax.complex(pairs[..., 0], pairs[..., 1]) * cis[..., None, :]
    out = (jnp.stack([z.real, z.imag], -1).reshape(rot.shape) if layout == "interleaved"
           else jnp.concatenate([z.real, z.imag], -1))
    return jnp.concatenate([out.astype(x.dtype), x[..., rotary_dim:]], axis=-1)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_gradients_equal_autodiff_of_the_complex_product(layout, dtype):
    """apply_rope's VJP (its JVP rule transposed) equals autodiff of the plain product, for x
    and for cis built from float (differentiable) positions."""
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.normal(size=(2, 5, 3, 8)), dtype)
    grad_out = jnp.asarray(rng.normal(size=(2, 5, 3, 8)), dtype)
    inv_freq, _ = rope.rope_frequencies(6)  # partial rotary: 6 of 8 features
    positions = jnp.asarray(rng.uniform(0, 50, size=(2, 5)), jnp.float32)

    def plain(x, p):
        return plain_rope(x, rope.rope_cis(p, inv_freq), layout)

    def ours(x, p):
        return rope.apply_rope(x, rope.rope_cis(p, inv_freq), layout)

    want = jax.vjp(plain, x, positions)[1](grad_out)
    got = jax.jit(lambda x, p, g: jax.vjp(ours, x, p)[1](g))(x, positions, grad_out)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32), atol=tol)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_forward_mode_and_second_order_equal_autodiff_of_the_complex_product(layout):
    """jvp, jacfwd, grad and grad-of-grad of apply_rope, in x and in float positions, match
    the plain product's (forward mode used to be refused by a custom_vjp)."""
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.normal(size=(1, 2, 2, 8)), jnp.float32)
    x_dot = jnp.asarray(rng.normal(size=x.shape), jnp.float32)
    positions = jnp.asarray(rng.uniform(0, 20, size=(1, 2)), jnp.float32)
    inv_freq, _ = rope.rope_frequencies(6)  # partial rotary: 6 of 8 features

    def plain(x, p):
        return plain_rope(x, rope.rope_cis(p, inv_freq), layout)

    def ours(x, p):
        return rope.apply_rope(x, rope.rope_cis(p, inv_freq), layout)

    def loss(fn):  # a non-quadratic scalar, so the second derivative mixes x and positions
        return lambda x, p: jnp.sum(jnp.sin(fn(x, p)) * x)

    def close(got, want):
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)

    def agree(transform):
        # transform(ours) against transform(plain) at (x, positions), each one jitted program:
        # op by op, each of the many small derivative ops would compile on its own
        close(jax.jit(transform(ours))(x, positions), jax.jit(transform(plain))(x, positions))

    tangents = (x_dot, jnp.ones_like(positions))
    agree(lambda fn: lambda x, p: jax.jvp(fn, (x, p), tangents))
    agree(lambda fn: lambda x, p: jax.jvp(lambda x: fn(x, p), (x,), (x_dot,)))  # cis without tangent
    agree(lambda fn: jax.jacfwd(fn, argnums=(0, 1)))
    agree(lambda fn: jax.grad(loss(fn), argnums=(0, 1)))
    # d/dx of <grad_x loss, x_dot>, and d/dp of the positions gradient
    agree(lambda fn: jax.grad(lambda x, p: jnp.vdot(jax.grad(loss(fn))(x, p), x_dot)
                              + jnp.sum(jax.grad(loss(fn), argnums=1)(x, p)), argnums=(0, 1)))


def test_clear_errors():
    with pytest.raises(ValueError, match="even"):
        rope.rope_frequencies(7)
    with pytest.raises(ValueError, match="rope_scaling"):
        rope.rope_frequencies(8, scaling="dynamic")
    with pytest.raises(ValueError, match="rope_layout"):
        rope.apply_rope(jnp.ones((1, 1, 1, 8)), jnp.ones((1, 1, 4), jnp.complex64), "zigzag")
    with pytest.raises(ValueError, match="head dim"):
        rope.apply_rope(jnp.ones((1, 1, 1, 4)), jnp.ones((1, 1, 4), jnp.complex64))
