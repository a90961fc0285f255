"""Position schemes behind one interface, chosen by name (`ModelConfig.position`).

A scheme may (a) add to the input embeddings (`embed`), (b) transform q/k(/v)
(`rotate`), (c) add an attention-logit bias (`logit_bias`), or (d) add relative
terms to keys and values (`relative_tables`, Shaw).  Anything that depends only on
the positions is computed once per forward pass in `prepare` and shared by every
layer (the RoPE cis table, the T5 / ALiBi bias, Shaw's relative index).

Adding a scheme = one class here + one entry in POSITION_SCHEMES (+ a config file
and tests).  A scheme validates its own settings (`validate`) and states what it can
do (`rope_scaling`, `max_length`), so the model, length extrapolation,
benchmarks and the ablation ask the scheme instead of comparing names.  Schemes read
their settings duck-typed from the ModelConfig.  Each parameter a scheme creates
declares its logical axes (roformer.model.axes); training refuses to shard one that does not.
"""
from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from roformer.errors import ConfigError
from roformer.model import rope
from roformer.model.axes import EMBEDDING, KV, LAYERS, NUM_HEADS, declare

PositionContext = Any  # whatever a scheme's `prepare` returns; opaque to the model


class PositionScheme(nnx.Module):
    """Base class: no positional information at all (the `none` control)."""

    # The scheme adds terms to keys and values (needs its own softmax attention path).
    relative_kv: bool = False
    # The scheme adds a logit bias.  Neither this nor relative_kv can be expressed by linear
    # attention, which never forms the L x L scores; rotary schemes can (RoFormer eq. 19).
    has_bias: bool = False
    # The scheme is rotary under ModelConfig's rope_* settings: length extension by
    # rope_scaling / rope_base applies, and its q/k features rotate in rope_layout pairs.
    rope_scaling: bool = False
    # Factor on the word embeddings before the position embeddings are added (1: none).
    token_scale: float = 1.0

    def __init__(self, config, *, rngs: nnx.Rngs):
        del config, rngs

    @classmethod
    def validate(cls, config) -> None:
        """Raise ConfigError naming the setting when `config` is not valid for this scheme."""
        del config

    @classmethod
    def max_length(cls, config) -> int | None:
        """The longest sequence the scheme can encode under `config` (None: no limit)."""
        del config
        return None

    def embed(self, positions: jax.Array, dtype) -> jax.Array | None:
        """Absolute embeddings [B, L, embedding_size] to add to the token embeddings."""
        del positions, dtype
        return None

    def prepare(self, positions: jax.Array) -> PositionContext:
        """Position-only data shared by every layer of one forward pass."""
        del positions
        return None

    def interleaved_qk_pairs(self) -> int | None:
        """The rotary dimension R when the scheme rotates q and k only, in interleaved pairs:
        their projections may then be permuted to hand the pairs over as split halves
        (`rotate(..., layout="half")`; roformer.model.backend, rope_half_pairs). None
        otherwise."""
        return None

    def rotate(self, q, k, v, context: PositionContext):
        """Transform q, k, v [B, L, H, D]; identity unless the scheme is rotary."""
        del context
        return q, k, v

    def logit_bias(self, context: PositionContext) -> jax.Array | None:
        """Additive attention-logit bias broadcastable to [B, H, L, L] (float32)."""
        del context
        return None

    def relative_tables(self, layer: int) -> tuple[jax.Array, jax.Array] | None:
        """Relative key and value tables [num_relative, head_dim] of `layer` (relative_kv schemes)."""
        del layer
        return None

    def signal(self) -> dict[str, jax.Array]:
        """How strong the scheme's position term is now, as named float32 scalars (jittable,
        read at every evaluation so a report can follow it over training): the sizes of its
        parameters, or its constants. Empty for schemes with neither (`none`, rope)."""
        return {}


def _rms(x: jax.Array) -> jax.Array:
    return jnp.sqrt(jnp.mean(jnp.square(x.astype(jnp.float32))))


class NoPositions(PositionScheme):
    """`none`: a control with no position information (permutation-equivariant)."""


class LearnedAbsolute(PositionScheme):
    """`learned`: BERT's trainable absolute position table added to the embeddings."""


    @classmethod
    def max_length(cls, config) -> int:
        return config.max_position_embeddings

    def __init__(self, config, *, rngs: nnx.Rngs):
        self.max_positions = config.max_position_embeddings
        self.position_embeddings = nnx.Embed(
            config.max_position_embeddings, config.embedding_size or config.hidden_size,
            embedding_init=nnx.initializers.normal(config.initializer_range),
            embedding_metadata=declare(None, EMBEDDING), rngs=rngs)

    def embed(self, positions, dtype):
        if positions.shape[-1] > self.max_positions:
            raise ConfigError(
                f"sequence length {positions.shape[-1]} is longer than the learned position table "
                f"(max_position_embeddings={self.max_positions})")
        return self.position_embeddings(positions).astype(dtype)

    def signal(self):
        # The mean row adds the same vector at every position (a bias, no order): the
        # centred RMS is the part that tells positions apart.
        table = self.position_embeddings.embedding[...]
        return {"table_rms": _rms(table), "table_rms_centred": _rms(table - table.mean(axis=0))}


class SinusoidalAbsolute(PositionScheme):
    """`sinusoidal`: Vaswani et al.'s fixed sin/cos table (sin at 2i, cos at 2i+1), in the form
    `sinusoidal_scaling` names. The position-to-token ratio below is the RMS of the table over
    the RMS of what it is added to (word embeddings times `token_scale`, plus type embeddings,
    both of std sigma = `initializer_range`) at initialisation (roformer.model.position_signal):
    a table row has RMS 1/sqrt(2) per feature before any scale.

      scaled    the table times 1/sqrt(d), fixed: the value Cramming's scalar starts at, held
                there (the default). Ratio 1/(2 sigma sqrt(d)): 2.21 at d=128, sigma=0.02. This
                is neither published form: Vaswani et al.'s tokens (embeddings of std d^-1/2
                times sqrt(d), RMS 1) give a ratio of 1/sqrt(2) = 0.71, which this form matches
                only where sigma = 1/(sqrt(2) sqrt(d)), and Cramming's scalar is learned
      cramming  the table times a learnable scalar initialised at 1/sqrt(d), as Cramming's
                `ScaledSinosoidal` (Geiping & Goldstein 2022, arXiv 2212.14034; their
                cramming/architectures/embeddings.py, after FLASH). The same ratio as `scaled`
                at initialisation; it then moves with the scalar, which `signal()` reports at
                every evaluation. No weight decay reaches it (a 0-d parameter, like the norms'
                scales). Adam moves a scalar by about the learning rate per step whatever its
                size, so the scalar can reach 0 within a few hundred steps and the scheme
                become `none`: whether it does is a result of the regime to report, read from
                the `scale` signal
      vaswani   token embeddings multiplied by sqrt(d), the table as it is (Vaswani et al. 2017,
                section 3.4). Ratio 1/(sqrt(2) sigma sqrt(d + 1)): 3.1 at d=128, sigma=0.02;
                Vaswani's 0.71 needs their token initialisation (std d^-1/2)
      unscaled  the table as it is, added to token embeddings of std `initializer_range`: ratio
                1/(2 sigma), 25 at sigma=0.02, so after the embedding LayerNorm the tokens are a
                few percent of the signal. Kept only as a named variant.
    """

    SCALINGS = ("scaled", "cramming", "vaswani", "unscaled")

    @classmethod
    def validate(cls, config) -> None:
        size = config.embedding_size or config.hidden_size
        if size % 2:
            raise ConfigError(f"sinusoidal positions need an even embedding size, got {size}")
        if config.sinusoidal_scaling not in cls.SCALINGS:
            raise ConfigError(f"unknown sinusoidal_scaling {config.sinusoidal_scaling!r}; "
                             f"choose one of {list(cls.SCALINGS)}")

    def __init__(self, config, *, rngs: nnx.Rngs):
        size = config.embedding_size or config.hidden_size
        self.scaling = config.sinusoidal_scaling
        # Host float64 constants kept as a tuple so NNX treats them as static, not state.
        self.inv_freq = tuple(rope.rope_frequencies(size, 10000.0)[0].tolist())
        if self.scaling == "cramming":
            # Cramming's name for it; a parameter, so the optimizer moves it.
            self.scale_factor = nnx.Param(jnp.asarray(size ** -0.5, jnp.float32), **declare())
        else:
            # A host constant: the fixed forms learn nothing.
            self.scale = size ** -0.5 if self.scaling == "scaled" else 1.0
        if self.scaling == "vaswani":
            self.token_scale = math.sqrt(size)

    def _scale(self):
        return self.scale_factor[...] if self.scaling == "cramming" else self.scale

    def embed(self, positions, dtype):
        angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(self.inv_freq, jnp.float32)
        table = jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1).reshape(*positions.shape, -1)
        return (table * self._scale()).astype(dtype)

    def signal(self):
        return {"scale": jnp.asarray(self._scale(), jnp.float32)}


class Rotary(PositionScheme):
    """`rope`: RoFormer's rotary embedding of q and k (and v with rotary_value)."""

    rope_scaling = True

    @classmethod
    def validate(cls, config) -> None:
        head_dim = config.hidden_size // config.num_heads
        if config.rotary_dim is not None and not 0 < config.rotary_dim <= head_dim:
            raise ConfigError(f"rotary_dim {config.rotary_dim} must be in (0, head_dim={head_dim}]")
        if (config.rotary_dim or head_dim) % 2:
            raise ConfigError(f"rotary dim must be even (features rotate in pairs), "
                             f"got {config.rotary_dim or head_dim}")
        if config.rope_base <= 1:
            raise ConfigError(f"rope_base must be > 1, got {config.rope_base}")

    def __init__(self, config, *, rngs: nnx.Rngs):
        rotary_dim = config.rotary_dim or config.hidden_size // config.num_heads
        self.rotary_dim = rotary_dim
        self.layout = config.rope_layout
        self.rotary_value = config.rotary_value
        inv_freq, magnitude = rope.rope_frequencies(
            rotary_dim, config.rope_base, scaling=config.rope_scaling,
            factor=config.rope_scaling_factor, original_max_len=config.rope_original_max_len)
        # YaRN's magnitude is a softmax temperature: on q and k it scales the logits. Linear
        # attention has no softmax (the rotated features' product would scale the output
        # instead), so there it keeps the frequencies only; v (rotary_value) is rotated
        # without it (`rotate`).
        self.magnitude = magnitude if config.attention == "softmax" else 1.0
        self.inv_freq = tuple(inv_freq.tolist())  # static host constants, not NNX state

    def prepare(self, positions):
        return rope.rope_cis(positions, self.inv_freq, self.magnitude)

    def interleaved_qk_pairs(self):
        if self.layout == "interleaved" and not self.rotary_value:
            return self.rotary_dim
        return None

    def rotate(self, q, k, v, cis, layout: str | None = None):
        """q, k (and v with rotary_value) rotated; `layout` the pairs' layout in them when it
        is not the configured one (interleaved_qk_pairs)."""
        layout = layout or self.layout
        q = rope.apply_rope(q, cis, layout)
        k = rope.apply_rope(k, cis, layout)
        if self.rotary_value:   # rotated, not scaled: the magnitude belongs to the logits
            v = rope.apply_rope(v, cis if self.magnitude == 1.0 else cis / self.magnitude, layout)
        return q, k, v


def relative_distances(positions: jax.Array) -> jax.Array:
    """[B, L, L] key position minus query position (memory - context, as in T5)."""
    return positions[:, None, :] - positions[:, :, None]


def t5_relative_bucket(relative_position: jax.Array, num_buckets: int = 32,
                       max_distance: int = 128) -> jax.Array:
    """Bidirectional T5 bucket of `relative_position` (key - query), as HF T5's
    `_relative_position_bucket(bidirectional=True)`: half the buckets per direction,
    exact buckets for |d| < num_buckets / 4, log-spaced buckets up to max_distance."""
    num_buckets //= 2
    bucket = jnp.where(relative_position > 0, num_buckets, 0)
    distance = jnp.abs(relative_position)
    max_exact = num_buckets // 2
    # Clamp to 1 so log(0) is never formed (those entries take the exact branch anyway).
    log_ratio = jnp.log(jnp.maximum(distance, 1).astype(jnp.float32) / max_exact)
    large = max_exact + (log_ratio / math.log(max_distance / max_exact)
                         * (num_buckets - max_exact)).astype(jnp.int32)
    large = jnp.minimum(large, num_buckets - 1)
    return bucket + jnp.where(distance < max_exact, distance, large)


class T5Bias(PositionScheme):
    """`t5`: bucketed relative bias (Raffel et al.), one [buckets, heads] table shared by all layers."""

    has_bias = True

    @classmethod
    def validate(cls, config) -> None:
        # Half the buckets per direction, half of those exact: at least one exact bucket, and
        # the log-spaced ones must start below max_distance.
        if config.t5_num_buckets < 4:
            raise ConfigError(f"t5_num_buckets must be >= 4, got {config.t5_num_buckets}")
        if config.t5_max_distance <= config.t5_num_buckets // 4:
            raise ConfigError(f"t5_max_distance must exceed t5_num_buckets // 4 = {config.t5_num_buckets // 4}, "
                             f"got {config.t5_max_distance}")

    def __init__(self, config, *, rngs: nnx.Rngs):
        self.num_buckets = config.t5_num_buckets
        self.max_distance = config.t5_max_distance
        # T5X's initialiser (t5x examples/t5/network.py, RelativePositionBiases): variance
        # scaling 1.0, fan_avg, uniform, i.e. std sqrt(2 / (buckets + heads)): 0.24 for 32
        # buckets and 4 heads, against initializer_range (0.02) for the other tables.
        self.relative_attention_bias = nnx.Embed(
            config.t5_num_buckets, config.num_heads,
            embedding_init=nnx.initializers.variance_scaling(1.0, "fan_avg", "uniform"),
            embedding_metadata=declare(None, NUM_HEADS), rngs=rngs)

    def prepare(self, positions):
        buckets = t5_relative_bucket(relative_distances(positions), self.num_buckets, self.max_distance)
        return jnp.moveaxis(self.relative_attention_bias(buckets), -1, 1)  # [B, H, L, L]

    def logit_bias(self, bias):
        return bias

    def signal(self):
        # bias_range: per head, the largest minus the smallest bias over the buckets (how
        # much the bias can move attention between distances), averaged over heads.
        table = self.relative_attention_bias.embedding[...]
        return {"bias_rms": _rms(table), "bias_range": jnp.mean(table.max(axis=0) - table.min(axis=0))}


def alibi_slopes(num_heads: int) -> np.ndarray:
    """ALiBi head slopes (Press et al. 2022, reference `get_slopes`): the geometric sequence
    2^(-8/n), 2^(-16/n), ... for a power-of-two n; otherwise those of the closest lower
    power of two followed by every other slope of twice that many heads."""
    def power_of_two_slopes(n):
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    if num_heads & (num_heads - 1) == 0:
        return np.asarray(power_of_two_slopes(num_heads), dtype=np.float64)
    closest = 2 ** math.floor(math.log2(num_heads))
    extra = power_of_two_slopes(2 * closest)[0::2][: num_heads - closest]
    return np.asarray(power_of_two_slopes(closest) + extra, dtype=np.float64)


class ALiBi(PositionScheme):
    """`alibi`: symmetric encoder form, bias -slope_h * |i - j| (no parameters)."""

    has_bias = True

    def __init__(self, config, *, rngs: nnx.Rngs):
        self.slopes = tuple(alibi_slopes(config.num_heads).tolist())  # static, not NNX state

    def prepare(self, positions):
        distance = jnp.abs(relative_distances(positions)).astype(jnp.float32)
        return -jnp.asarray(self.slopes, jnp.float32)[None, :, None, None] * distance[:, None]

    def logit_bias(self, bias):
        return bias

    def signal(self):
        return {"slope_max": jnp.asarray(max(self.slopes), jnp.float32),
                "slope_min": jnp.asarray(min(self.slopes), jnp.float32)}


class ShawRelative(PositionScheme):
    """`shaw`: Shaw et al. 2018 clipped relative key and value embeddings.

    Each layer has its own [2k+1, head_dim] key and value tables, shared across heads.
    `prepare` returns the clipped relative index [B, L, L] in [0, 2k]; attention uses
    `relative_tables(layer)` (see attention.explicit_softmax_attention, which never builds an
    [L, L, head_dim] tensor).
    """

    relative_kv = True

    @classmethod
    def validate(cls, config) -> None:
        if config.shaw_max_distance < 1:
            raise ConfigError(f"shaw_max_distance must be >= 1, got {config.shaw_max_distance}")

    def __init__(self, config, *, rngs: nnx.Rngs):
        self.max_distance = config.shaw_max_distance
        head_dim = config.hidden_size // config.num_heads
        shape = (config.num_layers, 2 * self.max_distance + 1, head_dim)
        init = nnx.initializers.normal(config.initializer_range)
        axes = declare(LAYERS, None, KV)  # per layer, per clipped distance (replicated), per feature
        self.relative_key = nnx.Param(init(rngs.params(), shape, jnp.float32), **axes)
        self.relative_value = nnx.Param(init(rngs.params(), shape, jnp.float32), **axes)

    def prepare(self, positions):
        k = self.max_distance
        return jnp.clip(relative_distances(positions), -k, k) + k

    def relative_tables(self, layer: int) -> tuple[jax.Array, jax.Array]:
        return self.relative_key[layer], self.relative_value[layer]

    def signal(self):
        return {"key_rms": _rms(self.relative_key[...]), "value_rms": _rms(self.relative_value[...])}


POSITION_SCHEMES: dict[str, type[PositionScheme]] = {
    "learned": LearnedAbsolute,
    "sinusoidal": SinusoidalAbsolute,
    "none": NoPositions,
    "shaw": ShawRelative,
    "t5": T5Bias,
    "alibi": ALiBi,
    "rope": Rotary,
}


def make_position_scheme(config, *, rngs: nnx.Rngs) -> PositionScheme:
    """Instantiate the scheme named by `config.position`."""
    try:
        scheme_cls = POSITION_SCHEMES[config.position]
    except KeyError:
        raise ConfigError(f"unknown position scheme {config.position!r}; "
                         f"choose one of {sorted(POSITION_SCHEMES)}") from None
    return scheme_cls(config, rngs=rngs)
