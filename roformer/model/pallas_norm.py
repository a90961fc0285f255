"""Bias + dropout + residual add + LayerNorm as one Pallas kernel each way (the post-LN
block's tail, after its dense layer's product).

`residual_layer_norm(x, y, y_bias, keep, scale, bias)` is LayerNorm(x + dropout(y + y_bias))
over the last axis, with the values of the model's plain form (roformer.model.dense.Dense's
bias, nnx.Dropout, then nnx.LayerNorm with its float32 statistics and fast variance): the
biased product, the dropped branch `/ keep_prob` and the sum are rounded to the compute dtype
where the plain form rounds them; the statistics and the normalisation run in float32.

Forward, one kernel reads x, y and the keep mask and writes the output (and, under autodiff,
the rounded sum with each row's mean and 1/std for the backward). Backward, one kernel reads
the output's gradient, the sum and the mask and writes the gradients of x and of y, with
each program's partial sums of the gradients of y_bias, scale and bias ([programs, H] arrays
that XLA then sums over programs: a pass over a few rows per program, not over every token,
so y_bias's gradient needs no reduction of its own over y's gradient).

Written for the GPU's Triton lowering: each program takes a block of whole rows; the hidden
size is padded to a power of two inside the program (Triton's tensors must have one) by
masked loads and stores, so nothing is padded in memory. The refs are the whole arrays,
indexed by row and column, as jax's own Pallas layer norm (jax.experimental.pallas.ops.gpu)
indexes them. `interpret=True` runs the same kernels on any backend (the CPU tests).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# Elements of [rows, padded hidden] one program holds per array: a forward block, and a
# backward chunk (a backward program walks BACKWARD_ROWS rows chunk by chunk, carrying its
# partial gradients of y_bias, scale and bias).
FORWARD_ELEMENTS = 4096
BACKWARD_ELEMENTS = 4096
BACKWARD_ROWS = 32


def _power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _warps(elements: int) -> int:
    return min(max(elements // 256, 1), 8)


def _tile(rows, features: int, width: int, n_rows: int):
    """Indices and mask of a [len(rows), width] tile of an [n_rows, features] array."""
    cols = jnp.arange(width)
    mask = (rows < n_rows)[:, None] & (cols < features)[None, :]
    return (rows[:, None], cols[None, :]), mask


def _row_vector(ref, width: int, features: int) -> jax.Array:
    """A [features] parameter as float32 [width], zeros past its end."""
    cols = jnp.arange(width)
    return plgpu.load(ref.at[cols], mask=cols < features, other=0.0).astype(jnp.float32)


def _forward_kernel(*refs, features, width, block_rows, n_rows, keep_prob, epsilon, has_keep, save):
    refs = list(refs)
    x_ref, y_ref, y_bias_ref = refs.pop(0), refs.pop(0), refs.pop(0)
    keep_ref = refs.pop(0) if has_keep else None
    scale_ref, bias_ref, out_ref = refs.pop(0), refs.pop(0), refs.pop(0)
    rows = pl.program_id(0) * block_rows + jnp.arange(block_rows)
    at, mask = _tile(rows, features, width, n_rows)
    dtype = out_ref.dtype
    # Dense's bias: float32, cast to the compute dtype, added in it.
    y_bias = _row_vector(y_bias_ref, width, features).astype(dtype).astype(jnp.float32)
    y = plgpu.load(y_ref.at[at], mask=mask, other=0.0)
    y = (y.astype(jnp.float32) + y_bias[None, :]).astype(dtype)
    if has_keep:
        keep = plgpu.load(keep_ref.at[at], mask=mask, other=0) != 0
        y = jnp.where(keep, (y.astype(jnp.float32) / keep_prob).astype(dtype), jnp.zeros_like(y))
    x = plgpu.load(x_ref.at[at], mask=mask, other=0.0)
    total = (x.astype(jnp.float32) + y.astype(jnp.float32)).astype(dtype)   # x + dropout(y + y_bias)
    s = total.astype(jnp.float32)
    mean = jnp.sum(s, axis=1) / features
    var = jnp.maximum(jnp.sum(s * s, axis=1) / features - mean * mean, 0.0)
    rstd = jax.lax.rsqrt(var + epsilon)
    scale, bias = _row_vector(scale_ref, width, features), _row_vector(bias_ref, width, features)
    out = (s - mean[:, None]) * (rstd[:, None] * scale[None, :]) + bias[None, :]
    plgpu.store(out_ref.at[at], out.astype(dtype), mask=mask)
    if save:
        sum_ref, mean_ref, rstd_ref = refs
        plgpu.store(sum_ref.at[at], total, mask=mask)
        plgpu.store(mean_ref.at[rows], mean, mask=rows < n_rows)
        plgpu.store(rstd_ref.at[rows], rstd, mask=rows < n_rows)


def _backward_kernel(*refs, features, width, chunk_rows, chunks, n_rows, keep_prob, has_keep):
    refs = list(refs)
    d_out_ref, sum_ref = refs.pop(0), refs.pop(0)
    keep_ref = refs.pop(0) if has_keep else None
    scale_ref, mean_ref, rstd_ref, d_x_ref, d_y_ref, d_y_bias_ref, d_scale_ref, d_bias_ref = refs
    program = pl.program_id(0)
    cols = jnp.arange(width)
    scale = _row_vector(scale_ref, width, features)

    def chunk(index, sums):
        rows = (program * chunks + index) * chunk_rows + jnp.arange(chunk_rows)
        at, mask = _tile(rows, features, width, n_rows)
        d_out = plgpu.load(d_out_ref.at[at], mask=mask, other=0.0).astype(jnp.float32)
        s = plgpu.load(sum_ref.at[at], mask=mask, other=0.0).astype(jnp.float32)
        mean = plgpu.load(mean_ref.at[rows], mask=rows < n_rows, other=0.0)
        rstd = plgpu.load(rstd_ref.at[rows], mask=rows < n_rows, other=0.0)
        x_hat = jnp.where(mask, (s - mean[:, None]) * rstd[:, None], 0.0)
        g = d_out * scale[None, :]
        mean_g_x_hat = jnp.sum(g * x_hat, axis=1) / features
        mean_g = jnp.sum(g, axis=1) / features
        d_s = ((g - x_hat * mean_g_x_hat[:, None] - mean_g[:, None]) * rstd[:, None]).astype(d_x_ref.dtype)
        plgpu.store(d_x_ref.at[at], d_s, mask=mask)
        # Outside the tile keep is false (padded columns have a d_s, which their sum must not see).
        keep = plgpu.load(keep_ref.at[at], mask=mask, other=0) != 0 if has_keep else mask
        d_y = (d_s.astype(jnp.float32) / keep_prob).astype(d_y_ref.dtype) if has_keep else d_s
        d_y = jnp.where(keep, d_y, jnp.zeros_like(d_y))
        plgpu.store(d_y_ref.at[at], d_y, mask=mask)
        d_y_bias, d_scale, d_bias = sums
        return (d_y_bias + jnp.sum(d_y.astype(jnp.float32), axis=0), d_scale + jnp.sum(d_out * x_hat, axis=0),
                d_bias + jnp.sum(d_out, axis=0))

    zeros = jnp.zeros((width,), jnp.float32)
    sums = jax.lax.fori_loop(0, chunks, chunk, (zeros, zeros, zeros))
    for ref, value in zip((d_y_bias_ref, d_scale_ref, d_bias_ref), sums):
        plgpu.store(ref.at[program, cols], value, mask=cols < features)


def _forward(x, y, y_bias, keep, scale, bias, keep_prob, epsilon, interpret, save):
    n_rows, features = x.shape
    width = _power_of_two(features)
    block_rows = _power_of_two(max(1, FORWARD_ELEMENTS // width))
    row_shape = jax.ShapeDtypeStruct((n_rows,), jnp.float32)
    out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype)]
    if save:
        out_shape += [jax.ShapeDtypeStruct(x.shape, x.dtype), row_shape, row_shape]
    kernel = functools.partial(_forward_kernel, features=features, width=width, block_rows=block_rows,
                               n_rows=n_rows, keep_prob=keep_prob, epsilon=epsilon,
                               has_keep=keep is not None, save=save)
    call = pl.pallas_call(kernel, out_shape=out_shape, grid=(pl.cdiv(n_rows, block_rows),),
                          compiler_params=plgpu.CompilerParams(num_warps=_warps(block_rows * width)),
                          interpret=interpret, name="residual_layer_norm_fwd")
    return call(*[a for a in (x, y, y_bias, keep, scale, bias) if a is not None])


def _backward(d_out, total, keep, scale, mean, rstd, keep_prob, interpret):
    n_rows, features = d_out.shape
    width = _power_of_two(features)
    chunk_rows = _power_of_two(max(1, min(BACKWARD_ROWS, BACKWARD_ELEMENTS // width)))
    chunks = BACKWARD_ROWS // chunk_rows
    programs = pl.cdiv(n_rows, chunk_rows * chunks)
    partial = jax.ShapeDtypeStruct((programs, features), jnp.float32)
    kernel = functools.partial(_backward_kernel, features=features, width=width, chunk_rows=chunk_rows,
                               chunks=chunks, n_rows=n_rows, keep_prob=keep_prob, has_keep=keep is not None)
    call = pl.pallas_call(kernel, grid=(programs,),
                          out_shape=[jax.ShapeDtypeStruct(d_out.shape, total.dtype),
                                     jax.ShapeDtypeStruct(d_out.shape, total.dtype), partial, partial, partial],
                          compiler_params=plgpu.CompilerParams(num_warps=_warps(chunk_rows * width)),
                          interpret=interpret, name="residual_layer_norm_bwd")
    return call(*[a for a in (d_out, total, keep, scale, mean, rstd) if a is not None])


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _fused(x, y, y_bias, keep, scale, bias, keep_prob, epsilon, interpret):
    return _forward(x, y, y_bias, keep, scale, bias, keep_prob, epsilon, interpret, save=False)[0]


def _fused_fwd(x, y, y_bias, keep, scale, bias, keep_prob, epsilon, interpret):
    out, total, mean, rstd = _forward(x, y, y_bias, keep, scale, bias, keep_prob, epsilon, interpret, save=True)
    return out, (total, keep, scale, mean, rstd, jnp.zeros((0,), y_bias.dtype))


def _fused_bwd(keep_prob, epsilon, interpret, residuals, d_out):
    total, keep, scale, mean, rstd, y_bias_like = residuals
    d_x, d_y, d_y_bias, d_scale, d_bias = _backward(d_out, total, keep, scale, mean, rstd, keep_prob, interpret)
    return (d_x, d_y, jnp.sum(d_y_bias, axis=0).astype(y_bias_like.dtype), None,
            jnp.sum(d_scale, axis=0).astype(scale.dtype), jnp.sum(d_bias, axis=0).astype(scale.dtype))


_fused.defvjp(_fused_fwd, _fused_bwd)


def residual_layer_norm(x: jax.Array, y: jax.Array, y_bias: jax.Array, keep: jax.Array | None,
                        scale: jax.Array, bias: jax.Array, *, keep_prob: float, epsilon: float,
                        interpret: bool = False) -> jax.Array:
    """LayerNorm(x + where(keep, (y + y_bias) / keep_prob, 0)) over the last axis, in x's dtype.

    x, y [..., H] in the compute dtype (y a dense layer's product, y_bias [H] its bias, in
    float32 as Dense keeps it); keep [..., H] bool (None: no dropout); scale and bias [H] in
    one dtype (the LayerNorm's parameters in the compute dtype, as nnx.LayerNorm promotes
    them). Differentiable in x, y, y_bias, scale and bias (reverse mode)."""
    if scale.dtype != bias.dtype or y.dtype != x.dtype:
        raise ValueError(f"x and y ({x.dtype}, {y.dtype}) and scale and bias ({scale.dtype}, {bias.dtype}) "
                         "must each share a dtype")
    if keep is not None:
        keep = keep.reshape(-1, x.shape[-1]).astype(jnp.int8)
    else:
        keep_prob = 1.0
    out = _fused(x.reshape(-1, x.shape[-1]), y.reshape(-1, x.shape[-1]), y_bias, keep,
                 scale, bias, float(keep_prob), float(epsilon), bool(interpret))
    return out.reshape(x.shape)


def residual_layer_norm_reference(x, y, y_bias, keep, scale, bias, *, keep_prob: float,
                                  epsilon: float) -> jax.Array:
    """The plain jnp form of the same values (Dense's bias, nnx.Dropout, nnx.LayerNorm)."""
    y = y + jnp.broadcast_to(y_bias, y.shape).astype(y.dtype)
    if keep is not None:
        y = jnp.where(keep, y / keep_prob, jnp.zeros_like(y))
    s = (x + y).astype(jnp.float32)
    mean = jnp.mean(s, axis=-1, keepdims=True)
    var = jnp.maximum(jnp.mean(s * s, axis=-1, keepdims=True) - mean * mean, 0.0)
    out = (s - mean) * (jax.lax.rsqrt(var + epsilon) * scale) + bias
    return out.astype(x.dtype)
