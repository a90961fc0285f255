"""Mixed precision (float32 parameters, bfloat16 compute): the backward pass sums each
parameter's gradient over the batch's tokens in float32. Taken in bfloat16, a sum of
thousands of terms keeps about two significant digits."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from roformer.bench.workload import synthetic_batch
from roformer.model import ModelConfig, RoFormerForMaskedLM
from roformer.model.dense import dense
from roformer.model.embedding import Embed
from roformer.model.positions import POSITION_SCHEMES
from roformer.train.steps import mlm_sums, reseeded


def _called_jaxprs(eqn):
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, jax.extend.core.ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, jax.extend.core.Jaxpr):
                yield item


def bfloat16_sums(jaxpr, activation_shape) -> list[str]:
    """reduce_sum and scatter-add equations with a bfloat16 operand, in `jaxpr` and the
    programs it calls. A scatter-add back into the activations (the backward of the masked
    positions' gather, each position once) adds nothing up and is left out."""
    found = []
    for eqn in jaxpr.eqns:
        operand = getattr(eqn.invars[0], "aval", None) if eqn.invars else None
        if eqn.primitive.name in ("reduce_sum", "scatter-add") and getattr(operand, "dtype", None) == jnp.bfloat16:
            out_shape = tuple(eqn.outvars[0].aval.shape)
            if not (eqn.primitive.name == "scatter-add" and out_shape == activation_shape):
                found.append(f"{eqn.primitive.name} {tuple(operand.shape)} -> {out_shape}")
        for called in _called_jaxprs(eqn):
            found += bfloat16_sums(called, activation_shape)
    return found


@pytest.mark.parametrize("scheme", sorted(POSITION_SCHEMES))
def test_no_parameter_gradient_is_summed_in_bfloat16(scheme):
    config = ModelConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=4, intermediate_size=64,
                         max_position_embeddings=64, position=scheme, dtype="bfloat16", embedding_size=16)
    graphdef, params, rest = nnx.split(RoFormerForMaskedLM(config, rngs=nnx.Rngs(0)), nnx.Param, ...)
    batch = {k: jnp.asarray(v) for k, v in synthetic_batch(config, 2, 16).items()}

    def loss(p):
        model = nnx.merge(graphdef, p, reseeded(rest, jax.random.key(1)))   # as the train step does
        model.train()
        return mlm_sums(model, batch)["loss_sum"]

    assert bfloat16_sums(jax.make_jaxpr(jax.grad(loss))(params).jaxpr, (2, 16, 32)) == []


def _lossy_cotangent(shape):
    """bfloat16 terms of one sign and similar size: their running sum in bfloat16 soon
    outgrows the precision that adding one more needs."""
    return jax.random.uniform(jax.random.key(0), shape, minval=0.5, maxval=1.5).astype(jnp.bfloat16)


def _gradients(layer, inputs, cotangent):
    """(output, parameter gradients as a pure dict) of `layer` at `inputs` for `cotangent`."""
    graphdef, params = nnx.split(layer)
    output, vjp = jax.vjp(lambda p: nnx.merge(graphdef, p)(inputs), params)
    return output, nnx.to_pure_dict(vjp(cotangent)[0])


def test_dense_sums_its_bias_gradient_in_float32_and_computes_what_nnx_linear_does():
    layer = dense(8, 4, (None, None), dtype=jnp.bfloat16, initializer_range=0.02, rngs=nnx.Rngs(0))
    layer.bias[...] = jnp.arange(4, dtype=jnp.float32) / 3
    plain = nnx.Linear(8, 4, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    plain.kernel[...], plain.bias[...] = layer.kernel[...], layer.bias[...]
    x = jax.random.normal(jax.random.key(1), (32, 256, 8)).astype(jnp.bfloat16)
    cotangent = _lossy_cotangent((32, 256, 4))
    output, grads = _gradients(layer, x, cotangent)
    np.testing.assert_array_equal(np.asarray(output, np.float32), np.asarray(plain(x), np.float32))
    np.testing.assert_allclose(grads["bias"], np.asarray(cotangent, np.float64).sum(axis=(0, 1)), rtol=1e-6)


def test_embed_sums_a_rows_gradient_in_float32_and_looks_up_what_nnx_embed_does():
    table = Embed(2, 4, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    plain = nnx.Embed(2, 4, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    ids = jnp.zeros((32, 256), jnp.int32).at[:, ::7].set(1)   # token types: mostly 0
    cotangent = _lossy_cotangent((32, 256, 4))
    output, grads = _gradients(table, ids, cotangent)
    assert output.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(output, np.float32), np.asarray(plain(ids), np.float32))
    terms = np.asarray(cotangent, np.float64)
    ids = np.asarray(ids)
    np.testing.assert_allclose(grads["embedding"], [terms[ids == 0].sum(0), terms[ids == 1].sum(0)], rtol=1e-6)
