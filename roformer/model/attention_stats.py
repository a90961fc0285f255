"""Where the attention looks and how alike the positions' hidden states are: two measures
that tell a model stuck on an MLM plateau from one that has formed its attention.

Gopalani & Hu 2025 ("What happens during the loss plateau? Understanding abrupt learning
in Transformers", arXiv 2506.13688) tie the plateau to attention that has not formed and
to hidden states that are nearly the same at every position ("representation collapse"):

  attention distance  per layer and head, the mean over real query tokens of
                      sum_j p_ij |pos_i - pos_j|: how far the head looks. Uniform
                      attention over a document of n tokens gives about n/3; a head that
                      has learned to look at its neighbours gives ~1.
  hidden cosine       per layer (0 = the embeddings, then after each layer), the mean
                      cosine similarity between the hidden states of two different real
                      tokens of one document: near 1 when every position carries the same
                      vector.

The training loop logs both at every evaluation (train.eval_attention_stats), on the first
held-out batch, as `eval_attention_distance_l{layer}h{head}` and `eval_hidden_cosine_l{layer}`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

DISTANCE_PREFIX = "eval_attention_distance_"
COSINE_PREFIX = "eval_hidden_cosine_"


def attention_stats(encoder, input_ids, *, token_type_ids=None, positions=None, attention_mask=None,
                    segment_ids=None) -> dict[str, jax.Array]:
    """{"attention_distance": [layers, heads], "hidden_cosine": [layers + 1]} (float32) of a
    RoFormerModel `encoder` (in eval mode) on one batch; softmax attention only."""
    input_ids = jnp.asarray(input_ids)
    batch, length = input_ids.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    x, inputs = encoder.embed_inputs(input_ids, token_type_ids=token_type_ids, positions=positions,
                                     attention_mask=attention_mask, segment_ids=segment_ids)
    real = jnp.ones((batch, length), bool) if inputs["key_mask"] is None else inputs["key_mask"]
    same_doc = real[:, :, None] & real[:, None, :]
    if segment_ids is not None:
        same_doc = same_doc & (segment_ids[:, :, None] == segment_ids[:, None, :])
    distance = jnp.abs(positions[:, :, None] - positions[:, None, :]).astype(jnp.float32)   # [B, Lq, Lk]
    query_weight = real.astype(jnp.float32)
    distances, cosines = [], [_mean_cosine(x, same_doc)]
    for index, layer in enumerate(encoder.encoder.layer):
        probs = layer.attention_probabilities(x, layer=index, **inputs)                # [B, H, Lq, Lk]
        per_query = jnp.einsum("bhqk,bqk->bhq", probs, distance)
        distances.append(jnp.einsum("bhq,bq->h", per_query, query_weight) / jnp.maximum(query_weight.sum(), 1.0))
        x = layer(x, layer=index, **inputs)
        cosines.append(_mean_cosine(x, same_doc))
    return {"attention_distance": jnp.stack(distances), "hidden_cosine": jnp.stack(cosines)}


def _mean_cosine(x, same_doc):
    """Mean cosine similarity of the hidden states of two different tokens of one document."""
    unit = x.astype(jnp.float32)
    unit = unit / jnp.maximum(jnp.linalg.norm(unit, axis=-1, keepdims=True), 1e-6)
    similarity = jnp.einsum("bqd,bkd->bqk", unit, unit)
    pairs = same_doc & ~jnp.eye(x.shape[1], dtype=bool)[None]
    return jnp.sum(jnp.where(pairs, similarity, 0.0)) / jnp.maximum(jnp.sum(pairs), 1)


def as_metrics(stats: dict) -> dict[str, float]:
    """The flat metric names the training loop logs."""
    row = {}
    for layer, heads in enumerate(stats["attention_distance"].tolist()):
        row.update({f"{DISTANCE_PREFIX}l{layer}h{head}": value for head, value in enumerate(heads)})
    row.update({f"{COSINE_PREFIX}l{layer}": value for layer, value in enumerate(stats["hidden_cosine"].tolist())})
    return row


def from_metrics(row: dict) -> dict | None:
    """The inverse of as_metrics on one metrics.jsonl row: {"attention_distance": [[...]],
    "hidden_cosine": [...]}, or None when the row has none."""
    cosine = sorted((int(k[len(COSINE_PREFIX) + 1:]), v) for k, v in row.items() if k.startswith(COSINE_PREFIX))
    if not cosine:
        return None
    grid: dict[int, dict[int, float]] = {}
    for key, value in row.items():
        if key.startswith(DISTANCE_PREFIX):
            layer, head = key[len(DISTANCE_PREFIX) + 1:].split("h")
            grid.setdefault(int(layer), {})[int(head)] = value
    return {"attention_distance": [[heads[h] for h in sorted(heads)] for _, heads in sorted(grid.items())],
            "hidden_cosine": [v for _, v in cosine]}
