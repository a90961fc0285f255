"""Embedding tables looked up in float32 and cast after the lookup."""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx


class Embed(nnx.Embed):
    """nnx.Embed that takes the rows from the float32 table and casts them to `dtype`.

    nnx.Embed casts the whole table first, so with bfloat16 compute the backward pass adds
    every token's gradient into its row in bfloat16. A frequent token's row, or a token
    type's row, sums thousands of them. Here the sums run in float32. The forward values
    are the same, and the cast touches only the rows looked up."""

    def __call__(self, inputs):
        if not jnp.issubdtype(inputs.dtype, jnp.integer):
            raise ValueError("Input type must be an integer or unsigned integer.")
        return jnp.take(self.embedding[...], inputs, axis=0).astype(self.dtype or self.param_dtype)
