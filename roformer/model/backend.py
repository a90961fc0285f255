"""The one seam between the model's math and what a backend's compiler needs.

The definitions live with the model: rope.py writes RoPE as the complex product of eq. 34,
attention.py writes softmax attention, dense.py and encoder.py the layers. Some of them
compile badly as written on one backend, XLA:CPU above all, so the model asks this module
for the form to run. Every form here computes the same values as its definition (the tests
compare them); only the shapes, layouts and gradient rules the compiler sees differ.

Which backend runs which form, and why (the numbers are on the dated pages in
docs/results/, which also say how they were measured):

  shared_table        XLA:CPU only. The RoPE cis table goes inside a `lax.cond`, which
                      XLA never fuses across, so it is one array computed once per forward
                      pass; otherwise XLA:CPU fuses the small cos/sin producer into every
                      consumer and recomputes it per head, in every layer, forward and
                      backward. Elsewhere the table is computed plainly: on GPU a
                      conditional syncs with the host, and there is no refusion to stop.
                      (2026-11-22-performance-cpu.md, item 3)
  rope_rotation       every backend. RoPE's product with its own jvp rule, whose x tangent
                      is written in real arithmetic for its transpose (the backward pass, a
                      rotation by conj(cis)); autodiff's transpose of the complex product
                      indexes and selects, which XLA:CPU runs slowly. For float32 input with
                      interleaved pairs, (Re, Im) go back into their pairs by a select
                      (`rotate_pairs`) rather than a stack, which XLA:CPU emits as a branch per
                      element; bf16 input keeps the stack, where the select is the slow one.
                      Other backends run the same form; they have not been measured without
                      it. (2026-11-22-performance-cpu.md, items 1-2;
                      2026-11-25-rope-pairs-cpu.md)
  explicit_attention  XLA:CPU, for attention_impl="auto": softmax attention written out with
                      head-major operands (attention.explicit_softmax_attention) instead of
                      jax.nn.dot_product_attention, whose choice on CPU is its XLA kernel;
                      XLA:CPU's dot library multiplies the [B x H] plain matrices faster than
                      the head-interleaved layout. Accelerators take jax's kernel.
                      (2026-11-25-attention-dots-cpu.md)
  token_matmul        every backend (the dense layers' dot_general). The input flattened to
                      [tokens, features], so the weight gradient is a plain matrix product
                      instead of one XLA:CPU prepares by writing the activations out
                      transposed. Elsewhere it is a free reshape, not measured without it.
                      (2026-11-25-dense-layout-cpu.md)
  tied_decoder        every backend. The MLM decoder with its backward written out, so the
                      bias gradient is a matrix-vector product instead of a reduction over
                      the [tokens, vocab] cotangent, which XLA:CPU runs slowly.
                      (2026-11-25-train-step-profile-cpu.md)

A new backend-specific form goes here, with a line in this table and a dated page; the
model code calls it by name and never branches on the backend itself.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero


def on_cpu() -> bool:
    return jax.default_backend() == "cpu"


# ---- RoPE -----------------------------------------------------------------------------

def shared_table(table: Callable[[jax.Array], jax.Array], positions: jax.Array) -> jax.Array:
    """table(positions), computed once per forward pass however many layers read it."""
    if not on_cpu():
        return table(positions)
    # Both branches are the same table: the predicate's value is irrelevant, it only has to
    # be traced, and the conditional keeps XLA:CPU from fusing the table into its consumers.
    return jax.lax.cond(jnp.sum(positions) >= 0, table, table, positions)


def rotate_pairs(pairs: jax.Array, cis: jax.Array) -> jax.Array:
    """pairs [..., H, R/2, 2] float32, each (Re, Im) one complex number, times cis [..., R/2]
    (shared over heads), returned as pairs: the interleaved product with (Re, Im) put back by
    a select on the pair slot.

    On XLA:CPU this loop vectorises when its result stays [..., R/2, 2]; flattened to
    [..., R] in the same fusion the loop runs over features with the pair index recomputed
    per element (docs/results/2026-11-25-rope-pairs-cpu.md)."""
    z = jax.lax.complex(pairs[..., 0], pairs[..., 1]) * cis[..., None, :]
    is_real_slot = jax.lax.broadcasted_iota(jnp.int32, pairs.shape, pairs.ndim - 1) == 0
    return jnp.where(is_real_slot, z.real[..., None], z.imag[..., None])


def rope_rotation(product: Callable[[jax.Array, jax.Array, str], jax.Array]):
    """The rotation apply_rope runs, built from `product(x, cis, layout)`, the definition
    (rope.complex_product: x [..., H, R] float32 as R/2 complex numbers times cis [..., R/2]).

    Returns `rotate(x, cis, layout, input_dtype)`: the same values as `product`, with the
    interleave and the jvp rule described in this module's docstring. `input_dtype` is the
    dtype x had before its upcast to float32, which decides the interleave."""

    def forward(x, cis, layout, interleave):
        if layout == "interleaved" and interleave == "select":
            half = cis.shape[-1]
            return rotate_pairs(x.reshape(*x.shape[:-1], half, 2), cis).reshape(x.shape)
        return product(x, cis, layout)

    @functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3))
    def rotate(x, cis, layout, interleave):
        return forward(x, cis, layout, interleave)

    def rotate_jvp(layout, interleave, primals, tangents):
        """The product is linear in x and in cis: its tangent is x_dot * cis + x * cis_dot.
        Reverse mode transposes this linear map, so jvp, grad and every higher order come
        from this one rule. A cis without tangent (cis from integer positions) adds no term."""
        x, cis = primals
        x_dot, cis_dot = tangents
        out = forward(x, cis, layout, interleave)
        terms = []
        if type(x_dot) is not SymbolicZero:
            terms.append(_rotation_tangent(x_dot, cis, layout, interleave))
        if type(cis_dot) is not SymbolicZero:
            terms.append(forward(x, cis_dot, layout, interleave))
        return out, functools.reduce(jnp.add, terms)

    rotate.defjvp(rotate_jvp, symbolic_zeros=True)

    def run(x, cis, layout, input_dtype):
        return rotate(x, cis, layout, "select" if input_dtype == jnp.float32 else "stack")

    return run


def _rotation_tangent(x_dot: jax.Array, cis: jax.Array, layout: str, interleave: str) -> jax.Array:
    """x_dot * cis in real arithmetic, written for its transpose (the backward pass, a
    rotation by conj(cis)) rather than for itself: the pairs are taken apart by a split,
    whose transpose is a concatenate, or for float32 interleaved pairs swapped by a reverse
    of the pair axis, a branch-free loop on XLA:CPU."""
    half = cis.shape[-1]
    cos, sin = jnp.real(cis)[..., None, :], jnp.imag(cis)[..., None, :]
    if layout == "half":
        re, im = jax.lax.split(x_dot, (half, half), axis=x_dot.ndim - 1)
        return jnp.concatenate([re * cos - im * sin, re * sin + im * cos], axis=-1)
    pairs = x_dot.reshape(*x_dot.shape[:-1], half, 2)
    cos, sin = cos[..., None], sin[..., None]
    if interleave == "select":  # float32 input
        swapped = pairs[..., ::-1] * jnp.concatenate([-sin, sin], axis=-1)
        return (pairs * cos + swapped).reshape(x_dot.shape)
    re, im = jax.lax.split(pairs, (1, 1), axis=pairs.ndim - 1)
    return jnp.concatenate([re * cos - im * sin, re * sin + im * cos], axis=-1).reshape(x_dot.shape)


# ---- Attention ------------------------------------------------------------------------

def explicit_attention(implementation: str) -> bool:
    """Whether softmax attention under `attention_impl=implementation` runs the written-out
    path (attention.explicit_softmax_attention) rather than jax.nn.dot_product_attention."""
    return implementation == "auto" and on_cpu()


# ---- Dense layers and the MLM decoder -------------------------------------------------

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


@jax.custom_vjp
def tied_decoder(x: jax.Array, table: jax.Array, bias: jax.Array) -> jax.Array:
    """float32 logits x @ table.T + bias: [..., E] x [V, E] -> [..., V].

    Its gradients are autodiff's, written out so that the bias gradient is a matrix-vector
    product (ones @ d_logits) rather than a reduction over the [N, V] cotangent. Reverse
    mode only (grad of grad works; jvp through the MLM head does not)."""
    return _tied_logits(x, table, bias)


def _tied_logits(x, table, bias):
    return jnp.einsum("...e,ve->...v", x, table, preferred_element_type=jnp.float32) + bias


def _tied_decoder_fwd(x, table, bias):
    return _tied_logits(x, table, bias), (x, table)


def _tied_decoder_bwd(residuals, d_logits):
    x, table = residuals
    rows = d_logits.reshape(-1, d_logits.shape[-1])
    d_x = jnp.einsum("...v,ve->...e", d_logits.astype(table.dtype), table, preferred_element_type=jnp.float32)
    d_table = jnp.einsum("nv,ne->ve", rows.astype(x.dtype), x.reshape(-1, x.shape[-1]),
                         preferred_element_type=jnp.float32)
    d_bias = jnp.ones(rows.shape[:1], rows.dtype) @ rows
    return d_x.astype(x.dtype), d_table.astype(table.dtype), d_bias


tied_decoder.defvjp(_tied_decoder_fwd, _tied_decoder_bwd)
