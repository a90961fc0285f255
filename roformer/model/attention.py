"""Self-attention: softmax (jax.nn.dot_product_attention) and linear (elu + 1) attention.

q, k, v and outputs are [batch, length, heads, head_dim] (what dot_product_attention
takes); the written-out path multiplies head-major [batch, heads, length, head_dim] copies,
as HF does. Which of the two runs is asked of roformer.model.backend.
Masks are given as optional `key_mask` [B, L] (True = real token), optional
`segment_ids` [B, L] (packed documents 1..n, 0 = padding; attention stays inside a
document) and optional `kv_lengths` [B] (right-padded rows: keys at or after
kv_lengths[b] are padding). A kernel gets padding in the form it takes: nothing for rows
that are one whole document, sequence lengths for right padding, a full [B, 1, L, L] mask
for packed rows (cuDNN refuses the key-only [B, 1, 1, L] form).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from roformer.model import backend, rope
from roformer.model.axes import EMBED, HEADS
from roformer.model.dense import dense
from roformer.errors import ConfigError
from roformer.model.positions import POSITION_SCHEMES, PositionScheme

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


def lengths_mask(kv_lengths: jax.Array, length: int) -> jax.Array:
    """[B, length] boolean key mask of right-padded rows with kv_lengths [B] real tokens."""
    return jnp.arange(length, dtype=jnp.int32)[None, :] < kv_lengths[:, None]


def kernel_padding(mask, kv_lengths, *, path: str, query_length: int):
    """(mask, kv_lengths) as jax.nn.dot_product_attention's `path` kernel takes them.

    cuDNN turns a mask into an additive bias that must span every query row, so a key-only
    mask [B, 1, 1, Lk] is broadcast to [B, 1, Lq, Lk]; right padding stays sequence lengths
    (cuDNN's padding mask, no dense bias); XLA's kernel takes either as given."""
    if path == "cudnn" and mask is not None and mask.shape[-2] != query_length:
        mask = jnp.broadcast_to(mask, (*mask.shape[:2], query_length, mask.shape[-1]))
    if kv_lengths is not None:
        kv_lengths = kv_lengths.astype(jnp.int32)
    return mask, kv_lengths


def softmax_attention(q, k, v, *, bias=None, mask=None, kv_lengths=None,
                      dropout: nnx.Dropout | None = None, implementation: str = "auto"):
    """Scaled dot-product attention, softmax(q k^T / sqrt(D) + bias) v, with masked keys left
    out; q, k, v [B, L, H, D] -> [B, L, H, D]. `mask` is boolean, broadcastable to
    [B, H, Lq, Lk]; `kv_lengths` [B] marks right padding (keys from kv_lengths[b] on).

    jax.nn.dot_product_attention computes it (fused / cuDNN kernels), except when attention
    dropout is active (no kernel drops probabilities, so training with attention_dropout > 0,
    HF's behaviour, writes it out) or when the backend seam prefers the written-out form for
    this `implementation` (backend.attention_path). Both are the same attention.
    """
    dropout_active = dropout is not None and not dropout.deterministic and dropout.rate > 0.0
    path, _ = backend.attention_path(implementation, dtype=q.dtype, head_dim=q.shape[-1],
                                     dropout_active=dropout_active)
    if path == "explicit":
        if kv_lengths is not None:
            by_length = lengths_mask(kv_lengths, k.shape[1])[:, None, None, :]
            mask = by_length if mask is None else mask & by_length
        return explicit_softmax_attention(q, k, v, bias=bias, mask=mask,
                                          dropout=dropout if dropout_active else None)
    mask, kv_lengths = kernel_padding(mask, kv_lengths, path=path, query_length=q.shape[1])
    if path == "cudnn" and bias is not None:
        # cuDNN adds the bias in the inputs' precision (the XLA kernel keeps it float32, which
        # ALiBi's large distances need for their resolution).
        bias = bias.astype(q.dtype)
    return jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask,
                                        key_value_seq_lengths=kv_lengths, implementation=path)


def attention_summary(config, *, training: bool, platform: str | None = None) -> str:
    """One line on the attention a model config runs, and why (a run's start-up log)."""
    if config.attention == "linear":
        return "linear attention (elu + 1 feature map, RoFormer eq. 19)"
    _, why = backend.attention_path(
        config.attention_impl, dtype=config.jnp_dtype, head_dim=config.head_dim,
        dropout_active=training and config.attention_dropout > 0,
        relative_kv=POSITION_SCHEMES[config.position].relative_kv, platform=platform)
    return f"softmax, {why}"


def check_attention_impl(config, platform: str | None = None) -> None:
    """Refuse an explicit `attention_impl=cudnn` the run cannot honour, before it writes
    anything: cuDNN's fused kernel runs on NVIDIA GPUs, on bf16/fp16 inputs, without
    attention dropout, for schemes whose attention is plain softmax with at most a bias."""
    if config.attention_impl != "cudnn":
        return
    refused = backend.fused_kernel_refusal(platform=platform or backend.target_platform(), dtype=config.dtype,
                                           head_dim=config.head_dim)
    why = None
    if refused:
        why = f"it {refused}"
    elif config.attention_dropout > 0:
        why = (f"it has no attention dropout and model.attention_dropout is {config.attention_dropout}; "
               "set it to 0")
    elif config.attention == "linear":
        why = "the model uses linear attention"
    elif POSITION_SCHEMES[config.position].relative_kv:
        why = f"position {config.position!r} adds relative terms to keys and values, which no kernel takes"
    if why:
        raise ConfigError(f"model.attention_impl='cudnn' cannot be used: {why} "
                          "(attention_impl=auto picks the fused kernel wherever it can)")


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

    def __call__(self, x, *, scheme: PositionScheme, context, key_mask, segment_ids, layer: int,
                 kv_lengths=None):
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
            if scheme.relative_kv:
                relative = (context, *scheme.relative_tables(layer))
                dropout = None if self.dropout.deterministic else self.dropout
                out = explicit_softmax_attention(q, k, v, mask=attention_mask(key_mask, segment_ids),
                                                 dropout=dropout, relative=relative)
            else:
                # Right padding goes to the kernel as lengths (key_mask says the same thing).
                mask = attention_mask(None if kv_lengths is not None else key_mask, segment_ids)
                out = softmax_attention(q, k, v, bias=scheme.logit_bias(context), mask=mask,
                                        kv_lengths=kv_lengths, dropout=self.dropout,
                                        implementation=self.implementation)
        return out.reshape(batch, length, self.num_heads * self.head_dim)

    def probabilities(self, x, *, scheme: PositionScheme, context, key_mask, segment_ids, layer: int,
                      kv_lengths=None):
        """The softmax attention probabilities [B, H, L, L] this layer applies to x (for
        analysis; linear attention forms none and raises)."""
        del kv_lengths  # key_mask holds the same padding
        if self.kind == "linear":
            raise ValueError("linear attention forms no attention probabilities")
        q, k, v = scheme.rotate(*self._heads(x), context)
        relative = (context, *scheme.relative_tables(layer)) if scheme.relative_kv else None
        return attention_probabilities(q, k, bias=scheme.logit_bias(context),
                                       mask=attention_mask(key_mask, segment_ids), relative=relative)
