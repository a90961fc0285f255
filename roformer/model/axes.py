"""Logical axis names that every parameter declares where it is created.

Each nnx.Param states what its dimensions are (flax's `out_sharding` variable metadata);
`roformer.train.sharding` only maps these names to mesh axes (`LOGICAL_AXIS_RULES`), so
no parameter is sharded by a guess from its sizes.

  embed      model width (hidden_size), the residual stream
  embedding  token-embedding width (embedding_size; hidden_size unless factorised)
  mlp        feed-forward intermediate width
  heads      attention features, num_heads x head_dim (q/k/v outputs, attention-output input)
  num_heads  one entry per head (T5's per-head bias)
  kv         features of one head (head_dim)
  vocab      word-piece vocabulary
  layers     one entry per encoder layer (stacked per-layer tables such as Shaw's)
  norm       LayerNorm scale and bias
  None       kept replicated: dense and decoder biases, token types, position rows,
             relative distances, labels
"""
from __future__ import annotations

EMBED, EMBEDDING, MLP, HEADS, NUM_HEADS, KV, VOCAB, LAYERS, NORM = (
    "embed", "embedding", "mlp", "heads", "num_heads", "kv", "vocab", "layers", "norm")
LOGICAL_AXES = (EMBED, EMBEDDING, MLP, HEADS, NUM_HEADS, KV, VOCAB, LAYERS, NORM)


def declare(*names: str | None) -> dict:
    """Variable metadata naming each dimension: `nnx.Param(value, **declare(...))`, or a
    flax layer's `kernel_metadata` / `bias_metadata` / `embedding_metadata` / `scale_metadata`.

    eager_sharding=False because flax would otherwise place the value at creation, which needs
    a mesh whose axes carry these logical names; placement is `roformer.train.sharding`'s job.
    """
    unknown = [n for n in names if n is not None and n not in LOGICAL_AXES]
    if unknown:
        raise ValueError(f"unknown logical axis names {unknown}; choose from {list(LOGICAL_AXES)} or None")
    return {"out_sharding": tuple(names), "eager_sharding": False}
