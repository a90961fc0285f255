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


# --------------------------------------------------------------------------- warmup-stable-decay


def cooldown_branches(budgets: Sequence[int], cooldown_fraction: float) -> list[tuple[int, int]]:
    """(decay_start, end) of each budget's cooldown under warmup-stable-decay (Hu et al. 2024,
    MiniCPM; Hägele et al. 2024, arXiv 2405.18392): one run at a constant rate whose state, at
    `decay_start`, is copied and decayed to 0 by `end`, so every budget gets the end-of-schedule
    loss of its own run from one trunk. The last budget's branch is the trunk's own end."""
    if not 0 < cooldown_fraction <= 1:
        raise ConfigError(f"cooldown fraction must be in (0, 1], got {cooldown_fraction}")
    ends = sorted(int(b) for b in budgets)
    if not ends or ends[0] <= 0 or len(set(ends)) != len(ends):
        raise ConfigError(f"cooldown budgets must be distinct positive step counts, got {list(budgets)}")
    return [(end - max(1, round(cooldown_fraction * end)), end) for end in ends]


def wsd_factor(step, *, warmup_steps: int, decay_start, decay_end):
    """The learning-rate factor of warmup-stable-decay at `step` (traced or not): linear from
    0 to 1 over `warmup_steps`, 1 until `decay_start`, then linear to 0 at `decay_end`."""
    step = jnp.asarray(step, jnp.float32)
    warm = jnp.clip((step + 1) / max(warmup_steps, 1), 0.0, 1.0)
    decay = jnp.clip((decay_end - step) / jnp.maximum(decay_end - decay_start, 1), 0.0, 1.0)
    return jnp.minimum(warm, decay)


def make_member_optimizer(*, weight_decay: float, b1: float, b2: float, eps: float,
                          clip_norm: float) -> optax.GradientTransformation:
    """`make_optimizer`'s AdamW (clipping, no-decay mask) with its learning rate a value in the
    optimizer state (`optax.inject_hyperparams`), set every step by `with_learning_rate`: so
    vmapped members may each train at their own rate and schedule in one program."""
    def adamw(learning_rate):
        transforms = [optax.clip_by_global_norm(clip_norm)] if clip_norm and clip_norm > 0 else []
        transforms.append(optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay,
                                      mask=decay_mask))
        return optax.chain(*transforms)
    return optax.inject_hyperparams(adamw)(learning_rate=0.0)


def with_learning_rate(opt_state, learning_rate):
    """`opt_state` of `make_member_optimizer` with the rate of its next update set."""
    hyperparams = {**opt_state.hyperparams, "learning_rate": jnp.asarray(learning_rate, jnp.float32)}
    return opt_state._replace(hyperparams=hyperparams)
