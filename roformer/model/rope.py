"""Rotary position embedding (RoPE) as a complex multiplication.

RoFormer (arXiv 2104.09864, eq. 34) rotates each feature pair of q/k by the angle
m * theta_j.  Viewing the pair as one complex number x_j, the rotation is simply
x_j * exp(i * m * theta_j), so the whole transform is one complex64 product.

Numerics: the frequencies theta_j are computed in float64 on the host, angles are
formed in float32 (never bf16, which rounds position 257 to 256), and the input is
upcast to float32 for the product and cast back to its own dtype afterwards.

Everything here is a pure function of arrays and static Python settings, so it
jits, vmaps and is easy to test.  The usual flow is::

    inv_freq, scale = rope_frequencies(rotary_dim, base=10000.0)   # host, once
    cis = rope_cis(positions, inv_freq, scale)                      # once per forward
    q = apply_rope(q, cis, layout="interleaved")                    # every layer
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

ROPE_LAYOUTS = ("interleaved", "half")
ROPE_SCALINGS = ("none", "linear", "ntk", "yarn")

# YaRN's ramp boundaries, in rotations over the original context (Peng et al. 2023).
YARN_BETA_FAST = 32.0
YARN_BETA_SLOW = 1.0


def _yarn_correction_dim(num_rotations: float, dim: int, base: float, original_max_len: int) -> float:
    """Feature index whose wavelength makes `num_rotations` turns over the original context."""
    return (dim * math.log(original_max_len / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def rope_frequencies(
    rotary_dim: int,
    base: float = 10000.0,
    *,
    scaling: str = "none",
    factor: float = 1.0,
    original_max_len: int = 512,
) -> tuple[np.ndarray, float]:
    """Per-pair angular frequencies theta_j (float64, host) and the cis magnitude.

    theta_j = base ** (-2j / rotary_dim) for j < rotary_dim / 2.  Scalings for
    length extension by `factor`:
      linear: position interpolation (Chen et al. 2023), positions / factor, which is
              the same as theta_j / factor.
      ntk:    NTK-aware base scaling, base * factor ** (d / (d - 2)).
      yarn:   YaRN (Peng et al. 2023): interpolate low frequencies, keep high ones,
              linear ramp between, and scale attention by 0.1 ln(factor) + 1 (returned
              as the cis magnitude; q and k both carry it, so logits scale by its square).
    Returns (inv_freq [rotary_dim // 2] float64, magnitude).
    """
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
    if scaling not in ROPE_SCALINGS:
        raise ValueError(f"unknown rope_scaling {scaling!r}; choose one of {ROPE_SCALINGS}")
    if scaling != "none" and factor < 1.0:
        raise ValueError(f"rope_scaling_factor must be >= 1 for scaling {scaling!r}, got {factor}")
    exponents = np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim
    magnitude = 1.0
    if scaling == "ntk":
        base = base * factor ** (rotary_dim / (rotary_dim - 2))
    inv_freq = base ** -exponents
    if scaling == "linear":
        inv_freq = inv_freq / factor
    elif scaling == "yarn":
        low = max(math.floor(_yarn_correction_dim(YARN_BETA_FAST, rotary_dim, base, original_max_len)), 0)
        high = min(math.ceil(_yarn_correction_dim(YARN_BETA_SLOW, rotary_dim, base, original_max_len)),
                   rotary_dim - 1)
        if low == high:
            high += 0.001  # avoid a zero-width ramp
        ramp = np.clip((np.arange(rotary_dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
        keep = 1.0 - ramp  # 1 -> extrapolate (high frequency, unchanged), 0 -> interpolate
        inv_freq = inv_freq / factor * (1.0 - keep) + inv_freq * keep
        magnitude = 0.1 * math.log(factor) + 1.0 if factor > 1.0 else 1.0
    return inv_freq, magnitude


def rope_cis(positions: jax.Array, inv_freq: np.ndarray, magnitude: float = 1.0) -> jax.Array:
    """exp(i * m * theta_j) for every position m: complex64 [..., rotary_dim // 2].

    `positions` is an integer (or float, e.g. interpolated) array such as [batch, length].
    Computed once per forward pass and shared by every layer.
    """
    def table(positions):
        angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, dtype=jnp.float32)
        cos, sin = jnp.cos(angles), jnp.sin(angles)
        if magnitude != 1.0:
            cos, sin = cos * magnitude, sin * magnitude
        return jax.lax.complex(cos, sin)

    if jax.default_backend() != "cpu":
        return table(positions)
    # XLA:CPU fuses this small producer into every consumer, recomputing cos/sin for
    # every head in every layer's q and k rotation, forward and backward (about 2/3 of
    # RoPE's cost in a train step). A conditional is never fused across, so the table
    # stays one array computed once. Both branches are the same table: the predicate's
    # value is irrelevant, it only has to be traced. (Not used on GPU, where a
    # conditional syncs with the host, nor needed there.)
    return jax.lax.cond(jnp.sum(positions) >= 0, table, table, positions)


def apply_rope(x: jax.Array, cis: jax.Array, layout: str = "interleaved") -> jax.Array:
    """Rotate the first 2 * cis.shape[-1] features of x [B, L, H, D] by cis [B, L, R/2].

    layout "interleaved" pairs features (2j, 2j+1) (paper, HF); "half" pairs (j, j + R/2).
    Features past the rotary dimension pass through unchanged (partial rotary).
    """
    if layout not in ROPE_LAYOUTS:
        raise ValueError(f"unknown rope_layout {layout!r}; choose one of {ROPE_LAYOUTS}")
    half = cis.shape[-1]
    rotary_dim = 2 * half
    if rotary_dim > x.shape[-1]:
        raise ValueError(f"rotary dim {rotary_dim} exceeds head dim {x.shape[-1]}")
    # Interleaving (Re, Im) back by a select is the faster form on XLA:CPU for f32 input
    # (a stack on the size-2 pair axis becomes a per-element branch, ~1.6x slower);
    # with bf16 input fused in, the select loop is the slow one, so those keep the stack.
    interleave = "select" if x.dtype == jnp.float32 else "stack"
    out = _rotate(x[..., :rotary_dim].astype(jnp.float32), cis, layout, interleave).astype(x.dtype)
    if rotary_dim == x.shape[-1]:
        return out
    return jnp.concatenate([out, x[..., rotary_dim:]], axis=-1)


def _complex_product(x: jax.Array, cis: jax.Array, layout: str, interleave: str) -> jax.Array:
    """x [..., H, R] float32 viewed as R/2 complex numbers, times cis [..., R/2] (over heads)."""
    half = cis.shape[-1]
    if layout == "half":
        z = jax.lax.complex(x[..., :half], x[..., half:]) * cis[..., None, :]
        return jnp.concatenate([z.real, z.imag], axis=-1)
    pairs = x.reshape(*x.shape[:-1], half, 2)
    if interleave == "select":
        return rotate_pairs(pairs, cis).reshape(x.shape)
    z = jax.lax.complex(pairs[..., 0], pairs[..., 1]) * cis[..., None, :]
    return jnp.stack([z.real, z.imag], axis=-1).reshape(x.shape)


def rotate_pairs(pairs: jax.Array, cis: jax.Array) -> jax.Array:
    """pairs [..., H, R/2, 2] float32, each (Re, Im) one complex number, times cis [..., R/2]
    (shared over heads), returned as pairs. apply_rope's interleaved product for f32 input.

    On XLA:CPU this loop vectorises (about a copy's time) when its result stays [..., R/2, 2];
    flattened to [..., R] in the same fusion, as apply_rope returns it, the loop runs over
    features with the pair index recomputed per element and about doubles
    (docs/results/2026-11-25-rope-pairs-cpu.md)."""
    z = jax.lax.complex(pairs[..., 0], pairs[..., 1]) * cis[..., None, :]
    is_real_slot = jax.lax.broadcasted_iota(jnp.int32, pairs.shape, pairs.ndim - 1) == 0
    return jnp.where(is_real_slot, z.real[..., None], z.imag[..., None])


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3))
def _rotate(x: jax.Array, cis: jax.Array, layout: str, interleave: str) -> jax.Array:
    return _complex_product(x, cis, layout, interleave)


def _rotate_jvp(layout, interleave, primals, tangents):
    """The product is linear in x and in cis: its tangent is x_dot * cis + x * cis_dot.
    Reverse mode transposes this linear map, so jvp, grad and every higher order come from
    this one rule. A cis without tangent (cis from integer positions) adds no term."""
    x, cis = primals
    x_dot, cis_dot = tangents
    out = _complex_product(x, cis, layout, interleave)
    terms = []
    if type(x_dot) is not SymbolicZero:
        terms.append(_rotation_tangent(x_dot, cis, layout, interleave))
    if type(cis_dot) is not SymbolicZero:
        terms.append(_complex_product(x, cis_dot, layout, interleave))
    return out, functools.reduce(jnp.add, terms)


_rotate.defjvp(_rotate_jvp, symbolic_zeros=True)


def _rotation_tangent(x_dot: jax.Array, cis: jax.Array, layout: str, interleave: str) -> jax.Array:
    """x_dot * cis in real arithmetic, written for its transpose (the backward pass, a rotation
    by conj(cis)) rather than for itself: the pairs are taken apart by a split, whose
    transpose is a concatenate, or for f32 interleaved pairs swapped by a reverse of the
    pair axis, a branch-free loop on XLA:CPU. Transposing the complex product instead
    (its indexing and select) makes the backward pass 1.1-15x slower on CPU."""
    half = cis.shape[-1]
    cos, sin = jnp.real(cis)[..., None, :], jnp.imag(cis)[..., None, :]
    if layout == "half":
        re, im = jax.lax.split(x_dot, (half, half), axis=x_dot.ndim - 1)
        return jnp.concatenate([re * cos - im * sin, re * sin + im * cos], axis=-1)
    pairs = x_dot.reshape(*x_dot.shape[:-1], half, 2)
    cos, sin = cos[..., None], sin[..., None]
    if interleave == "select":  # f32 input
        swapped = pairs[..., ::-1] * jnp.concatenate([-sin, sin], axis=-1)
        return (pairs * cos + swapped).reshape(x_dot.shape)
    re, im = jax.lax.split(pairs, (1, 1), axis=pairs.ndim - 1)
    return jnp.concatenate([re * cos - im * sin, re * sin + im * cos], axis=-1).reshape(x_dot.shape)


def interleaved_to_half(x: jax.Array | np.ndarray, rotary_dim: int | None = None):
    """Permute the last axis from interleaved pairs (2j, 2j+1) to split halves (j, j + R/2).

    Used by converters and tests: apply_rope(x, layout="interleaved") permuted this way
    equals apply_rope(permuted x, layout="half").
    """
    rotary_dim = x.shape[-1] if rotary_dim is None else rotary_dim
    order = np.concatenate([np.arange(0, rotary_dim, 2), np.arange(1, rotary_dim, 2),
                            np.arange(rotary_dim, x.shape[-1])])
    return x[..., order]


def half_to_interleaved(x: jax.Array | np.ndarray, rotary_dim: int | None = None):
    """Inverse of `interleaved_to_half`."""
    rotary_dim = x.shape[-1] if rotary_dim is None else rotary_dim
    half = rotary_dim // 2
    order = np.concatenate([np.stack([np.arange(half), np.arange(half) + half], axis=-1).reshape(-1),
                            np.arange(rotary_dim, x.shape[-1])])
    return x[..., order]
