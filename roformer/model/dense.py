"""The encoder's dense layers: HF-initialised nnx.Linear whose parameters declare their axes.

Their matmul is the backend seam's `token_matmul` (roformer.model.backend): the same
product as nnx.Linear's, on the input flattened to [tokens, features].
"""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from roformer.model import backend
from roformer.model.axes import declare


def dense(in_features: int, out_features: int, axes: tuple[str | None, str | None], *, dtype,
          initializer_range: float, rngs: nnx.Rngs) -> nnx.Linear:
    """HF-initialised Linear (normal(initializer_range) kernel, zero bias) whose kernel [in, out]
    has logical `axes`; the bias stays replicated. Parameters are float32, compute in `dtype`."""
    return nnx.Linear(in_features, out_features, dtype=dtype, param_dtype=jnp.float32,
                      kernel_init=nnx.initializers.normal(initializer_range),
                      dot_general=backend.token_matmul,
                      kernel_metadata=declare(*axes), bias_metadata=declare(None), rngs=rngs)
