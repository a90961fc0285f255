"""The accelerator forms of roformer.model.backend compute what the default forms compute:
the permuted RoPE projections and the fused QKV product the same logits and gradients as the
interleaved model (same parameters), bf16 MLM logits the same loss to bf16 rounding."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from roformer.errors import ConfigError
from roformer.model import ModelConfig, RoFormerForMaskedLM, backend, rope
from roformer.train.steps import mlm_sums

TINY = dict(vocab_size=64, hidden_size=32, num_layers=1, num_heads=4, intermediate_size=64,
            max_position_embeddings=64)


def test_forms_are_chosen_by_name_per_process_or_per_trace(monkeypatch):
    monkeypatch.delenv(backend.FORMS_ENV, raising=False)
    assert backend.active_forms() == backend.DEFAULT_FORMS[jax.default_backend()]
    monkeypatch.setenv(backend.FORMS_ENV, "fused_qkv, rope_half_pairs")
    assert backend.fused_qkv() and backend.rope_half_pairs()
    with backend.using_forms(["bf16_mlm_logits"]):
        assert backend.active_forms() == {"bf16_mlm_logits"}
        with backend.using_forms([]):
            assert not backend.active_forms()
        assert backend.mlm_logits_dtype(jnp.bfloat16) == jnp.bfloat16
        assert backend.mlm_logits_dtype(jnp.float32) == jnp.float32
    assert backend.active_forms() == {"fused_qkv", "rope_half_pairs"}
    with pytest.raises(ConfigError, match="pairs_stack"):
        backend.parse_forms("pairs_stack")


@pytest.mark.parametrize("rotary_dim", [8, 4])
def test_interleaved_to_half_heads_permutes_each_head(rotary_dim):
    w = np.arange(3 * 2 * 8, dtype=np.float32).reshape(3, 16)
    want = rope.interleaved_to_half(w.reshape(3, 2, 8), rotary_dim).reshape(3, 16)
    np.testing.assert_array_equal(rope.interleaved_to_half_heads(jnp.asarray(w), 2, rotary_dim), want)


def batch(config, size=2, length=12, seed=0):
    rng = np.random.default_rng(seed)
    return {"input_ids": rng.integers(1, config.vocab_size, (size, length), dtype=np.int32),
            "token_type_ids": np.zeros((size, length), np.int32),
            "positions": np.broadcast_to(np.arange(length, dtype=np.int32), (size, length)).copy(),
            "segment_ids": np.ones((size, length), np.int32),
            "masked_positions": np.stack([rng.choice(length, 3, replace=False) for _ in range(size)]).astype(np.int32),
            "masked_labels": rng.integers(1, config.vocab_size, (size, 3), dtype=np.int32),
            "masked_weights": np.ones((size, 3), np.float32)}


def loss_and_grads(config, forms, data):
    """The MLM loss and its parameter gradients (eval mode), traced under `forms`."""
    model = RoFormerForMaskedLM(config, rngs=nnx.Rngs(0))
    model.eval()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params):
        sums = mlm_sums(nnx.merge(graphdef, params, rest), data)
        return sums["loss_sum"]

    with backend.using_forms(forms):
        value, grads = jax.jit(jax.value_and_grad(loss))(params)
    return value, nnx.to_flat_state(grads)


@pytest.mark.parametrize("overrides, form_sets", [
    ({}, (["rope_half_pairs"], ["fused_qkv"], ["rope_half_pairs", "fused_qkv"])),
    ({"rotary_dim": 4}, (["rope_half_pairs", "fused_qkv"],)),     # partial rotary
    ({"rotary_value": True}, (["rope_half_pairs", "fused_qkv"],)),  # not permuted: v rotates too
])
def test_permuted_rope_and_fused_qkv_are_the_interleaved_models_loss_and_gradients(overrides, form_sets):
    config = ModelConfig(**{**TINY, **overrides})
    data = batch(config)
    want, want_grads = loss_and_grads(config, [], data)
    for forms in form_sets:
        got, grads = loss_and_grads(config, forms, data)
        np.testing.assert_allclose(got, want, rtol=1e-5)
        for (path, g), (_, w) in zip(grads, want_grads):
            np.testing.assert_allclose(g[...], w[...], rtol=1e-4, atol=1e-6, err_msg=f"{forms} {path}")


def test_permuted_rope_changes_the_program_it_claims_to():
    """The permuted form really runs (no pair stack of the interleaved layout is left): the
    traced forward differs, and the stored parameters are the interleaved model's."""
    config = ModelConfig(**TINY)
    model = RoFormerForMaskedLM(config, rngs=nnx.Rngs(0))
    model.eval()
    ids = jnp.asarray(batch(config)["input_ids"])
    programs = []
    for forms in ([], ["rope_half_pairs"]):
        with backend.using_forms(forms):
            programs.append(str(jax.make_jaxpr(lambda ids: model(ids))(ids)))
    assert programs[0] != programs[1]
    assert model.roformer.encoder.layer[0].attention.self.query.kernel[...].shape == (32, 32)


def test_bf16_logits_give_the_float32_logits_loss_to_bf16_rounding():
    config = ModelConfig(**TINY, dtype="bfloat16")
    data = batch(config, size=4, length=16)
    want, want_grads = loss_and_grads(config, [], data)
    got, grads = loss_and_grads(config, ["bf16_mlm_logits"], data)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=2e-2)
    for (path, g), (_, w) in zip(grads, want_grads):
        assert g[...].dtype == w[...].dtype, path
        scale = float(jnp.max(jnp.abs(w[...]))) + 1e-6
        np.testing.assert_allclose(g[...] / scale, w[...] / scale, atol=5e-2, err_msg=str(path))


def test_bf16_logits_form_leaves_float32_models_alone():
    config = ModelConfig(**TINY)
    data = batch(config)
    want, _ = loss_and_grads(config, [], data)
    got, _ = loss_and_grads(config, ["bf16_mlm_logits"], data)
    assert got == want


def test_a_run_names_the_forms_it_runs_in_its_start_up_line(monkeypatch):
    from roformer.accelerator import startup_line

    config = ModelConfig(**TINY)
    monkeypatch.setenv(backend.FORMS_ENV, "")
    assert "backend forms" not in startup_line(config)
    monkeypatch.setenv(backend.FORMS_ENV, "fused_qkv,rope_half_pairs")
    assert startup_line(config).endswith("; backend forms: fused_qkv, rope_half_pairs")


@pytest.mark.parametrize("dtype, forms, tolerance", [
    ("float32", ["fused_mlm_loss"], 1e-5),
    ("bfloat16", ["fused_mlm_loss", "bf16_mlm_logits"], None),   # against bf16 logits without the form
])
def test_fused_mlm_loss_is_the_plain_losses_accuracy_and_gradients(dtype, forms, tolerance):
    config = ModelConfig(**TINY, dtype=dtype)
    data = batch(config, size=4, length=16)
    plain = [form for form in forms if form != "fused_mlm_loss"]
    want, want_grads = loss_and_grads(config, plain, data)
    got, grads = loss_and_grads(config, forms, data)
    np.testing.assert_allclose(got, want, rtol=tolerance or 1e-2)
    for (path, g), (_, w) in zip(grads, want_grads):
        assert g[...].dtype == w[...].dtype, path
        scale = float(jnp.max(jnp.abs(w[...]))) + 1e-6
        np.testing.assert_allclose(g[...] / scale, w[...] / scale, atol=tolerance or 2e-2, err_msg=str(path))


def test_fused_mlm_loss_counts_a_tie_with_the_top_logit_as_correct():
    logits = jnp.array([[1.0, 3.0, 3.0, 0.0], [2.0, 0.5, 0.0, -1.0]], jnp.bfloat16)
    labels = jnp.array([2, 1])
    losses, correct = backend.label_losses(logits, labels)
    want = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1) - jnp.array([3.0, 0.5])
    np.testing.assert_allclose(losses, want, rtol=1e-6)
    np.testing.assert_array_equal(correct, [1.0, 0.0])
    d_logits = jax.grad(lambda x: jnp.sum(backend.label_losses(x, labels)[0] * jnp.array([1.0, 2.0])))(logits)
    assert d_logits.dtype == jnp.bfloat16
    want_d = (jax.nn.softmax(logits.astype(jnp.float32)) - jax.nn.one_hot(labels, 4)) * jnp.array([[1.0], [2.0]])
    np.testing.assert_allclose(d_logits.astype(jnp.float32), want_d, atol=1e-2)
