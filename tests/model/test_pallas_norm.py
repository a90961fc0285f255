"""The pallas_residual_norm form: bias + dropout + residual add + LayerNorm as Pallas kernels
(roformer.model.pallas_norm), run in interpret mode on the CPU, against the plain jnp form
and against the model without the form."""
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from roformer.errors import ConfigError
from roformer.model import ModelConfig, RoFormerForMaskedLM, backend, pallas_norm
from roformer.train.steps import mlm_sums

TINY = dict(vocab_size=64, hidden_size=48, num_layers=2, num_heads=4, intermediate_size=96,
            max_position_embeddings=64)
KEEP_PROB = 0.9


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of a few rows, so that a tiny input spans several programs and backward chunks
    and its last block is ragged (what base-size inputs do with the default sizes)."""
    monkeypatch.setattr(pallas_norm, "FORWARD_ELEMENTS", 256)
    monkeypatch.setattr(pallas_norm, "BACKWARD_ELEMENTS", 128)
    monkeypatch.setattr(pallas_norm, "BACKWARD_ROWS", 8)


def inputs(dtype, shape=(3, 7, 48)):
    keys = jax.random.split(jax.random.key(0), 7)
    features = shape[-1]
    return dict(x=jax.random.normal(keys[0], shape).astype(dtype),
                y=(2 * jax.random.normal(keys[1], shape) + 0.5).astype(dtype),
                y_bias=0.3 * jax.random.normal(keys[6], (features,)),   # float32, as Dense keeps it
                keep=jax.random.bernoulli(keys[2], KEEP_PROB, shape),
                scale=(1 + 0.2 * jax.random.normal(keys[3], (features,))).astype(dtype),
                bias=(0.2 * jax.random.normal(keys[4], (features,))).astype(dtype)), \
        jax.random.normal(keys[5], shape)


def value_and_grads(fn, args, weights):
    """fn's output and the gradients of sum(output * weights) in x, y, y_bias, scale and bias."""
    keep = args["keep"]

    def loss(x, y, y_bias, scale, bias):
        out = fn(x, y, y_bias, keep, scale, bias, keep_prob=KEEP_PROB, epsilon=1e-12)
        return jnp.sum(out.astype(jnp.float32) * weights), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))(
        args["x"], args["y"], args["y_bias"], args["scale"], args["bias"])
    return out, grads


def kernel(*args, **kwargs):
    """The kernels, interpreted (compiled by Triton where a GPU runs the tests)."""
    return pallas_norm.residual_layer_norm(*args, **kwargs, interpret=jax.default_backend() != "gpu")


@pytest.mark.parametrize("dtype, tolerance", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("dropout", [True, False])
def test_kernels_give_the_plain_forms_values_and_gradients(small_blocks, dtype, tolerance, dropout):
    args, weights = inputs(dtype)
    if not dropout:
        args["keep"] = None
    want, want_grads = value_and_grads(pallas_norm.residual_layer_norm_reference, args, weights)
    got, got_grads = value_and_grads(kernel, args, weights)
    assert got.dtype == want.dtype == dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=tolerance * float(jnp.max(jnp.abs(want))))
    for name, g, w, arg in zip(("x", "y", "y_bias", "scale", "bias"), got_grads, want_grads,
                               (args["x"], args["y"], args["y_bias"], args["scale"], args["bias"])):
        assert g.dtype == w.dtype == arg.dtype, name
        scale = float(jnp.max(jnp.abs(w.astype(jnp.float32))))
        np.testing.assert_allclose(np.asarray(g, np.float32) / scale, np.asarray(w, np.float32) / scale,
                                   atol=tolerance, err_msg=name)
    if dropout:   # the dropped elements get no gradient through y
        assert not jnp.any(jnp.where(args["keep"], 0, got_grads[1]))


def test_kernels_normalise_rows_whose_width_is_not_a_power_of_two(small_blocks):
    args, weights = inputs(jnp.float32, shape=(5, 3, 24))
    want, _ = value_and_grads(pallas_norm.residual_layer_norm_reference, args, weights)
    got, _ = value_and_grads(kernel, args, weights)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(jnp.mean(got, axis=-1), jnp.mean(want, axis=-1), atol=1e-5)


def test_kernels_batch_under_vmap_as_the_seeds_of_an_ablation_do(small_blocks):
    args, weights = inputs(jnp.float32, shape=(2, 5, 48))

    def grads(fn):
        def loss(x, y, keep):
            out = fn(x, y, args["y_bias"], keep, args["scale"], args["bias"], keep_prob=KEEP_PROB, epsilon=1e-12)
            return jnp.sum(out * out)
        return jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1))))(args["x"], args["y"], args["keep"])

    for got, want in zip(grads(kernel), grads(pallas_norm.residual_layer_norm_reference)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("features, dtype, dropout", [(768, jnp.bfloat16, True), (128, jnp.float32, False)])
def test_kernels_lower_through_triton_for_a_gpu(features, dtype, dropout):
    """The Triton lowering (jax to Triton IR, where Pallas checks the block shapes) runs on
    the CPU: both kernels of base's hidden size lower for CUDA. Compiling the IR needs a GPU."""
    shape = (4, 128, features)
    x = jax.ShapeDtypeStruct(shape, dtype)
    keep = jax.ShapeDtypeStruct(shape, jnp.bool_) if dropout else None
    params, y_bias = jax.ShapeDtypeStruct((features,), dtype), jax.ShapeDtypeStruct((features,), jnp.float32)

    def loss(x, y, y_bias, keep, scale, bias):
        out = pallas_norm.residual_layer_norm(x, y, y_bias, keep, scale, bias, keep_prob=0.9, epsilon=1e-12)
        return jnp.sum(out.astype(jnp.float32))

    with a_gpu_to_lower_for():
        lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 4, 5))).trace(x, x, y_bias, keep, params, params)
        assert lowered.lower(lowering_platforms=("cuda",)).as_text().count("__gpu$xla.gpu.triton") == 2


def a_gpu_to_lower_for():
    """Newer jax asks which GPU Triton lowers for (its compute capability) and, with none
    attached, takes it from an abstract device; older jax lowers without one."""
    if not hasattr(jax.sharding, "AbstractDevice"):
        return contextlib.nullcontext()
    device = jax.sharding.AbstractDevice("NVIDIA H100", None, "cuda")
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("devices",), abstract_device=device))


def model_outputs(config, forms, *, train):
    """Logits (eval) or the MLM loss and every parameter's gradient (train mode, dropout on:
    the same dropout key stream whichever form runs), traced under `forms`."""
    model = RoFormerForMaskedLM(config, rngs=nnx.Rngs(0, dropout=1))
    rng = np.random.default_rng(0)
    ids = rng.integers(1, config.vocab_size, (2, 12), dtype=np.int32)
    if not train:
        model.eval()
        with backend.using_forms(forms):
            return nnx.jit(lambda model, ids: model(ids))(model, ids)
    data = {"input_ids": ids, "token_type_ids": np.zeros_like(ids),
            "positions": np.broadcast_to(np.arange(12, dtype=np.int32), ids.shape).copy(),
            "masked_positions": np.array([[1, 5, 9], [0, 4, 11]], np.int32),
            "masked_labels": rng.integers(1, config.vocab_size, (2, 3), dtype=np.int32),
            "masked_weights": np.ones((2, 3), np.float32)}

    def loss(model):
        return mlm_sums(model, data)["loss_sum"]

    with backend.using_forms(forms):
        value, grads = nnx.jit(nnx.value_and_grad(loss))(model)
    return value, nnx.to_flat_state(grads)


@pytest.mark.parametrize("dtype, tolerance", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_the_model_with_the_form_gives_the_logits_loss_and_gradients_without_it(dtype, tolerance):
    config = ModelConfig(**{**TINY, "num_layers": 1}, dtype=dtype)
    want = model_outputs(config, [], train=False)
    got = model_outputs(config, ["pallas_residual_norm"], train=False)
    np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance * float(jnp.max(jnp.abs(want))))
    want, want_grads = model_outputs(config, [], train=True)
    got, grads = model_outputs(config, ["pallas_residual_norm"], train=True)
    np.testing.assert_allclose(got, want, rtol=tolerance / 2)   # float32: another mask moves it more
    for (path, g), (_, w) in zip(grads, want_grads):
        scale = float(jnp.max(jnp.abs(w[...]))) + 1e-12
        np.testing.assert_allclose(g[...] / scale, w[...] / scale, atol=tolerance * 2, err_msg=str(path))


def test_the_form_runs_the_kernel_only_when_on_and_adds_no_parameters(monkeypatch):
    monkeypatch.delenv(backend.FORMS_ENV, raising=False)
    assert "pallas_residual_norm" not in backend.active_forms()
    config = ModelConfig(**TINY)
    model = RoFormerForMaskedLM(config, rngs=nnx.Rngs(0))
    model.eval()
    ids = jnp.ones((2, 8), jnp.int32)
    before = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))

    def program(forms):
        with backend.using_forms(forms):
            return str(jax.make_jaxpr(lambda ids: model(ids))(ids))

    assert "pallas_call" not in program([])
    assert program([]) == str(jax.make_jaxpr(lambda ids: model(ids))(ids))   # the default set
    assert program(["pallas_residual_norm"]).count("pallas_call") == 2 * config.num_layers
    after = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    jax.tree.map(np.testing.assert_array_equal, after, before)


def test_pre_layer_norm_layers_keep_their_form():
    config = ModelConfig(**TINY, pre_layer_norm=True)
    model = RoFormerForMaskedLM(config, rngs=nnx.Rngs(0))
    model.eval()
    with backend.using_forms(["pallas_residual_norm"]):
        assert "pallas_call" not in str(jax.make_jaxpr(lambda ids: model(ids))(jnp.ones((1, 4), jnp.int32)))


def test_the_form_is_refused_on_platforms_without_its_lowering_and_on_several_devices(monkeypatch):
    args, _ = inputs(jnp.float32)
    mesh = jax.sharding.AbstractMesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    with jax.sharding.use_abstract_mesh(mesh), pytest.raises(ConfigError, match="one device, not on a mesh of 2"):
        backend.residual_layer_norm(**args, keep_prob=KEEP_PROB, epsilon=1e-12)
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    with pytest.raises(ConfigError, match="pallas_residual_norm runs on GPUs"):
        backend.residual_layer_norm(**args, keep_prob=KEEP_PROB, epsilon=1e-12)
