"""ModelConfig, the encoder, heads, masking, dropout modes, dtypes and linear attention."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from roformer.model import (ACTIVATIONS, PRESETS, ModelConfig, RoFormerForMaskedLM,
                            RoFormerForSequenceClassification, RoFormerModel, attention, positions,
                            tied_decoder)
from roformer.model.backend import token_matmul
from roformer.model.dense import dense

pytestmark = pytest.mark.fast   # the fast lane (docs/testing.md)

TINY = dict(vocab_size=64, hidden_size=32, num_layers=1, num_heads=4, intermediate_size=64,
            max_position_embeddings=64)


def config(**overrides) -> ModelConfig:
    return ModelConfig(**{**TINY, **overrides})


def param_names(model) -> list[str]:
    return [".".join(map(str, path)) for path, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))]


@functools.cache
def eval_mlm(**overrides) -> RoFormerForMaskedLM:
    model = RoFormerForMaskedLM(config(**overrides), rngs=nnx.Rngs(0))
    model.eval()
    return model


@nnx.jit
def forward(model, input_ids, inputs=None):
    """Jitted call (op-by-op eager execution is far slower on a busy CPU)."""
    return model(input_ids, **(inputs or {}))


def mlm_logits(model, input_ids, positions, segment_ids):
    return forward(model, input_ids, dict(positions=positions, segment_ids=segment_ids))


def trace(model, input_ids):
    """Trace (without compiling or caching) a forward pass, so Python-level spies see it."""
    graphdef, state = nnx.split(model)
    return jax.make_jaxpr(lambda state: nnx.merge(graphdef, state)(input_ids))(state)


def random_ids(shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(1, 64, size=shape), jnp.int32)


# ---------------------------------------------------------------- config

def encoder_params(config: ModelConfig) -> int:
    """The encoder's parameter count. The layers are alike, so it is counted with one and two
    layers and extended (abstract models of every layer take seconds each to trace)."""
    def count(num_layers):
        model = nnx.eval_shape(lambda: RoFormerModel(dataclasses.replace(config, num_layers=num_layers),
                                                     rngs=nnx.Rngs(0)))
        return sum(int(np.prod(p.shape)) for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
    one = count(1)
    return one + (config.num_layers - 1) * (count(2) - one)


def test_presets():
    for name in PRESETS:
        cfg = ModelConfig.from_preset(name)
        assert cfg.head_dim * cfg.num_heads == cfg.hidden_size and cfg.head_dim % 2 == 0, name   # rotary pairs
        assert cfg.intermediate_size == 4 * cfg.hidden_size, name                                  # BERT's ratio
    # Sizes grow in the order listed.
    counts = [encoder_params(ModelConfig.from_preset(name, vocab_size=30522)) for name in PRESETS]
    assert counts == sorted(counts) and len(set(counts)) == len(counts)
    # base and large are BERT-base / BERT-large: with BERT's learned positions, 30,522 word
    # pieces and its pooler (hidden x hidden + hidden), the transformers BertModel counts.
    for name, bert in (("base", 109_482_240), ("large", 335_141_888)):
        cfg = ModelConfig.from_preset(name, vocab_size=30522, position="learned")
        assert encoder_params(cfg) + cfg.hidden_size * (cfg.hidden_size + 1) == bert, name
    cfg = ModelConfig.from_preset("mini", position="alibi", vocab_size=100)
    assert (cfg.num_layers, cfg.hidden_size, cfg.position, cfg.vocab_size) == (4, 256, "alibi", 100)
    with pytest.raises(ValueError, match="unknown model size 'huge'.*'tiny'"):
        ModelConfig.from_preset("huge")


def test_dict_round_trip_and_size_key():
    cfg = ModelConfig.from_preset("small", position="t5", rotary_dim=16)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    assert ModelConfig.from_dict({**cfg.to_dict(), "size": "small"}) == cfg
    assert ModelConfig.from_dict({"size": "tiny", "position": "learned"}) == \
        ModelConfig.from_preset("tiny", position="learned")
    with pytest.raises(ValueError, match="size 'tiny' does not match"):
        ModelConfig.from_dict({**cfg.to_dict(), "size": "tiny"})
    with pytest.raises(ValueError, match=r"unknown ModelConfig keys \['hiden_size'\]"):
        ModelConfig.from_dict({"hiden_size": 3})


@pytest.mark.parametrize("overrides, message", [
    (dict(hidden_size=30), "hidden_size 30 is not divisible by num_heads 4"),
    (dict(rotary_dim=7), "rotary dim must be even"),
    (dict(hidden_size=36), "rotary dim must be even"),  # head_dim 9
    (dict(rotary_dim=16), r"rotary_dim 16 must be in \(0, head_dim=8\]"),
    (dict(position="rotary"), "unknown position 'rotary'; choose one of"),
    (dict(attention="flash"), "unknown attention 'flash'"),
    (dict(attention="linear", position="alibi"), "attention='linear' cannot use position 'alibi'"),
    (dict(dtype="float16"), "unknown dtype"),
    (dict(rope_layout="pairs"), "unknown rope_layout"),
])
def test_config_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        config(**overrides)


# ---------------------------------------------------------------- structure

def test_parameter_layout_follows_hf():
    model = RoFormerForMaskedLM(config(embedding_size=16, num_layers=2), rngs=nnx.Rngs(0))
    names = param_names(model)
    for expected in ["roformer.embeddings.word_embeddings.embedding",
                     "roformer.embeddings.token_type_embeddings.embedding",
                     "roformer.embeddings.LayerNorm.scale", "roformer.embeddings_project.kernel",
                     "roformer.encoder.layer.0.attention.self.query.kernel",
                     "roformer.encoder.layer.1.attention.self.value.bias",
                     "roformer.encoder.layer.0.attention.output.dense.kernel",
                     "roformer.encoder.layer.0.attention.output.LayerNorm.bias",
                     "roformer.encoder.layer.0.intermediate.dense.kernel",
                     "roformer.encoder.layer.0.output.dense.kernel",
                     "roformer.encoder.layer.0.output.LayerNorm.scale",
                     "cls.predictions.transform.dense.kernel", "cls.predictions.transform.LayerNorm.scale",
                     "cls.predictions.bias"]:
        assert expected in names, expected
    assert not any("decoder" in n for n in names)  # decoder weight is tied to word_embeddings
    assert not any("position" in n for n in names)  # rope has no parameters
    assert model.roformer.embeddings.word_embeddings.embedding.shape == (64, 16)
    assert model.cls.predictions.transform.dense.kernel.shape == (32, 16)
    assert all(v.dtype == jnp.float32 for v in jax.tree.leaves(nnx.state(model, nnx.Param)))


def test_classifier_layout_and_outputs():
    cfg = config(hidden_dropout=0.0, attention_dropout=0.0)
    classifier = RoFormerForSequenceClassification(cfg, 3, rngs=nnx.Rngs(0))
    assert {"classifier.dense.kernel", "classifier.out_proj.kernel"} <= set(param_names(classifier))
    logits = forward(classifier, random_ids((2, 8)))
    assert logits.shape == (2, 3) and logits.dtype == jnp.float32
    regression = RoFormerForSequenceClassification(cfg, 1, rngs=nnx.Rngs(0))
    assert forward(regression, random_ids((2, 8))).shape == (2, 1)
    with pytest.raises(ValueError, match="num_labels"):
        RoFormerForSequenceClassification(cfg, 0, rngs=nnx.Rngs(0))


def test_pre_layer_norm_adds_a_final_norm():
    model = RoFormerModel(config(pre_layer_norm=True), rngs=nnx.Rngs(0))
    model.eval()
    assert "encoder.LayerNorm.scale" in param_names(model)
    out = forward(model, random_ids((1, 8)))
    assert out.shape == (1, 8, 32) and bool(jnp.isfinite(out).all())


# ---------------------------------------------------------------- behaviour

def test_masked_positions_gather_the_full_logits():
    model = eval_mlm()
    ids = random_ids((2, 12))
    full = forward(model, ids)
    assert full.shape == (2, 12, 64) and full.dtype == jnp.float32
    masked_positions = jnp.asarray([[1, 5, 0], [11, 2, 0]], jnp.int32)
    at_masks = forward(model, ids, dict(masked_positions=masked_positions))
    assert at_masks.shape == (2, 3, 64)
    np.testing.assert_allclose(at_masks, jnp.take_along_axis(full, masked_positions[..., None], 1), atol=1e-5)


def test_dropout_follows_train_and_eval_modes():
    model = RoFormerForMaskedLM(config(), rngs=nnx.Rngs(params=0, dropout=1))
    ids = random_ids((2, 8))
    model.eval()
    first, second = forward(model, ids), forward(model, ids)
    np.testing.assert_array_equal(first, second)
    model.train()
    train_a, train_b = forward(model, ids), forward(model, ids)
    assert not np.allclose(train_a, first, atol=1e-4)
    assert not np.allclose(train_a, train_b, atol=1e-4)  # fresh masks each call


def test_padding_does_not_leak_into_real_tokens():
    model = eval_mlm(position="rope")
    ids = random_ids((1, 10))
    mask = jnp.asarray([[1] * 7 + [0] * 3])
    out = forward(model, ids, dict(attention_mask=mask))
    other_padding = forward(model, ids.at[:, 7:].set(5), dict(attention_mask=mask))
    np.testing.assert_allclose(out[:, :7], other_padding[:, :7], atol=1e-5)


@pytest.mark.parametrize("overrides", [dict(position="rope"), dict(position="learned"),
                                       dict(position="rope", attention="linear")])
def test_packed_documents_equal_separate_runs(overrides):
    model = eval_mlm(**overrides)
    doc_a, doc_b = random_ids((1, 9), seed=1), random_ids((1, 5), seed=2)
    packed = jnp.concatenate([doc_a, doc_b, jnp.zeros((1, 2), jnp.int32)], axis=1)
    segment_ids = jnp.asarray([[1] * 9 + [2] * 5 + [0] * 2], jnp.int32)
    pos = jnp.asarray([list(range(9)) + list(range(5)) + [0, 0]], jnp.int32)
    out = mlm_logits(model, packed, pos, segment_ids)
    alone = lambda doc: mlm_logits(model, jnp.pad(doc, ((0, 0), (0, 16 - doc.shape[1]))),  # noqa: E731
                                   pos, jnp.asarray([[1] * doc.shape[1] + [0] * (16 - doc.shape[1])]))
    np.testing.assert_allclose(out[:, :9], alone(doc_a)[:, :9], atol=1e-4)
    np.testing.assert_allclose(out[:, 9:14], alone(doc_b)[:, :5], atol=1e-4)


def test_bfloat16_compute_is_close_to_float32():
    ids = random_ids((2, 16))
    f32 = eval_mlm()
    bf16 = RoFormerForMaskedLM(config(dtype="bfloat16"), rngs=nnx.Rngs(0))
    bf16.eval()
    assert jax.eval_shape(lambda: bf16.roformer(ids)).dtype == jnp.bfloat16
    logits = forward(bf16, ids)
    assert logits.dtype == jnp.float32
    assert all(v.dtype == jnp.float32 for v in jax.tree.leaves(nnx.state(bf16, nnx.Param)))
    np.testing.assert_allclose(logits, forward(f32, ids), atol=0.1)


def test_softmax_attention_uses_dot_product_attention(monkeypatch):
    calls = []
    real = jax.nn.dot_product_attention

    def spy(*args, **kwargs):
        calls.append(kwargs.get("bias") is not None)
        return real(*args, **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", spy)
    trace(eval_mlm(position="alibi", attention_impl="xla"), random_ids((1, 8)))
    assert calls == [True]  # with the ALiBi bias
    model = RoFormerModel(config(attention_dropout=0.5, attention_impl="xla"), rngs=nnx.Rngs(0))
    calls.clear()
    model.train()  # attention dropout on probabilities needs the explicit path
    trace(model, random_ids((1, 8)))
    assert calls == []


def test_auto_attention_on_cpu_is_the_explicit_path_with_the_same_values(monkeypatch):
    ids = random_ids((2, 8))
    mask = jnp.asarray([[1] * 8, [1] * 5 + [0] * 3])
    outputs = {impl: np.asarray(forward(eval_mlm(position="alibi", attention_impl=impl), ids,
                                        {"attention_mask": mask}))
               for impl in ("auto", "xla")}
    np.testing.assert_allclose(outputs["auto"], outputs["xla"], atol=2e-6)

    calls = []
    real = jax.nn.dot_product_attention
    monkeypatch.setattr(jax.nn, "dot_product_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    trace(eval_mlm(position="alibi"), ids)
    assert jax.default_backend() == "cpu" and calls == []     # auto on CPU: explicit path
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    trace(eval_mlm(position="alibi"), ids)
    assert calls == [1]                                       # elsewhere jax chooses the kernel


def test_gradients_are_finite():
    model = RoFormerForMaskedLM(config(position="shaw"), rngs=nnx.Rngs(0))
    model.train()

    def loss(model):
        return jnp.mean(model(random_ids((2, 8)), masked_positions=jnp.zeros((2, 2), jnp.int32)) ** 2)

    grads = nnx.jit(nnx.grad(loss))(model)
    leaves = jax.tree.leaves(grads)
    assert leaves and all(bool(jnp.isfinite(g).all()) for g in leaves)
    assert float(jnp.abs(grads["roformer"]["position"]["relative_value"][...]).sum()) > 0


def test_tied_decoder_gradients_are_autodiffs_to_every_order():
    """The decoder's hand-written backward (bias gradient as a matrix-vector product) gives
    the gradients autodiff gives for x @ table.T + bias, and can itself be differentiated."""
    keys = jax.random.split(jax.random.key(0), 4)
    x, table = jax.random.normal(keys[0], (2, 3, 8)), jax.random.normal(keys[1], (11, 8))
    bias, weights = jax.random.normal(keys[2], (11,)), jax.random.normal(keys[3], (2, 3, 11))
    reference = lambda x, t, b: jnp.einsum("...e,ve->...v", x, t) + b  # noqa: E731

    def loss(decoder):
        return lambda x, t, b: jnp.sum(jnp.tanh(decoder(x, t, b)) * weights)

    np.testing.assert_allclose(tied_decoder(x, table, bias), reference(x, table, bias), rtol=1e-6, atol=1e-6)
    for ours, theirs in zip(jax.grad(loss(tied_decoder), argnums=(0, 1, 2))(x, table, bias),
                            jax.grad(loss(reference), argnums=(0, 1, 2))(x, table, bias)):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)
    def second(decoder):   # d/d bias of |d loss / d table|^2: reverse over reverse
        return jax.grad(lambda b: jnp.sum(jax.grad(loss(decoder), argnums=1)(x, table, b) ** 2))(bias)

    np.testing.assert_allclose(second(tied_decoder), second(reference), rtol=1e-4, atol=1e-5)


def test_gelu_is_the_exact_erf_form():
    """Within 1e-6 of float64 x/2 erfc(-x/sqrt2) everywhere (torch's own gelu is within 9e-7),
    gradients included."""
    import math
    x = np.linspace(-8.0, 8.0, 2001, dtype=np.float32)
    exact = [0.5 * v * math.erfc(-v / math.sqrt(2.0)) for v in x.astype(np.float64)]
    np.testing.assert_allclose(ACTIVATIONS["gelu"](jnp.asarray(x)), exact, atol=1e-6, rtol=0)
    np.testing.assert_allclose(jax.grad(lambda x: jnp.sum(ACTIVATIONS["gelu"](x)))(jnp.asarray(x)),
                               jax.grad(lambda x: jnp.sum(jax.nn.gelu(x, approximate=False)))(jnp.asarray(x)),
                               atol=1e-6)


def test_token_matmul_is_nnx_linears_product_on_flattened_tokens():
    """Dense layers' dot_general: the same values and gradients as jax.lax.dot_general on
    [B, L, in] inputs (computed as [B*L, in] @ [in, out]); shapes it does not flatten
    (2-D input, other contractions) go to jax.lax.dot_general unchanged."""
    x = jax.random.normal(jax.random.key(0), (3, 5, 8))
    w = jax.random.normal(jax.random.key(1), (8, 6))
    dims = (((2,), (0,)), ((), ()))
    np.testing.assert_allclose(token_matmul(x, w, dims), jax.lax.dot_general(x, w, dims), rtol=1e-6, atol=1e-6)
    grads = [jax.grad(lambda x, w, f=f: jnp.sum(jnp.sin(f(x, w, dims))), argnums=(0, 1))(x, w)
             for f in (token_matmul, jax.lax.dot_general)]
    for ours, reference in zip(*grads):
        np.testing.assert_allclose(ours, reference, rtol=1e-5, atol=1e-5)
    batch_dims = (((2,), (1,)), ((0,), (0,)))
    y = jax.random.normal(jax.random.key(2), (3, 8, 4))
    np.testing.assert_array_equal(token_matmul(x, y, batch_dims), jax.lax.dot_general(x, y, batch_dims))
    layer = dense(8, 6, (None, None), dtype=jnp.float32, initializer_range=0.02, rngs=nnx.Rngs(0))
    assert layer.dot_general is token_matmul
    np.testing.assert_allclose(layer(x), x @ layer.kernel[...] + layer.bias[...], rtol=1e-6, atol=1e-6)
    assert layer(x[0]).shape == (5, 6)


# ---------------------------------------------------------------- linear attention

def rotation_matrix(position, dim, base=10000.0):
    """Block-diagonal R_{Theta,m} (paper eq. 15)."""
    matrix = np.zeros((dim, dim))
    for j in range(dim // 2):
        c, s = np.cos(position * base ** (-2 * j / dim)), np.sin(position * base ** (-2 * j / dim))
        matrix[2 * j:2 * j + 2, 2 * j:2 * j + 2] = [[c, -s], [s, c]]
    return matrix


def naive_linear_rope(q, k, v, positions_, key_mask, eps=1e-6):
    """RoFormer eq. 19 written out per (m, n) pair with explicit rotation matrices (float64)."""
    q, k, v = (np.asarray(t, np.float64) for t in (q, k, v))
    phi = lambda x: np.where(x > 0, x + 1.0, np.exp(x))  # noqa: E731  elu + 1
    batch, length, heads, dim = q.shape
    out = np.zeros_like(v)
    for b in range(batch):
        rot = [rotation_matrix(positions_[b, i], dim) for i in range(length)]
        for h in range(heads):
            for m in range(length):
                num, den = np.zeros(dim), 0.0
                for n in range(length):
                    if not key_mask[b, n]:
                        continue
                    pq, pk = phi(q[b, m, h]), phi(k[b, n, h])
                    num += (rot[m] @ pq) @ (rot[n] @ pk) * v[b, n, h]
                    den += pq @ pk
                out[b, m, h] = num / (den + eps)
    return out


def test_linear_attention_matches_paper_eq19():
    rng = np.random.default_rng(5)
    q, k, v = rng.normal(size=(3, 2, 6, 2, 8)).astype(np.float32)
    pos = np.stack([np.arange(6), np.arange(6) + 40])
    key_mask = np.ones((2, 6), bool)
    key_mask[1, 4:] = False
    scheme = positions.Rotary(config(hidden_size=16, num_heads=2), rngs=nnx.Rngs(0))
    context = scheme.prepare(jnp.asarray(pos))
    got = attention.linear_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), scheme=scheme,
                                     context=context, key_mask=jnp.asarray(key_mask))
    np.testing.assert_allclose(got, naive_linear_rope(q, k, v, pos, key_mask), atol=1e-4)
    # The quadratic (segment-masked) form is the same formula.
    segments = jnp.asarray(key_mask, jnp.int32)
    quadratic = attention.linear_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), scheme=scheme,
                                           context=context, key_mask=jnp.asarray(key_mask),
                                           segment_ids=segments)
    np.testing.assert_allclose(quadratic[0], got[0], atol=1e-5)
    np.testing.assert_allclose(quadratic[1, :4], got[1, :4], atol=1e-5)


def test_config_is_hashable_and_frozen():
    cfg = config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hidden_size = 64  # type: ignore[misc]
    assert hash(cfg) == hash(config())


def test_shared_parameters_initialise_identically_across_schemes():
    """Same seed -> same initial values for every parameter all schemes share."""
    def flat_params(position):
        config = ModelConfig(vocab_size=50, hidden_size=16, num_layers=1, num_heads=2,
                             intermediate_size=32, max_position_embeddings=16, position=position)
        model = RoFormerForMaskedLM(config, rngs=nnx.Rngs(params=0, dropout=1))
        state = nnx.state(model, nnx.Param)
        return {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(state)}

    reference = flat_params("none")
    for position in positions.POSITION_SCHEMES:
        params = flat_params(position)
        shared = [k for k in params if k in reference and "position" not in k]
        assert len(shared) == len(reference)
        for key in shared:
            np.testing.assert_array_equal(np.asarray(params[key]), np.asarray(reference[key]), err_msg=f"{position}: {key}")


def test_attention_implementation_is_a_config_choice(monkeypatch):
    config = ModelConfig(vocab_size=50, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)
    ids = jnp.arange(12, dtype=jnp.int32).reshape(2, 6) % 50
    outputs = []
    for impl in ("auto", "xla"):
        model = RoFormerModel(dataclasses.replace(config, attention_impl=impl), rngs=nnx.Rngs(0))
        model.eval()
        outputs.append(np.asarray(model(ids, attention_mask=jnp.ones((2, 6)))))
    np.testing.assert_allclose(outputs[0], outputs[1], atol=1e-6)
    with pytest.raises(ValueError, match="attention_impl"):
        dataclasses.replace(config, attention_impl="flash")

    # Which kernel each setting asks jax.nn.dot_product_attention for (on CPU every request
    # runs as XLA, so the outputs above cannot tell them apart): "auto" on a GPU takes XLA's
    # kernel for this float32 model (cuDNN's takes bf16/fp16: tests/model/test_attention_kernels.py).
    fused = jax.nn.dot_product_attention
    requested = []

    def spy(*args, implementation=None, **kwargs):
        requested.append(implementation)
        return fused(*args, **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", spy)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    for impl, expected in (("auto", "xla"), ("xla", "xla"), ("cudnn", "cudnn")):
        requested.clear()
        model = RoFormerModel(dataclasses.replace(config, attention_impl=impl, attention_dropout=0.1),
                              rngs=nnx.Rngs(0))
        model.eval()
        trace(model, ids)
        assert requested == [expected], impl
        requested.clear()
        model.train()                    # attention dropout needs the explicit path: no fused kernel
        trace(model, ids)
        assert requested == [], impl
