"""AdamW with warmup + decay, global-norm clipping and a no-decay mask (optax)."""
from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import optax

from roformer.errors import ConfigError


def make_schedule(*, learning_rate: float, warmup_steps: int, total_steps: int,
                  decay: str = "linear", end_factor: float = 0.0) -> optax.Schedule:
    """Linear warmup from 0 to `learning_rate`, then linear or cosine decay to
    `end_factor * learning_rate` at `total_steps`."""
    if decay not in ("linear", "cosine"):
        raise ConfigError(f"train.decay must be 'linear' or 'cosine', got {decay!r}")
    if total_steps <= 0:
        raise ConfigError(f"train.steps must be positive, got {total_steps}")
    warmup_steps = min(warmup_steps, total_steps)
    decay_steps = max(total_steps - warmup_steps, 1)
    end_value = learning_rate * end_factor
    warmup = optax.linear_schedule(0.0, learning_rate, max(warmup_steps, 1))
    if decay == "linear":
        main = optax.linear_schedule(learning_rate, end_value, decay_steps)
    else:
        main = optax.cosine_decay_schedule(learning_rate, decay_steps, alpha=end_factor)
    if warmup_steps == 0:
        return main
    return optax.join_schedules([warmup, main], boundaries=[warmup_steps])


def scale_by_phase(schedule: optax.Schedule, phases: Sequence[tuple[int, int, float, int]]) -> optax.Schedule:
    """`schedule` times a factor in each (start, end, scale, warmup) phase: over the
    optimizer steps start <= count < end it is `scale`, ramped linearly from 0 over the
    phase's first `warmup` steps (0: no ramp). Outside every phase the factor is 1."""
    def scaled(count):
        factor = jnp.ones((), jnp.float32)
        for start, end, scale, warmup in phases:
            ramp = jnp.clip((count - start) / warmup, 0.0, 1.0) if warmup else 1.0
            factor = jnp.where((count >= start) & (count < end), scale * ramp, factor)
        return schedule(count) * factor
    return scaled


def decay_mask(params):
    """True for parameters that get weight decay: matrices (kernels, embeddings);
    False for biases and LayerNorm scales, which are all 1-D (BERT convention)."""
    return jax.tree.map(lambda p: p.ndim > 1, params)


def make_optimizer(*, learning_rate: float, warmup_steps: int, total_steps: int, decay: str,
                   weight_decay: float, b1: float, b2: float, eps: float, clip_norm: float,
                   phases: Sequence[tuple[int, int, float, int]] = ()
                   ) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW on `make_schedule`'s learning rates (`scale_by_phase`d when `phases` are
    given), after global-norm clipping (none when clip_norm <= 0); returns (transform,
    schedule)."""
    schedule = make_schedule(learning_rate=learning_rate, warmup_steps=warmup_steps,
                             total_steps=total_steps, decay=decay)
    if phases:
        schedule = scale_by_phase(schedule, phases)
    transforms = []
    if clip_norm and clip_norm > 0:
        transforms.append(optax.clip_by_global_norm(clip_norm))
    transforms.append(optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=decay_mask))
    return optax.chain(*transforms), schedule
