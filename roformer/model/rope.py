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

`complex_product` is the definition. What a train step runs is the same product in the
form roformer.model.backend gives for it (a select interleave and a jvp rule written for
the backward pass, both for XLA:CPU), and the cis table as that module shares it.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from roformer.errors import ConfigError
from roformer.model import backend

ROPE_LAYOUTS = ("interleaved", "half")
ROPE_SCALINGS = ("none", "linear", "ntk", "yarn")


def complex_product(x: jax.Array, cis: jax.Array, layout: str) -> jax.Array:
    """Eq. 34: x [..., H, R] float32 viewed as R/2 complex numbers, times cis [..., R/2]
    (the same rotation for every head).

    layout "interleaved" makes features (2j, 2j+1) the real and imaginary parts of the j-th
    number (paper, HF); "half" makes them (j, j + R/2)."""
    half = cis.shape[-1]
    if layout == "half":
        z = jax.lax.complex(x[..., :half], x[..., half:]) * cis[..., None, :]
        return jnp.concatenate([z.real, z.imag], axis=-1)
    pairs = x.reshape(*x.shape[:-1], half, 2)
    z = jax.lax.complex(pairs[..., 0], pairs[..., 1]) * cis[..., None, :]
    return jnp.stack([z.real, z.imag], axis=-1).reshape(x.shape)


# complex_product in the form the backend compiles well: same values (roformer.model.backend).
_rotate = backend.rope_rotation(complex_product)


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
        raise ConfigError(f"rotary_dim must be a positive even number, got {rotary_dim}")
    if scaling not in ROPE_SCALINGS:
        raise ConfigError(f"unknown rope_scaling {scaling!r}; choose one of {ROPE_SCALINGS}")
    if scaling != "none" and factor < 1.0:
        raise ConfigError(f"rope_scaling_factor must be >= 1 for scaling {scaling!r}, got {factor}")
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

    return backend.shared_table(table, positions)


def apply_rope(x: jax.Array, cis: jax.Array, layout: str = "interleaved") -> jax.Array:
    """Rotate the first 2 * cis.shape[-1] features of x [B, L, H, D] by cis [B, L, R/2].

    layout "interleaved" pairs features (2j, 2j+1) (paper, HF); "half" pairs (j, j + R/2).
    Features past the rotary dimension pass through unchanged (partial rotary). The product
    runs in float32 whatever x's dtype, and the result is cast back to it.
    """
    if layout not in ROPE_LAYOUTS:
        raise ConfigError(f"unknown rope_layout {layout!r}; choose one of {ROPE_LAYOUTS}")
    rotary_dim = 2 * cis.shape[-1]
    if rotary_dim > x.shape[-1]:
        raise ValueError(f"rotary dim {rotary_dim} exceeds head dim {x.shape[-1]}")
    out = _rotate(x[..., :rotary_dim].astype(jnp.float32), cis, layout, x.dtype).astype(x.dtype)
    if rotary_dim == x.shape[-1]:
        return out
    return jnp.concatenate([out, x[..., rotary_dim:]], axis=-1)


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


def interleaved_to_half_heads(w: jax.Array, num_heads: int, rotary_dim: int) -> jax.Array:
    """`interleaved_to_half` inside each head of w's last axis [..., num_heads * head_dim]:
    what a q or k projection's kernel [in, H * D] or bias [H * D] becomes so that its output
    holds each head's interleaved pairs as split halves (roformer.model.backend,
    rope_half_pairs). Written as a reshape and a transpose of the pair axis (no gather), which
    XLA folds into the kernel's cast to the compute dtype."""
    lead = w.shape[:-1]
    heads = w.reshape(*lead, num_heads, w.shape[-1] // num_heads)
    pairs = heads[..., :rotary_dim].reshape(*lead, num_heads, rotary_dim // 2, 2)
    halves = jnp.swapaxes(pairs, -1, -2).reshape(*lead, num_heads, rotary_dim)
    if rotary_dim < heads.shape[-1]:
        halves = jnp.concatenate([halves, heads[..., rotary_dim:]], axis=-1)
    return halves.reshape(w.shape)
