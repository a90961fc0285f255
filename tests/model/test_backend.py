"""The backend seam's forms compute their definitions' values (roformer.model.backend).

Gradients of the RoPE form are checked against autodiff of the definition in test_rope.py,
token_matmul and tied_decoder in test_model.py, the attention form in test_attention.py."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from roformer.model import backend, rope

pytestmark = pytest.mark.fast   # the fast lane (docs/testing.md)


def test_shared_table_is_the_table():
    positions = jnp.broadcast_to(jnp.arange(9), (2, 9))
    inv_freq, _ = rope.rope_frequencies(8)
    table = lambda p: jnp.exp(1j * p.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32))  # noqa: E731
    np.testing.assert_array_equal(jax.jit(backend.shared_table, static_argnums=0)(table, positions),
                                  jax.jit(table)(positions))


@pytest.mark.parametrize("layout", rope.ROPE_LAYOUTS)
@pytest.mark.parametrize("input_dtype", [jnp.float32, jnp.bfloat16])
def test_rope_rotation_equals_the_complex_product(layout, input_dtype):
    """Both interleaves (select for float32 input, stack otherwise) give eq. 34's values."""
    x = jax.random.normal(jax.random.key(0), (2, 5, 3, 8), jnp.float32)
    inv_freq, _ = rope.rope_frequencies(8)
    cis = rope.rope_cis(jnp.broadcast_to(jnp.arange(5), (2, 5)), inv_freq)
    rotate = backend.rope_rotation(rope.complex_product)
    np.testing.assert_allclose(rotate(x, cis, layout, input_dtype), rope.complex_product(x, cis, layout),
                               rtol=1e-6, atol=1e-6)


def test_rotate_pairs_is_the_interleaved_product():
    pairs = jax.random.normal(jax.random.key(1), (2, 5, 3, 4, 2))
    cis = jnp.exp(1j * jax.random.normal(jax.random.key(2), (2, 5, 4))).astype(jnp.complex64)
    want = rope.complex_product(pairs.reshape(2, 5, 3, 8), cis, "interleaved")
    np.testing.assert_allclose(backend.rotate_pairs(pairs, cis).reshape(2, 5, 3, 8), want, rtol=1e-6, atol=1e-6)
