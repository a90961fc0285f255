"""How strongly a position scheme speaks at initialisation, relative to the tokens.

A scheme whose position term swamps the token term (or vanishes beside it) starts from a
different place than the others, whatever its merits; the ablation report prints these
ratios so that such a start is visible. Two measures, on random token ids at one length:

  input   RMS of the position embeddings / RMS of the token (word, times the scheme's
          `token_scale`, + type) embeddings they are added to; absolute schemes only
  logits  RMS of the change the scheme makes to layer 0's attention logits / RMS of those
          logits without it (the same parameters, the position term left out): every scheme
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from roformer.model.encoder import ModelConfig, RoFormerForMaskedLM


def _rms(x) -> float:
    return float(jnp.sqrt(jnp.mean(jnp.square(x.astype(jnp.float32)))))


def _layer0_logits(model: RoFormerForMaskedLM, ids, positions, *, with_position: bool):
    """Layer 0's pre-softmax attention logits [B, H, L, L] (scaled, plus any bias)."""
    encoder = model.roformer
    scheme = encoder.position
    position_embeddings = scheme.embed(positions, jnp.float32) if with_position else None
    x = encoder.embeddings(ids, jnp.zeros_like(ids), position_embeddings, token_scale=scheme.token_scale)
    if encoder.embeddings_project is not None:
        x = encoder.embeddings_project(x)
    attention = encoder.encoder.layer[0].attention.self
    batch, length, _ = x.shape
    split = lambda t: t.reshape(batch, length, attention.num_heads, attention.head_dim)  # noqa: E731
    q, k, v = split(attention.query(x)), split(attention.key(x)), split(attention.value(x))
    context = scheme.prepare(positions)
    if with_position:
        q, k, v = scheme.rotate(q, k, v, context)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k)
    if with_position and scheme.relative_kv:
        key_table, _ = scheme.relative_tables(0)
        logits = logits + jnp.take_along_axis(
            jnp.einsum("bqhd,rd->bhqr", q, key_table), context[:, None], axis=-1)
    logits = logits * attention.head_dim ** -0.5
    bias = scheme.logit_bias(context) if with_position else None
    return logits if bias is None else logits + bias


def position_to_token_ratio(model: RoFormerForMaskedLM, ids, positions) -> float | None:
    """RMS of the position embeddings / RMS of the token embeddings (word times the scheme's
    `token_scale`, + type 0) they are added to, with `model`'s parameters as they are now (at
    initialisation or after training); None for a scheme that adds no embeddings."""
    scheme = model.roformer.position
    pos = scheme.embed(positions, jnp.float32)
    if pos is None:
        return None
    embeddings = model.roformer.embeddings
    tokens = embeddings.word_embeddings(ids) * scheme.token_scale + embeddings.token_type_embeddings(
        jnp.zeros_like(ids))
    return _rms(pos) / _rms(tokens)


def position_signal(config: ModelConfig, *, seed: int = 0, length: int = 128, batch: int = 8) -> dict:
    """{"input": ratio or None, "logits": ratio} for `config`'s scheme at initialisation
    (seed `seed`), on `batch` rows of `length` random token ids with positions 0..length-1."""
    model = RoFormerForMaskedLM(config, rngs=nnx.Rngs(seed))
    model.eval()
    rng = np.random.default_rng(seed)
    ids = jnp.asarray(rng.integers(1, config.vocab_size, size=(batch, length)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    input_ratio = position_to_token_ratio(model, ids, positions)
    with_position = _layer0_logits(model, ids, positions, with_position=True)
    without = _layer0_logits(model, ids, positions, with_position=False)
    logits_ratio = _rms(with_position - without) / _rms(without)
    return {"input": input_ratio, "logits": logits_ratio}


def position_signals(configs: dict[str, ModelConfig], **kwargs) -> dict[str, dict]:
    """position_signal for each named config, computed on the host CPU (small, one-off)."""
    with jax.default_device(jax.devices("cpu")[0]):
        return {name: position_signal(config, **kwargs) for name, config in configs.items()}
