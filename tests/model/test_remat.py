"""`model.remat` (roformer/model/encoder.py REMAT_POLICIES): checkpointing each encoder layer
changes what the backward pass keeps, not what it computes: the loss and every gradient
are those without it (to float32 rounding: XLA fuses the recomputed forward pass its own
way), dropout included; and the ablation's fingerprints leave it out."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from roformer.ablation.plan import fingerprint
from roformer.errors import ConfigError
from roformer.model import ModelConfig, RoFormerForMaskedLM


def loss_and_grads(remat: str, position: str):
    config = ModelConfig(vocab_size=50, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                         position=position, remat=remat)
    model = RoFormerForMaskedLM(config, rngs=nnx.Rngs(0))   # training mode: dropout on
    ids = jnp.asarray(np.random.default_rng(0).integers(1, 50, (2, 16)))

    @nnx.jit
    def step(model):
        return nnx.value_and_grad(lambda m: jnp.mean(m(ids) ** 2))(model)

    loss, grads = step(model)
    return float(loss), nnx.to_pure_dict(grads)


@pytest.mark.parametrize("position", ["rope", "t5"])
@pytest.mark.parametrize("remat", ["full", "dots"])
def test_remat_gives_the_loss_and_gradients_of_no_remat(remat, position):
    loss, grads = loss_and_grads("none", position)
    loss_remat, grads_remat = loss_and_grads(remat, position)
    assert loss_remat == pytest.approx(loss, rel=1e-6)
    leaves, leaves_remat = jax.tree.leaves(grads), jax.tree.leaves(grads_remat)
    assert len(leaves) == len(leaves_remat)
    for plain, checkpointed in zip(leaves, leaves_remat):
        np.testing.assert_allclose(np.asarray(checkpointed), np.asarray(plain), rtol=1e-4, atol=1e-7)


def test_an_unknown_remat_is_refused_and_fingerprints_leave_it_out():
    with pytest.raises(ConfigError, match="unknown remat 'some'"):
        ModelConfig(remat="some")
    model = ModelConfig().to_dict()
    assert fingerprint({"model": {**model, "remat": "full"}}) == fingerprint({"model": model})
