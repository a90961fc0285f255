"""roformer.train.flops: the analytic FLOPs against XLA's count, MFU and the devices' peaks."""

import jax
import pytest

from roformer.model import ModelConfig
from roformer.train import flops

from helpers.train import optimizer, synthetic_batch

pytestmark = pytest.mark.fast   # the fast lane (docs/testing.md)


@pytest.mark.parametrize("embedding_size,attention", [(None, "softmax"), (128, "softmax"), (None, "linear")])
def test_train_flops_match_xla_cost_analysis(embedding_size, attention):
    """The analytic count (matmuls only, forward x 3) against what XLA counts for the compiled
    train step of roformer.train (packed rows): XLA also counts the element-wise work (GELU,
    softmax, LayerNorm, AdamW), about 3% here, so the analytic figure is a slightly lower
    bound. Leaving out the attention scores, or counting the MLM head at every position
    instead of the masked slots, moves the ratio out of the band (to about 1.12 and 0.89).
    Linear attention on packed rows runs its quadratic form, which the count follows."""
    from roformer.train import sharding
    from roformer.train.state import TrainSetup

    cfg = ModelConfig(vocab_size=1000, hidden_size=256, num_layers=2, num_heads=4, intermediate_size=1024,
                      embedding_size=embedding_size, hidden_dropout=0.0, attention_dropout=0.0, attention=attention)
    batch_size, seq_len, predictions = 4, 128, 20
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    setup = TrainSetup(cfg, *optimizer(), mesh)
    with jax.set_mesh(mesh):
        state, rest = setup.init_state(), setup.init_rest()
        batch = sharding.global_batch(synthetic_batch(0, batch_size, seq_len, predictions), mesh)
        cost = setup.jit_train_step().lower(state, rest, batch).compile().cost_analysis()
    analytic = flops.train_flops_per_step(cfg, batch_size=batch_size, seq_len=seq_len, num_predictions=predictions,
                                          segmented=True)
    assert 1.0 <= cost["flops"] / analytic <= 1.05, (cost["flops"], analytic)


def test_mfu_and_device_peaks():
    assert flops.mfu(1e12, 2.0, 1e12, 4) == 0.5

    class Device:
        device_kind = "TPU v5 lite"
    assert flops.device_peak_flops(Device(), "bfloat16") == 197e12
    assert flops.device_peak_flops(Device(), "bfloat16", configured=1e9) == 1e9
    # Names that contain a shorter entry's: each gets its own dense bf16 peak. v5p is "TPU v5"
    # on a TPU VM; a v2/v3 device is one core, half a chip.
    for kind, peak in (("TPU v5", 459e12), ("TPU v5p", 459e12), ("TPU v3", 61.5e12), ("TPU v4", 275e12),
                       ("NVIDIA L40", 181e12), ("NVIDIA L40S", 362e12), ("NVIDIA L4", 121e12),
                       ("NVIDIA H200 NVL", 835e12), ("NVIDIA H200", 989e12), ("NVIDIA GH200 480GB", 989e12),
                       ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12)):
        Device.device_kind = kind
        assert flops.device_peak_flops(Device(), "bfloat16") == peak, kind
    # f32 at jax's default precision: TF32 tensor cores from Ampere on, the CUDA cores on a V100
    for kind, peak in (("NVIDIA H100 80GB HBM3", 494.5e12), ("NVIDIA H200", 494.5e12), ("NVIDIA A100-SXM4-80GB", 156e12),
                       ("Tesla V100-SXM2-16GB", 15.7e12), ("TPU v4", 275e12 / 4)):
        Device.device_kind = kind
        assert flops.device_peak_flops(Device(), "float32") == peak, kind
