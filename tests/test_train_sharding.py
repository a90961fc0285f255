"""Mesh construction, logical-axis rules, and sharding invariance of training."""
import jax
import ml_collections
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from roformer.model import ModelConfig, RoFormerForMaskedLM
from roformer.train import sharding
from roformer.train.optim import make_optimizer
from roformer.train.state import TrainSetup

TINY = ModelConfig(vocab_size=128, hidden_size=32, num_layers=1, num_heads=4, intermediate_size=64,
                   max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0)


def synthetic_batch(seed: int, batch: int = 8, length: int = 32, preds: int = 6, vocab: int = 128):
    """A packed MLM batch in the pipeline's format: two documents per row."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(5, vocab, (batch, length)).astype(np.int32)
    split = length // 2
    positions = np.concatenate([np.arange(split), np.arange(length - split)])[None].repeat(batch, 0)
    segments = np.concatenate([np.ones(split), 2 * np.ones(length - split)])[None].repeat(batch, 0)
    masked = np.sort(np.stack([rng.choice(length, preds, replace=False) for _ in range(batch)]), 1)
    labels = np.take_along_axis(ids, masked, 1)
    inputs = ids.copy()
    np.put_along_axis(inputs, masked, 4, 1)
    weights = np.ones((batch, preds), np.float32)
    weights[:, -1] = 0.0                      # a padding slot
    return {"input_ids": inputs, "token_type_ids": np.zeros_like(ids),
            "positions": positions.astype(np.int32), "segment_ids": segments.astype(np.int32),
            "masked_positions": masked.astype(np.int32), "masked_labels": labels.astype(np.int32),
            "masked_weights": weights}


def test_mesh_shape_fills_minus_one_and_validates():
    assert sharding.mesh_shape({"data": -1, "fsdp": 2, "tensor": 1}, 8) == (4, 2, 1)
    assert sharding.mesh_shape({"data": 1, "fsdp": -1, "tensor": 2}, 8) == (1, 4, 2)
    with pytest.raises(ValueError, match="at most one"):
        sharding.mesh_shape({"data": -1, "fsdp": -1, "tensor": 1}, 8)
    with pytest.raises(ValueError, match="needs 6 devices"):
        sharding.mesh_shape({"data": 3, "fsdp": 2, "tensor": 1}, 8)
    with pytest.raises(ValueError, match="not divisible"):
        sharding.mesh_shape({"data": -1, "fsdp": 3, "tensor": 1}, 8)


def test_logical_axes_of_model_params_and_rules():
    params = nnx.state(nnx.eval_shape(lambda: RoFormerForMaskedLM(TINY, rngs=nnx.Rngs(0))), nnx.Param)
    axes = sharding.param_logical_axes(params, TINY)
    layer = axes["roformer"]["encoder"]["layer"][0]
    assert layer["attention"]["self"]["query"]["kernel"] == ("embed", "heads")
    assert layer["attention"]["output"]["dense"]["kernel"] == ("heads", "embed")
    assert layer["intermediate"]["dense"]["kernel"] == ("embed", "mlp")
    assert layer["output"]["dense"]["kernel"] == ("mlp", "embed")
    assert axes["roformer"]["embeddings"]["word_embeddings"]["embedding"] == ("vocab", "embed")
    assert layer["output"]["LayerNorm"]["scale"] == (None,)

    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    assert sharding.logical_to_spec(("embed", "mlp"), (32, 64), mesh) == P("fsdp", "tensor")
    assert sharding.logical_to_spec(("vocab", "embed"), (127, 32), mesh) == P(None, "fsdp")  # 127 % 2
    assert sharding.logical_to_spec(("embed", "embed"), (32, 32), mesh) == P("fsdp", None)  # axis used once


def _loss_trajectory(mesh_cfg, num_devices=8, num_steps=3):
    mesh = sharding.make_mesh(mesh_cfg, jax.devices()[:num_devices])
    train_cfg = ml_collections.ConfigDict(dict(
        learning_rate=1e-3, warmup_steps=1, steps=10, decay="linear", weight_decay=0.01,
        b1=0.9, b2=0.999, eps=1e-6, clip_norm=1.0))
    tx, schedule = make_optimizer(train_cfg)
    setup = TrainSetup(TINY, tx, schedule, mesh)
    with jax.set_mesh(mesh):
        state, rest = setup.init_state(), setup.init_rest()
        step = setup.jit_train_step()
        losses = []
        for i in range(num_steps):
            state, metrics = step(state, rest, sharding.global_batch(synthetic_batch(i % 2), mesh))
            losses.append(float(metrics["loss"]))
        kernel = state["params"]["roformer"]["encoder"]["layer"][0]["intermediate"]["dense"]["kernel"]
        return np.array(losses), kernel.sharding.spec


def test_data_parallel_and_fsdp_tensor_match_single_device():
    assert jax.device_count() == 8, "tests/conftest.py should give 8 virtual CPU devices"
    single, _ = _loss_trajectory({"data": 1, "fsdp": 1, "tensor": 1}, num_devices=1)
    data_parallel, _ = _loss_trajectory({"data": -1, "fsdp": 1, "tensor": 1})
    fsdp_tensor, spec = _loss_trajectory({"data": 2, "fsdp": 2, "tensor": 2})
    assert spec == P("fsdp", "tensor")        # really sharded, not replicated
    assert single[-1] < single[0]
    np.testing.assert_allclose(data_parallel, single, atol=1e-4)
    np.testing.assert_allclose(fsdp_tensor, single, atol=1e-4)
