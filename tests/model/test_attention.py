"""Softmax attention against a plain float64 reference: masks, packed segments, logit bias,
Shaw's relative terms, the probabilities, dropout, and the form the backend seam picks on
CPU against jax.nn.dot_product_attention."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from roformer.model import attention, backend

pytestmark = pytest.mark.fast   # the fast lane (docs/testing.md)

B, L, H, D = 2, 7, 3, 8


def qkv(seed=0, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(seed), 3)
    return tuple(jax.random.normal(key, (B, L, H, D), dtype) for key in keys)


def reference_probs(q, k, *, bias=None, key_mask=None, segment_ids=None, relative=None):
    """softmax(q k^T / sqrt(D) + bias) [B, H, Lq, Lk] in float64, written out per pair."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    logits = np.einsum("bqhd,bkhd->bhqk", q, k)
    if relative is not None:
        index, key_table, _ = (np.asarray(t, np.float64) for t in relative)
        a = key_table[index.astype(int)]                               # [B, Lq, Lk, D]
        logits = logits + np.einsum("bqhd,bqkd->bhqk", q, a)
    logits = logits / np.sqrt(q.shape[-1])
    if bias is not None:
        logits = logits + np.asarray(bias, np.float64)
    allowed = np.ones((q.shape[0], 1, q.shape[1], k.shape[1]), bool)
    if key_mask is not None:
        allowed &= np.asarray(key_mask)[:, None, None, :]
    if segment_ids is not None:
        seg = np.asarray(segment_ids)
        allowed &= (seg[:, :, None] == seg[:, None, :])[:, None]
    logits = np.where(allowed, logits, -1e30)   # a row with no allowed key: uniform, not NaN
    logits = logits - logits.max(axis=-1, keepdims=True)
    weights = np.exp(logits)
    return weights / weights.sum(axis=-1, keepdims=True)


def reference_attention(q, k, v, **kwargs):
    probs = reference_probs(q, k, **kwargs)
    out = np.einsum("bhqk,bkhd->bqhd", probs, np.asarray(v, np.float64))
    relative = kwargs.get("relative")
    if relative is not None:
        index, _, value_table = (np.asarray(t, np.float64) for t in relative)
        out = out + np.einsum("bhqk,bqkd->bqhd", probs, value_table[index.astype(int)])
    return out


KEY_MASK = np.array([[1] * L, [1] * 5 + [0] * 2], bool)
SEGMENTS = np.array([[1, 1, 1, 2, 2, 2, 2], [1, 1, 2, 2, 2, 0, 0]])


def real_rows(x, key_mask):
    """Query rows of real tokens (a padding row attends to nothing real: any output will do)."""
    return np.asarray(x)[np.asarray(key_mask)]


@pytest.mark.parametrize("implementation", ["xla", "auto"])
@pytest.mark.parametrize("masks", ["none", "keys", "segments"])
def test_softmax_attention_equals_the_reference(implementation, masks):
    q, k, v = qkv()
    key_mask = None if masks == "none" else KEY_MASK
    segment_ids = SEGMENTS if masks == "segments" else None
    if segment_ids is not None:
        key_mask = key_mask & (segment_ids != 0)
    bias = jax.random.normal(jax.random.key(3), (1, H, L, L))
    mask = attention.attention_mask(None if key_mask is None else jnp.asarray(key_mask),
                                    None if segment_ids is None else jnp.asarray(segment_ids))
    got = attention.softmax_attention(q, k, v, bias=bias, mask=mask, implementation=implementation)
    want = reference_attention(q, k, v, bias=bias, key_mask=key_mask, segment_ids=segment_ids)
    rows = np.ones((B, L), bool) if key_mask is None else key_mask
    np.testing.assert_allclose(real_rows(got, rows), real_rows(want, rows), rtol=2e-5, atol=2e-6)


def test_attention_mask_keeps_real_keys_of_the_same_segment():
    mask = np.asarray(attention.attention_mask(jnp.asarray(KEY_MASK), jnp.asarray(SEGMENTS)))
    assert mask.shape == (B, 1, L, L)
    seg = SEGMENTS
    want = KEY_MASK[:, None, :] & (seg[:, :, None] == seg[:, None, :])
    np.testing.assert_array_equal(mask[:, 0], want)
    assert attention.attention_mask(None, None) is None


def test_a_query_with_no_key_to_attend_gets_no_nan():
    q, k, v = qkv()
    mask = jnp.zeros((B, 1, L, L), bool)
    out = attention.explicit_softmax_attention(q, k, v, mask=mask)
    assert np.isfinite(np.asarray(out)).all()


def test_probabilities_are_the_reference_softmax_and_sum_to_one():
    q, k, _ = qkv(1)
    mask = attention.attention_mask(jnp.asarray(KEY_MASK), None)
    probs = attention.attention_probabilities(q, k, mask=mask)
    np.testing.assert_allclose(probs, reference_probs(q, k, key_mask=KEY_MASK), rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(probs).sum(-1), 1.0, rtol=1e-5)


def test_shaw_relative_terms_equal_the_reference_with_an_l_by_l_table():
    q, k, v = qkv(2)
    max_distance = 2
    rel = np.arange(L)[None, :] - np.arange(L)[:, None]
    index = np.broadcast_to(np.clip(rel, -max_distance, max_distance) + max_distance, (B, L, L))
    tables = jax.random.normal(jax.random.key(4), (2, 2 * max_distance + 1, D))
    relative = (jnp.asarray(index), tables[0], tables[1])
    mask = attention.attention_mask(jnp.asarray(KEY_MASK), None)
    got = attention.explicit_softmax_attention(q, k, v, mask=mask, relative=relative)
    want = reference_attention(q, k, v, key_mask=KEY_MASK, relative=(index, tables[0], tables[1]))
    np.testing.assert_allclose(real_rows(got, KEY_MASK), real_rows(want, KEY_MASK), rtol=2e-5, atol=2e-6)


def test_dropout_on_probabilities_only_in_training():
    q, k, v = qkv(5)
    dropout = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=0))
    dropout.eval()
    np.testing.assert_allclose(attention.softmax_attention(q, k, v, dropout=dropout, implementation="xla"),
                               reference_attention(q, k, v), rtol=2e-5, atol=2e-6)
    dropout.train()
    dropped = attention.softmax_attention(q, k, v, dropout=dropout, implementation="xla")
    assert not np.allclose(dropped, reference_attention(q, k, v), atol=1e-3)


def test_the_backend_seam_picks_the_written_out_form_for_auto_on_cpu_and_cudnn_on_gpu():
    def path(implementation, platform, dtype=jnp.bfloat16, **kw):
        return backend.attention_path(implementation, dtype=dtype, head_dim=64, platform=platform, **kw)[0]

    assert path("auto", "cpu") == "explicit"
    assert path("xla", "cpu") == "xla" and path("cudnn", "gpu") == "cudnn"
    assert path("auto", "gpu") == "cudnn"
    assert path("auto", "gpu", jnp.float32) == "xla"          # the kernel takes bf16/fp16 only
    assert path("auto", "tpu") == "xla"
    assert path("auto", "gpu", dropout_active=True) == "explicit"
    assert path("cudnn", "gpu", relative_kv=True) == "explicit"
    assert backend.attention_path("auto", dtype=jnp.bfloat16, head_dim=160, platform="gpu")[0] == "xla"
    why = backend.attention_path("auto", dtype=jnp.float32, head_dim=64, dropout_active=True, platform="gpu")[1]
    assert "attention_dropout" in why


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cpu_form_equals_jax_dot_product_attention(dtype):
    """The written-out, head-major form (what "auto" runs on CPU) against
    jax.nn.dot_product_attention's XLA kernel, with a bias and a key mask."""
    q, k, v = qkv(6, dtype)
    bias = jax.random.normal(jax.random.key(7), (1, H, L, L))
    mask = attention.attention_mask(jnp.asarray(KEY_MASK), None)
    explicit = jax.jit(attention.explicit_softmax_attention)(q, k, v, bias=bias, mask=mask)
    fused = jax.jit(jax.nn.dot_product_attention, static_argnames="implementation")(
        q, k, v, bias=bias, mask=mask, implementation="xla")
    assert explicit.dtype == fused.dtype == dtype
    tolerance = 2e-6 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(explicit, np.float32), np.asarray(fused, np.float32),
                               rtol=tolerance, atol=tolerance)
