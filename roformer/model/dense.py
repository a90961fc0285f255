"""The encoder's dense layers: HF-initialised nnx.Linear whose matmul sees [tokens, features].

nnx.Linear contracts the last axis of a [batch, length, in] input with a [in, out] kernel
in one dot_general. Its weight gradient then contracts over (batch, length), and XLA:CPU
compiles that by writing the activations out transposed in a loop fusion before the dot
(the "layout copy" kind of `python -m roformer.bench profile`). The same product on the
input flattened to [batch x length, in] is a plain matrix product whose gradient the dot
library takes as it is. Same parameters, same values; only the shapes the compiler sees.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from roformer.model.axes import declare


def token_matmul(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, *,
                 out_sharding=None):
    """jax.lax.dot_general for nnx.Linear, with lhs's leading axes merged into one."""
    (lhs_contract, rhs_contract), batch_dims = dimension_numbers
    plain = lhs.ndim <= 2 or out_sharding is not None or batch_dims != ((), ()) \
        or tuple(lhs_contract) != (lhs.ndim - 1,) or tuple(rhs_contract) != (0,) or rhs.ndim != 2
    if plain:
        return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type,
                                   out_sharding=out_sharding)
    out = jax.lax.dot_general(lhs.reshape(-1, lhs.shape[-1]), rhs, (((1,), (0,)), ((), ())),
                              precision, preferred_element_type)
    return out.reshape(*lhs.shape[:-1], rhs.shape[-1])


def dense(in_features: int, out_features: int, axes: tuple[str | None, str | None], *, dtype,
          initializer_range: float, rngs: nnx.Rngs) -> nnx.Linear:
    """HF-initialised Linear (normal(initializer_range) kernel, zero bias) whose kernel [in, out]
    has logical `axes`; the bias stays replicated. Parameters are float32, compute in `dtype`."""
    return nnx.Linear(in_features, out_features, dtype=dtype, param_dtype=jnp.float32,
                      kernel_init=nnx.initializers.normal(initializer_range), dot_general=token_matmul,
                      kernel_metadata=declare(*axes), bias_metadata=declare(None), rngs=rngs)
