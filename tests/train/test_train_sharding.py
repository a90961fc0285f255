"""Mesh construction, logical-axis rules, and sharding invariance of training."""
import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from roformer.model.axes import declare
from roformer.model import ModelConfig, RoFormerForMaskedLM, RoFormerForSequenceClassification
from roformer.model.positions import POSITION_SCHEMES
from roformer.train import sharding
from roformer.train.optim import make_optimizer
from roformer.train.state import TrainSetup

from helpers.train import TINY, synthetic_batch

# num_layers == num_heads: a per-layer axis has the size of the head count, which is what
# a size-based guess mistook for heads (Shaw's per-layer tables).
LAYERS_EQ_HEADS = dict(vocab_size=128, hidden_size=64, num_layers=4, num_heads=4, intermediate_size=128,
                       max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0)


@pytest.mark.fast
def test_a_mesh_whose_batch_shards_span_processes_is_refused(monkeypatch):
    """Each process feeds its own rows: with 2 processes, batch axes of 1 (tensor takes every
    device) would take one process's rows as the whole batch, silently halving it and feeding
    the copies different data. One line before anything runs; batch axes over the processes
    pass."""
    from roformer.errors import ConfigError
    from roformer.train.config import TrainConfig
    from roformer.train.loop import _make_mesh

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    tc = TrainConfig(batch_size=8)
    with pytest.raises(ConfigError, match=r"mesh data\*fsdp=1 must be a multiple of the 2 processes"):
        _make_mesh({"data": 1, "fsdp": 1, "tensor": -1}, tc)
    assert _make_mesh({"data": -1, "fsdp": 1, "tensor": 1}, tc).shape["data"] == 8
    assert _make_mesh({"data": 2, "fsdp": 1, "tensor": -1}, tc).shape["tensor"] == 4


@pytest.mark.fast
def test_mesh_shape_fills_minus_one_and_validates():
    assert sharding.mesh_shape({"data": -1, "fsdp": 2, "tensor": 1}, 8) == (4, 2, 1)
    assert sharding.mesh_shape({"data": 1, "fsdp": -1, "tensor": 2}, 8) == (1, 4, 2)
    with pytest.raises(ValueError, match="at most one"):
        sharding.mesh_shape({"data": -1, "fsdp": -1, "tensor": 1}, 8)
    with pytest.raises(ValueError, match="needs 6 devices"):
        sharding.mesh_shape({"data": 3, "fsdp": 2, "tensor": 1}, 8)
    with pytest.raises(ValueError, match="not divisible"):
        sharding.mesh_shape({"data": -1, "fsdp": 3, "tensor": 1}, 8)


@pytest.mark.fast
def test_logical_axes_of_model_params_and_rules():
    axes = sharding.param_logical_axes(abstract_params(RoFormerForMaskedLM, TINY))
    layer = axes["roformer"]["encoder"]["layer"][0]
    assert layer["attention"]["self"]["query"]["kernel"] == ("embed", "heads")
    assert layer["attention"]["output"]["dense"]["kernel"] == ("heads", "embed")
    assert layer["intermediate"]["dense"]["kernel"] == ("embed", "mlp")
    assert layer["output"]["dense"]["kernel"] == ("mlp", "embed")
    assert axes["roformer"]["embeddings"]["word_embeddings"]["embedding"] == ("vocab", "embedding")
    assert layer["output"]["LayerNorm"]["scale"] == ("norm",)
    assert layer["output"]["dense"]["bias"] == (None,)

    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    assert sharding.logical_to_spec(("embed", "mlp"), (32, 64), mesh) == P("fsdp", "tensor")
    assert sharding.logical_to_spec(("vocab", "embed"), (127, 32), mesh) == P(None, "fsdp")  # 127 % 2
    assert sharding.logical_to_spec(("embed", "embed"), (32, 32), mesh) == P("fsdp", None)  # axis used once


def abstract_params(model_cls, config, *args):
    return nnx.state(nnx.eval_shape(lambda: model_cls(config, *args, rngs=nnx.Rngs(0))), nnx.Param)


def _axis_sizes(cfg: ModelConfig) -> dict:
    """The size each logical name implies under `cfg` ("norm": the width it normalises)."""
    embedding = cfg.embedding_size or cfg.hidden_size
    return {"embed": {cfg.hidden_size}, "embedding": {embedding}, "mlp": {cfg.intermediate_size},
            "heads": {cfg.num_heads * cfg.head_dim}, "num_heads": {cfg.num_heads}, "kv": {cfg.head_dim},
            "vocab": {cfg.vocab_size}, "layers": {cfg.num_layers}, "norm": {cfg.hidden_size, embedding}}


# Every logical name has a size of its own, except heads == embed (num_heads x head_dim is
# hidden_size by construction; the attention kernels' axes are asserted by name instead).
DISTINCT_SIZES = {"vocab_size": 100, "hidden_size": 48, "num_layers": 3, "num_heads": 4, "intermediate_size": 80,
                  "embedding_size": 40}


@pytest.mark.fast
@pytest.mark.parametrize("scheme", sorted(POSITION_SCHEMES))
@pytest.mark.parametrize("overrides", [{}, {"embedding_size": 32, "pre_layer_norm": True}, DISTINCT_SIZES],
                         ids=["plain", "factorised-preln", "distinct-sizes"])
def test_every_parameter_declares_axes_that_name_its_dimensions(scheme, overrides):
    cfg = ModelConfig(**{**LAYERS_EQ_HEADS, **overrides, "position": scheme})
    if overrides is not DISTINCT_SIZES:
        assert cfg.num_layers == cfg.num_heads
    sizes = _axis_sizes(cfg)
    if overrides is DISTINCT_SIZES:
        named = {name: min(size) for name, size in sizes.items() if name not in ("heads", "norm")}
        assert len(set(named.values())) == len(named), named
    axes = {}
    for model_cls, args in ((RoFormerForMaskedLM, ()), (RoFormerForSequenceClassification, (3,))):
        params = abstract_params(model_cls, cfg, *args)
        axes[model_cls] = sharding.param_logical_axes(params)   # raises if one declares none
        for path, var in nnx.to_flat_state(params):
            names, where = var.get_metadata()["out_sharding"], "/".join(map(str, path))
            assert len(names) == len(var.shape), where
            for name, dim in zip(names, var.shape):
                assert name is None or dim in sizes[name], f"{where} {var.shape}: {name!r} is not {dim}"
    mlm = axes[RoFormerForMaskedLM]
    if scheme == "shaw":
        assert mlm["roformer"]["position"]["relative_key"] == ("layers", None, "kv")
        assert mlm["roformer"]["position"]["relative_value"] == ("layers", None, "kv")
    assert mlm["cls"]["predictions"]["transform"]["dense"]["kernel"] == ("embed", "embedding")


@pytest.mark.fast
def test_mislabelled_parameters_of_the_size_guess_are_placed_by_their_names():
    cfg = ModelConfig(**{**LAYERS_EQ_HEADS, "position": "shaw"})
    params = abstract_params(RoFormerForMaskedLM, cfg)
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    specs = sharding.state_shardings(nnx.to_pure_dict(params), sharding.param_logical_axes(params), mesh)
    assert specs["roformer"]["position"]["relative_key"].spec == P(None, None, None)   # layers stay whole
    assert specs["cls"]["predictions"]["transform"]["dense"]["kernel"].spec == P("fsdp", None)
    layer = specs["roformer"]["encoder"]["layer"][0]
    assert layer["attention"]["self"]["query"]["kernel"].spec == P("fsdp", "tensor")
    assert layer["attention"]["output"]["dense"]["kernel"].spec == P("tensor", "fsdp")


@pytest.mark.fast
def test_a_parameter_without_declared_axes_is_refused_by_path():
    class Scheme(nnx.Module):
        def __init__(self):
            self.declared = nnx.Param(jax.numpy.zeros((4, 8)), **declare("layers", "embed"))
            self.table = nnx.Param(jax.numpy.zeros((4, 8)))

    with pytest.raises(ValueError, match="parameter table declares no logical axes"):
        sharding.param_logical_axes(nnx.state(Scheme(), nnx.Param))

    class Typo(nnx.Module):
        def __init__(self):
            self.table = nnx.Param(jax.numpy.zeros((4, 8)), out_sharding=("layer", "embed"),
                                   eager_sharding=False)

    with pytest.raises(ValueError, match=r"parameter table declares logical axes \['layer'\]"):
        sharding.param_logical_axes(nnx.state(Typo(), nnx.Param))
    with pytest.raises(ValueError, match="unknown logical axis names"):
        declare("layer", "embed")


def _loss_trajectory(mesh_cfg, config=TINY, num_devices=8, num_steps=3):
    mesh = sharding.make_mesh(mesh_cfg, jax.devices()[:num_devices])
    tx, schedule = make_optimizer(learning_rate=1e-3, warmup_steps=1, total_steps=10, decay="linear",
                                  weight_decay=0.01, b1=0.9, b2=0.999, eps=1e-6, clip_norm=1.0)
    setup = TrainSetup(config, tx, schedule, mesh)
    with jax.set_mesh(mesh):
        state, rest = setup.init_state(), setup.init_rest()
        step = setup.jit_train_step()
        losses = []
        for i in range(num_steps):
            state, metrics = step(state, rest, sharding.global_batch(synthetic_batch(i % 2), mesh))
            losses.append(float(metrics["loss"]))
        return np.array(losses), jax.tree.map(lambda x: x.sharding.spec, state["params"])


def test_data_parallel_and_fsdp_tensor_match_single_device():
    assert jax.device_count() == 8, "tests/conftest.py should give 8 virtual CPU devices"
    single, _ = _loss_trajectory({"data": 1, "fsdp": 1, "tensor": 1}, num_devices=1)
    data_parallel, _ = _loss_trajectory({"data": -1, "fsdp": 1, "tensor": 1})
    fsdp_tensor, specs = _loss_trajectory({"data": 2, "fsdp": 2, "tensor": 2})
    spec = specs["roformer"]["encoder"]["layer"][0]["intermediate"]["dense"]["kernel"]
    assert spec == P("fsdp", "tensor")        # really sharded, not replicated
    assert single[-1] < single[0]
    np.testing.assert_allclose(data_parallel, single, atol=1e-4)
    np.testing.assert_allclose(fsdp_tensor, single, atol=1e-4)


def test_shaw_with_as_many_layers_as_heads_on_data_fsdp_tensor_matches_single_device():
    cfg = ModelConfig(**{**LAYERS_EQ_HEADS, "position": "shaw", "shaw_max_distance": 4})
    single, _ = _loss_trajectory({"data": 1, "fsdp": 1, "tensor": 1}, cfg, num_devices=1)
    sharded, specs = _loss_trajectory({"data": 2, "fsdp": 2, "tensor": 2}, cfg)
    assert specs["roformer"]["position"]["relative_key"] == P(None, None, None)
    assert specs["roformer"]["encoder"]["layer"][3]["attention"]["self"]["value"]["kernel"] == P("fsdp", "tensor")
    assert single[-1] < single[0]
    np.testing.assert_allclose(sharded, single, atol=1e-4)
