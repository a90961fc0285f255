"""The train step compiled for a GPU on a CPU-only host (roformer.deviceless), and the backend
seam tracing for another platform than the host's."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from roformer import deviceless
from roformer.errors import ConfigError
from roformer.model import backend

needs_plugin = pytest.mark.skipif(not deviceless.plugin_available(),
                                  reason="the CUDA plugin (pip install -e .[cuda13]) is not installed")


def test_without_the_plugin_a_one_line_config_error(monkeypatch):
    monkeypatch.setattr(deviceless, "plugin_available", lambda: False)
    with pytest.raises(ConfigError, match=r"pip install -e \.\[cuda13\]") as error:
        deviceless.target_devices("h100")
    assert "\n" not in str(error.value)


def test_an_unknown_gpu_kind_is_refused():
    with pytest.raises(ConfigError, match="h100"):
        deviceless.target_devices("a100x")


def test_target_config_describes_the_kind():
    text = deviceless.gpu_kind("h200").target_config()
    assert "core_count: 132" in text and "memory_bandwidth: 4800000000000" in text
    assert 'device_description_str: "NVIDIA H200"' in text and "cuda_compute_capability { major: 9 minor: 0 }" in text


def test_targeting_makes_the_seam_choose_for_that_platform():
    assert backend.on_cpu()   # the suite runs on the CPU
    with backend.targeting("gpu"):
        assert not backend.on_cpu()
        assert backend.attention_path("auto", dtype=jnp.bfloat16, head_dim=64)[0] == "cudnn"
        assert backend.active_forms() == backend.DEFAULT_FORMS["gpu"]
    assert backend.target_platform() == jax.default_backend()
    assert backend.attention_path("auto", dtype=jnp.bfloat16, head_dim=64)[0] == "explicit"


@pytest.mark.slow
@needs_plugin
def test_tiny_step_compiles_for_an_h100_with_its_gpu_kernels():
    from roformer.bench import cost, gpu_cost

    compiled, flops = cost.compile_spec(cost.StepSpec(size="tiny", seq_len=64, batch=4, vocab_size=256), "h100")
    assert flops > 0
    assert "__cudnn$fmhaSoftmax" in compiled.hlo_text and "__cublas" in compiled.hlo_text
    assert compiled.memory["peak_memory_in_bytes"] > 0
    found = gpu_cost.kernels(gpu_cost.Program.parse(compiled.hlo_text))
    categories = {kernel.category for kernel in found}
    assert {"GEMM", "attention", "optimizer", "RoPE", "residual+dropout+LayerNorm"} <= categories
    assert sum(kernel.flops for kernel in found if kernel.category == "attention") > 0
