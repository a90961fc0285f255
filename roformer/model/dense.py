"""The encoder's dense layers: HF-initialised nnx.Linear whose parameters declare their axes.

Their matmul is the backend seam's `token_matmul` (roformer.model.backend): the same
product as nnx.Linear's, on the input flattened to [tokens, features].
"""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from roformer.model import backend
from roformer.model.axes import declare


class Dense(nnx.Linear):
    """nnx.Linear, with the float32 bias broadcast to the output's shape before it is cast to
    the compute dtype. The forward values are the same. In the backward pass the bias
    gradient, a sum over every token of the batch, is then taken in float32. nnx.Linear
    casts first, so with bfloat16 compute the sum runs in bfloat16."""

    def __call__(self, inputs):
        return self.project(inputs, self.kernel[...], self.bias[...])

    def project(self, inputs, kernel, bias):
        """This layer's product with another kernel [in, out'] and bias [out'] (e.g. its own
        with columns permuted, or several layers' concatenated), in its dtype and dot."""
        y = self.product(inputs, kernel)
        return y + jnp.broadcast_to(bias, y.shape).astype(y.dtype)

    def product(self, inputs, kernel):
        """inputs @ kernel in this layer's dtype and dot, without the bias (for a form that
        adds the bias itself: backend.residual_layer_norm)."""
        inputs, kernel = self.promote_dtype((inputs, kernel), dtype=self.dtype)
        return self.dot_general(inputs, kernel, (((inputs.ndim - 1,), (0,)), ((), ())), precision=self.precision)


def dense(in_features: int, out_features: int, axes: tuple[str | None, str | None], *, dtype,
          initializer_range: float, rngs: nnx.Rngs) -> Dense:
    """HF-initialised Dense (normal(initializer_range) kernel, zero bias) whose kernel [in, out]
    has logical `axes`; the bias stays replicated. Parameters are float32, compute in `dtype`."""
    return Dense(in_features, out_features, dtype=dtype, param_dtype=jnp.float32,
                 kernel_init=nnx.initializers.normal(initializer_range),
                 dot_general=backend.token_matmul,
                 kernel_metadata=declare(*axes), bias_metadata=declare(None), rngs=rngs)
