"""Self-attention: softmax (jax.nn.dot_product_attention) and linear (elu + 1) attention.

q, k, v and outputs are [batch, length, heads, head_dim] (what dot_product_attention
takes); the written-out path multiplies head-major [batch, heads, length, head_dim] copies,
as HF does. Which of the two runs is asked of roformer.model.backend.
Masks are given as optional `key_mask` [B, L] (True = real token) and optional
`segment_ids` [B, L] (packed documents 1..n, 0 = padding; attention stays inside a
document).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from roformer.model import backend, rope
from roformer.model.axes import EMBED, HEADS
from roformer.model.dense import dense
from roformer.model.positions import PositionScheme

ATTENTION_KINDS = ("softmax", "linear")
# "xla" and "cudnn" are jax.nn.dot_product_attention's kernels (the portable one, the fused
# GPU one for bf16/fp16); "auto" lets the backend seam choose (roformer.model.backend).
ATTENTION_IMPLEMENTATIONS = ("auto", "xla", "cudnn")


def attention_mask(key_mask: jax.Array | None, segment_ids: jax.Array | None) -> jax.Array | None:
    """Boolean mask broadcastable to [B, H, Lq, Lk]: real keys, same segment (None: no mask,
    which lets dot_product_attention pick its fastest kernel)."""
    mask = None if key_mask is None else key_mask[:, None, None, :]
    if segment_ids is not None:
        same = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
        mask = same if mask is None else mask & same
    return mask


def softmax_attention(q, k, v, *, bias=None, mask=None, dropout: nnx.Dropout | None = None,
                      implementation: str = "auto"):
    """Scaled dot-product attention, softmax(q k^T / sqrt(D) + bias) v, with masked keys left
    out; q, k, v [B, L, H, D] -> [B, L, H, D].

    jax.nn.dot_product_attention computes it (fused / cuDNN kernels), except when attention
    dropout is active (the kernel has no dropout on probabilities, so training with
    attention_dropout > 0, HF's behaviour, writes it out) or when the backend seam prefers
    the written-out form for this `implementation`. Both are the same attention.
    """
    # The bias stays float32: the XLA kernel adds it to float32 logits, and ALiBi's large
    # distances would lose their resolution in bf16.
    if dropout is not None and not dropout.deterministic and dropout.rate > 0.0:
        return explicit_softmax_attention(q, k, v, bias=bias, mask=mask, dropout=dropout)
    if backend.explicit_attention(implementation):
        return explicit_softmax_attention(q, k, v, bias=bias, mask=mask)
    return jax.nn.dot_product_attention(
        q, k, v, bias=bias, mask=mask, implementation=None if implementation == "auto" else implementation)


def _masked_probs(logits, mask):
    """Softmax in float32; masked logits get a large finite negative (no NaN on empty rows)."""
    logits = logits.astype(jnp.float32)
    if mask is not None:
        logits = jnp.where(mask, logits, -0.7 * jnp.finfo(jnp.float32).max)
    return jax.nn.softmax(logits, axis=-1)


def explicit_softmax_attention(q, k, v, *, bias=None, mask=None, dropout=None, relative=None):
    """Softmax attention written out, with dropout on the probabilities and optional
    Shaw relative terms.

    relative = (index [B, Lq, Lk] in [0, 2k], key_table [2k+1, D], value_table [2k+1, D]):
    logits_ij += q_i . a_{idx_ij} and out_i += sum_j p_ij b_{idx_ij}.  Both are computed
    per relative *distance* ([B, H, L, 2k+1]) and mapped to/from [B, H, L, L] by the index,
    so no [L, L, D] tensor is built.  dot_product_attention cannot express Shaw: the key
    term could be passed as a bias, but the value term needs the probabilities, which the
    kernel does not return.
    """
    # Head-major operands, as HF's transpose_for_scores: the batched dots see [B x H] plain
    # matrices, which XLA:CPU's dot library also prefers (roformer.model.backend).
    q, k, v = (jnp.swapaxes(t, 1, 2) for t in (q, k, v))   # [B, H, L, D]
    probs = _masked_probs(_head_major_logits(q, k, bias=bias, relative=relative), mask)
    if dropout is not None:
        probs = dropout(probs)
    out = jnp.einsum("bhqk,bhkd->bhqd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    if relative is not None:
        index, _, value_table = relative
        # Sum the probabilities landing on each clipped distance r (a scatter-add), then
        # mix the value table: [B, H, L, 2k+1] x [2k+1, D].
        num_rel = value_table.shape[0]
        probs_per_distance = _per_head(lambda p, i: jnp.zeros(num_rel, p.dtype).at[i].add(p))(probs, index)
        out = out + jnp.einsum("bhqr,rd->bhqd", probs_per_distance, value_table.astype(jnp.float32))
    return jnp.swapaxes(out, 1, 2).astype(q.dtype)


def _head_major_logits(q, k, *, bias=None, relative=None):
    """Scaled float32 logits [B, H, Lq, Lk] of head-major q, k [B, H, L, D], with the
    scheme's logit bias and Shaw's relative key term (relative as in
    explicit_softmax_attention)."""
    logits = jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=jnp.float32)
    if relative is not None:
        index, key_table, _ = relative
        q_rel = jnp.einsum("bhqd,rd->bhqr", q, key_table.astype(q.dtype),
                           preferred_element_type=jnp.float32)
        logits = logits + _per_head(_gather_row)(q_rel, index)
    logits = logits * q.shape[-1] ** -0.5
    return logits if bias is None else logits + bias


def attention_probabilities(q, k, *, bias=None, mask=None, relative=None):
    """The softmax attention probabilities [B, H, Lq, Lk] (float32) that
    explicit_softmax_attention applies to v; q, k [B, L, H, D]."""
    q, k = (jnp.swapaxes(t, 1, 2) for t in (q, k))
    return _masked_probs(_head_major_logits(q, k, bias=bias, relative=relative), mask)


def _gather_row(values, index):
    return values[index]


def _per_head(row_fn):
    """Lift a per-query-row function of (values [N], index [K]) to ([B, H, Q, N], [B, Q, K]).

    vmap (rather than broadcasting the index over heads) keeps XLA's gather/scatter batched
    without materialising [B, H, Q, K] index arrays."""
    over_queries = jax.vmap(row_fn, in_axes=(0, 0))
    over_heads = jax.vmap(over_queries, in_axes=(0, None))
    return jax.vmap(over_heads, in_axes=(0, 0))


def elu_feature_map(x):
    """phi(x) = elu(x) + 1 > 0 (Katharopoulos et al. 2020)."""
    return jax.nn.elu(x) + 1.0


def linear_attention(q, k, v, *, scheme: PositionScheme, context, key_mask, segment_ids=None,
                     eps: float = 1e-6):
    """Linear attention with RoPE as RoFormer eq. 19:

        out_m = sum_n (R_m phi(q_m))^T (R_n phi(k_n)) v_n / (sum_n phi(q_m)^T phi(k_n) + eps)

    The rotation acts after the feature map and the denominator uses the unrotated
    features, so it stays positive.  O(L) in sequence length; with packed `segment_ids`
    the block-diagonal mask cannot be folded into the running sums, so that case uses
    the quadratic form with the mask (same formula).  Computed in float32.
    """
    dtype = q.dtype
    phi_q = elu_feature_map(q.astype(jnp.float32))
    phi_k = elu_feature_map(k.astype(jnp.float32))
    if key_mask is not None:
        phi_k = phi_k * key_mask[:, :, None, None]
    v32 = v.astype(jnp.float32)
    rot_q, rot_k, v32 = scheme.rotate(phi_q, phi_k, v32, context)
    if segment_ids is None:
        kv = jnp.einsum("bkhd,bkhe->bhde", rot_k, v32)
        numerator = jnp.einsum("bqhd,bhde->bqhe", rot_q, kv)
        denominator = jnp.einsum("bqhd,bhd->bqh", phi_q, phi_k.sum(axis=1))
    else:
        same = (segment_ids[:, None, :, None] == segment_ids[:, None, None, :]).astype(jnp.float32)
        scores = jnp.einsum("bqhd,bkhd->bhqk", rot_q, rot_k) * same
        numerator = jnp.einsum("bhqk,bkhe->bqhe", scores, v32)
        weights = jnp.einsum("bqhd,bkhd->bhqk", phi_q, phi_k) * same
        denominator = jnp.moveaxis(weights.sum(axis=-1), 1, 2)
    return (numerator / (denominator[..., None] + eps)).astype(dtype)


class RoFormerSelfAttention(nnx.Module):
    """q/k/v projections + attention (HF `RoFormerSelfAttention` parameter layout).

    q/k/v kernels [hidden, num_heads x head_dim] are column-parallel: split over heads."""

    def __init__(self, config, *, rngs: nnx.Rngs):
        hidden = config.hidden_size
        self.num_heads = config.num_heads
        self.head_dim = hidden // config.num_heads
        self.kind = config.attention
        self.implementation = config.attention_impl
        projection = lambda: dense(hidden, hidden, (EMBED, HEADS), dtype=config.jnp_dtype,  # noqa: E731
                                   initializer_range=config.initializer_range, rngs=rngs)
        self.query = projection()
        self.key = projection()
        self.value = projection()
        self.dropout = nnx.Dropout(config.attention_dropout, rngs=rngs)

    def _heads(self, x, half_pairs: int | None = None):
        """q, k, v [B, L, H, D] of x [B, L, hidden].

        With `half_pairs` (a rotary dimension R), the first R features of each head of q and k
        come as split halves instead of interleaved pairs: the kernels' and biases' columns
        permuted at call time (backend.rope_half_pairs). Under backend.fused_qkv the three
        come from one product with the kernels concatenated."""
        batch, length, _ = x.shape
        split = lambda t: t.reshape(batch, length, self.num_heads, self.head_dim)  # noqa: E731
        layers = (self.query, self.key, self.value)
        fused = backend.fused_qkv()
        if half_pairs is None and not fused:
            return tuple(split(layer(x)) for layer in layers)
        params = [(layer.kernel[...], layer.bias[...]) for layer in layers]
        if half_pairs is not None:
            params[:2] = [tuple(rope.interleaved_to_half_heads(p, self.num_heads, half_pairs) for p in pair)
                          for pair in params[:2]]
        if fused:
            kernel = jnp.concatenate([kernel for kernel, _ in params], axis=1)
            bias = jnp.concatenate([bias for _, bias in params])
            return tuple(split(t) for t in jnp.split(self.query.project(x, kernel, bias), 3, axis=-1))
        return tuple(split(layer.project(x, kernel, bias)) for layer, (kernel, bias) in zip(layers, params))

    def __call__(self, x, *, scheme: PositionScheme, context, key_mask, segment_ids, layer: int):
        batch, length, _ = x.shape
        half_pairs = (scheme.interleaved_qk_pairs()
                      if self.kind == "softmax" and backend.rope_half_pairs() else None)
        q, k, v = self._heads(x, half_pairs)
        if self.kind == "linear":
            out = linear_attention(q, k, v, scheme=scheme, context=context, key_mask=key_mask,
                                   segment_ids=segment_ids)
        else:
            # With half_pairs: the same rotation of the same pairs, held as split halves.
            q, k, v = (scheme.rotate(q, k, v, context) if half_pairs is None
                       else scheme.rotate(q, k, v, context, layout="half"))
            mask = attention_mask(key_mask, segment_ids)
            if scheme.relative_kv:
                relative = (context, *scheme.relative_tables(layer))
                dropout = None if self.dropout.deterministic else self.dropout
                out = explicit_softmax_attention(q, k, v, mask=mask, dropout=dropout, relative=relative)
            else:
                out = softmax_attention(q, k, v, bias=scheme.logit_bias(context), mask=mask,
                                        dropout=self.dropout, implementation=self.implementation)
        return out.reshape(batch, length, self.num_heads * self.head_dim)

    def probabilities(self, x, *, scheme: PositionScheme, context, key_mask, segment_ids, layer: int):
        """The softmax attention probabilities [B, H, L, L] this layer applies to x (for
        analysis; linear attention forms none and raises)."""
        if self.kind == "linear":
            raise ValueError("linear attention forms no attention probabilities")
        q, k, v = scheme.rotate(*self._heads(x), context)
        relative = (context, *scheme.relative_tables(layer)) if scheme.relative_kv else None
        return attention_probabilities(q, k, bias=scheme.logit_bias(context),
                                       mask=attention_mask(key_mask, segment_ids), relative=relative)
