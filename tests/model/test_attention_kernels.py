"""Every attention call the code makes with attention_impl=cudnn, checked on CPU against the
layout rules of jax's cuDNN fused attention (without running the kernel): each softmax
scheme, training and prediction, full, right-padded, HF-masked and packed batches, the
pretraining step and GLUE's prediction. Also the run-start refusals of a cuDNN setting that
cannot run, and the one-line summary of the attention a run uses."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import cudnn_layout_errors
from roformer.errors import ConfigError
from roformer.model import ModelConfig, RoFormerForMaskedLM, RoFormerForSequenceClassification
from roformer.model import attention
from roformer.model.positions import POSITION_SCHEMES

SOFTMAX_KERNEL_SCHEMES = sorted(name for name, scheme in POSITION_SCHEMES.items() if not scheme.relative_kv)
B, L = 3, 16


@pytest.fixture
def cudnn_calls(monkeypatch):
    """Records every cuDNN call's layout errors, then computes it with XLA's kernel."""
    original = jax.nn.dot_product_attention
    calls = []

    def checked(q, k, v, bias=None, mask=None, *, implementation=None, key_value_seq_lengths=None, **kw):
        if implementation == "cudnn":
            calls.append(cudnn_layout_errors(q, k, v, bias, mask, key_value_seq_lengths))
            implementation = "xla"
        return original(q, k, v, bias=bias, mask=mask, implementation=implementation,
                        key_value_seq_lengths=key_value_seq_lengths, **kw)

    monkeypatch.setattr(jax.nn, "dot_product_attention", checked)
    return calls


def cudnn_config(position: str, **overrides) -> ModelConfig:
    settings = dict(dtype="bfloat16", attention_impl="cudnn", attention_dropout=0.0)
    return ModelConfig.from_preset("tiny", vocab_size=64, position=position, **{**settings, **overrides})


def batches():
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(5, 64, (B, L)), jnp.int32)
    lengths = jnp.asarray([L, 9, 4], jnp.int32)
    segments = np.ones((B, L), np.int32)
    segments[0, 7:] = 2
    segments[1, 12:] = 0
    return {
        "full": dict(input_ids=ids),
        "right-padded": dict(input_ids=ids, lengths=lengths),
        "hf attention_mask": dict(input_ids=ids, attention_mask=attention.lengths_mask(lengths, L)),
        "packed": dict(input_ids=ids, segment_ids=jnp.asarray(segments)),
    }


@pytest.mark.parametrize("position", SOFTMAX_KERNEL_SCHEMES)
@pytest.mark.parametrize("mode", ["train", "predict"])
def test_every_cudnn_call_has_a_layout_the_kernel_takes(cudnn_calls, position, mode):
    model = RoFormerForSequenceClassification(cudnn_config(position), 2, rngs=nnx.Rngs(0))
    model.train() if mode == "train" else model.eval()
    for name, batch in batches().items():
        del cudnn_calls[:]
        if mode == "train":
            nnx.grad(lambda m, batch=batch: jnp.sum(m(**batch)))(model)
        else:
            model(**batch)
        assert len(cudnn_calls) == model.config.num_layers, name
        assert all(errors == [] for errors in cudnn_calls), (name, cudnn_calls)


def test_right_padding_reaches_the_kernel_as_lengths_and_full_rows_with_no_mask(monkeypatch):
    seen = []
    original = jax.nn.dot_product_attention

    def spy(q, k, v, bias=None, mask=None, *, key_value_seq_lengths=None, implementation=None, **kw):
        seen.append((mask is None, key_value_seq_lengths is not None))
        return original(q, k, v, bias=bias, mask=mask, key_value_seq_lengths=key_value_seq_lengths,
                        implementation="xla", **kw)

    monkeypatch.setattr(jax.nn, "dot_product_attention", spy)
    model = RoFormerForSequenceClassification(cudnn_config("rope"), 2, rngs=nnx.Rngs(0))
    model.eval()
    forms = {}
    for name, batch in batches().items():
        del seen[:]
        model(**batch)
        forms[name] = seen[0]
    assert forms["full"] == (True, False)
    assert forms["right-padded"] == (True, True)
    assert forms["packed"] == (False, False)


def test_padding_forms_give_the_same_logits():
    """lengths, the HF mask and the written-out path agree on the real rows."""
    config = cudnn_config("rope", attention_impl="xla", dtype="float32")
    model = RoFormerForSequenceClassification(config, 2, rngs=nnx.Rngs(0))
    model.eval()
    b = batches()
    by_lengths = model(**b["right-padded"])
    by_mask = model(**b["hf attention_mask"])
    explicit = RoFormerForSequenceClassification(dataclasses.replace(config, attention_impl="auto"), 2,
                                                 rngs=nnx.Rngs(0))
    explicit.eval()
    np.testing.assert_allclose(by_lengths, by_mask, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(by_lengths, explicit(**b["right-padded"]), rtol=1e-4, atol=1e-5)


def test_the_pretraining_loss_on_packed_rows_takes_a_cudnn_layout(cudnn_calls):
    from roformer.train.steps import mlm_sums

    model = RoFormerForMaskedLM(cudnn_config("rope"), rngs=nnx.Rngs(0))
    model.train()
    batch = {**batches()["packed"], "token_type_ids": jnp.zeros((B, L), jnp.int32),
             "positions": jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L)),
             "masked_positions": jnp.asarray([[1, 2], [3, 4], [5, 6]], jnp.int32),
             "masked_labels": jnp.ones((B, 2), jnp.int32), "masked_weights": jnp.ones((B, 2))}
    nnx.grad(lambda m: mlm_sums(m, batch)["loss_sum"])(model)
    assert cudnn_calls and all(errors == [] for errors in cudnn_calls), cudnn_calls


@pytest.mark.parametrize("overrides, platform, says", [
    ({}, "cpu", "NVIDIA GPUs only"),
    ({"dtype": "float32"}, "gpu", "model.dtype is float32"),
    ({"attention_dropout": 0.1}, "gpu", "attention dropout"),
    ({"position": "shaw"}, "gpu", "relative terms"),
    ({"attention": "linear"}, "gpu", "linear attention"),
])
def test_a_cudnn_setting_that_cannot_run_is_refused_in_one_line(overrides, platform, says):
    config = cudnn_config(overrides.pop("position", "rope"), **overrides)
    with pytest.raises(ConfigError, match=says) as refused:
        attention.check_attention_impl(config, platform=platform)
    assert "\n" not in str(refused.value)
    attention.check_attention_impl(cudnn_config("rope"), platform="gpu")       # runs
    attention.check_attention_impl(dataclasses.replace(config, attention_impl="auto"), platform=platform)


def test_the_attention_summary_says_which_path_and_why():
    config = ModelConfig.from_preset("tiny", vocab_size=64)
    assert "attention_dropout" in attention.attention_summary(config, training=True, platform="gpu")
    assert "xla" in attention.attention_summary(config, training=False, platform="gpu")   # float32
    fast = dataclasses.replace(config, dtype="bfloat16", attention_dropout=0.0)
    assert "cudnn" in attention.attention_summary(fast, training=True, platform="gpu")
    assert "written out" in attention.attention_summary(fast, training=True, platform="cpu")


def test_document_rows_as_lengths_give_the_loss_of_their_segment_ids():
    """A right-padded row of one document: its `lengths` (what the pipeline adds with
    data.packing=document, so kernels take no mask) and its segment ids give one loss."""
    from roformer.train.steps import mlm_sums, padding_inputs

    model = RoFormerForMaskedLM(cudnn_config("rope", dtype="float32", attention_impl="auto"), rngs=nnx.Rngs(0))
    model.eval()
    lengths = jnp.asarray([L, 9, 4], jnp.int32)
    batch = {"input_ids": batches()["full"]["input_ids"], "token_type_ids": jnp.zeros((B, L), jnp.int32),
             "positions": jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L)),
             "segment_ids": attention.lengths_mask(lengths, L).astype(jnp.int32),
             "masked_positions": jnp.asarray([[1, 2], [3, 4], [1, 3]], jnp.int32),
             "masked_labels": jnp.ones((B, 2), jnp.int32), "masked_weights": jnp.ones((B, 2))}
    with_lengths = {**batch, "lengths": lengths}
    assert set(padding_inputs(with_lengths)) == {"lengths"} and set(padding_inputs(batch)) == {"segment_ids"}
    np.testing.assert_allclose(mlm_sums(model, with_lengths)["loss_sum"], mlm_sums(model, batch)["loss_sum"],
                               rtol=1e-5)
