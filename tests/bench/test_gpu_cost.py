"""The GPU cost model's reading of a program and its arithmetic, on a small hand-written
optimised HLO module in the text form XLA's GPU compiler prints (runs anywhere: no jax)."""
from __future__ import annotations

import dataclasses

import pytest

from roformer import cli
from roformer.bench import cost, gpu_cost
from roformer.errors import ConfigError

pytestmark = pytest.mark.fast   # the fast lane (docs/testing.md)

# Stack frames as XLA prints them: parent_frame_id is the parent's id + 1 (1: none).
PROGRAM = r'''HloModule jit_train_step, is_scheduled=true

FileNames
1 "steps.py"

FunctionNames
1 "train_step"
2 "LayerNorm.__call__"
3 "RoFormerEmbeddings.__call__"
4 "scale_by_adam.<locals>.update_fn"
5 "apply_rope"
6 "RoFormerLMPredictionHead.__call__"

FileLocations
1 {file_name_id=1 function_name_id=1 line=1 end_line=1 column=1 end_column=2}
2 {file_name_id=1 function_name_id=2 line=2 end_line=2 column=1 end_column=2}
3 {file_name_id=1 function_name_id=3 line=3 end_line=3 column=1 end_column=2}
4 {file_name_id=1 function_name_id=4 line=4 end_line=4 column=1 end_column=2}
5 {file_name_id=1 function_name_id=5 line=5 end_line=5 column=1 end_column=2}
6 {file_name_id=1 function_name_id=6 line=6 end_line=6 column=1 end_column=2}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=2}
3 {file_location_id=3 parent_frame_id=2}
4 {file_location_id=2 parent_frame_id=4}
5 {file_location_id=4 parent_frame_id=2}
6 {file_location_id=5 parent_frame_id=2}
7 {file_location_id=6 parent_frame_id=2}

%region_add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add = f32[] add(%a, %b), metadata={op_name="add" stack_frame_id=4}
}

%fused_norm (p0: bf16[64,768], p1: bf16[64,768]) -> bf16[64,768] {
  %p0 = bf16[64,768]{1,0} parameter(0)
  %p1 = bf16[64,768]{1,0} parameter(1)
  ROOT %sum = bf16[64,768]{1,0} add(%p0, %p1), metadata={op_name="add" stack_frame_id=2}
}

%fused_reduce (p0: bf16[64,768]) -> f32[768] {
  %p0 = bf16[64,768]{1,0} parameter(0)
  %c = f32[64,768]{1,0} convert(%p0), metadata={op_name="convert" stack_frame_id=2}
  %zero = f32[] constant(0)
  ROOT %r = f32[768]{0} reduce(%c, %zero), dimensions={0}, to_apply=%region_add, metadata={stack_frame_id=2}
}

%fused_rope (p0: bf16[64,768]) -> bf16[64,768] {
  %p0 = bf16[64,768]{1,0} parameter(0)
  ROOT %n = bf16[64,768]{1,0} negate(%p0), metadata={op_name="neg" stack_frame_id=6}
}

%fused_adam (p0: f32[768]) -> f32[768] {
  %p0 = f32[768]{0} parameter(0)
  ROOT %m = f32[768]{0} multiply(%p0, %p0), metadata={op_name="mul" stack_frame_id=5}
}

%body (s: (s32[], f32[768])) -> (s32[], f32[768]) {
  %s = (s32[], f32[768]{0}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %x = f32[768]{0} get-tuple-element(%s), index=1
  %u = f32[768]{0} fusion(%x), kind=kLoop, calls=%fused_adam
  ROOT %t = (s32[], f32[768]{0}) tuple(%i, %u)
}

%cond (s: (s32[], f32[768])) -> pred[] {
  %s = (s32[], f32[768]{0}) parameter(0)
  ROOT %yes = pred[] constant(true)
}

ENTRY %main.1 (x: bf16[64,768], w: bf16[768,768], q: bf16[2,16,4,8], g: f32[768]) -> f32[768] {
  %x = bf16[64,768]{1,0} parameter(0)
  %w = bf16[768,768]{1,0} parameter(1)
  %q = bf16[2,16,4,8]{3,2,1,0} parameter(2)
  %g = f32[768]{0} parameter(3)
  %gemm = (bf16[64,768]{1,0}, s8[4194304]{0}) custom-call(%x, %w), custom_call_target="__cublas$lt$matmul", metadata={op_name="dot_general" stack_frame_id=1}, backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %y = bf16[64,768]{1,0} get-tuple-element(%gemm), index=0
  %norm = bf16[64,768]{1,0} fusion(%y, %x), kind=kLoop, calls=%fused_norm, metadata={stack_frame_id=2}
  %colsum = f32[768]{0} fusion(%norm), kind=kInput, calls=%fused_reduce, metadata={stack_frame_id=2}
  %rope = bf16[64,768]{1,0} fusion(%norm), kind=kLoop, calls=%fused_rope, metadata={stack_frame_id=6}
  %fwd = (bf16[2,4,16,8]{3,1,2,0}, f32[2,4,16]{2,1,0}, u8[0]{0}) custom-call(%q, %q, %q), custom_call_target="__cudnn$fmhaSoftmax", backend_config={"cudnn_fmha_backend_config": {"fmha_scale": 0.125, "intermediate_tensor_shape": {"element_type": "BF16", "dimensions": ["2", "4", "16", "16"], "tuple_shapes": []}}}
  %bwd = (bf16[2,16,4,8]{3,2,1,0}, bf16[2,16,4,8]{3,2,1,0}, bf16[2,16,4,8]{3,2,1,0}, u8[0]{0}) custom-call(%q, %q), custom_call_target="__cudnn$fmhaSoftmaxBackward", backend_config={"cudnn_fmha_backend_config": {"intermediate_tensor_shape": {"element_type": "BF16", "dimensions": ["2", "4", "16", "16"], "tuple_shapes": []}}}
  %zero = s32[] constant(0)
  %init = (s32[], f32[768]{0}) tuple(%zero, %colsum)
  %loop = (s32[], f32[768]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %out = f32[768]{0} get-tuple-element(%loop), index=1
}
'''

ACTIVATIONS = 64 * 768 * 2   # one bf16[64,768]


@pytest.fixture(scope="module")
def found():
    return {kernel.name: kernel for kernel in gpu_cost.kernels(gpu_cost.Program.parse(PROGRAM))}


def test_frames_read_as_xla_prints_them():
    program = gpu_cost.Program.parse(PROGRAM)
    assert program.chain(4) == ["LayerNorm.__call__", "RoFormerEmbeddings.__call__", "train_step"]
    assert program.chain(6) == ["apply_rope", "train_step"]


def test_every_kernel_found_with_its_category(found):
    assert {name: kernel.category for name, kernel in found.items()} == {
        "gemm": "GEMM", "norm": "residual+dropout+LayerNorm", "colsum": "residual+dropout+LayerNorm",
        "rope": "RoPE", "fwd": "attention", "bwd": "attention", "u": "optimizer"}


def test_a_reducer_shared_with_another_site_does_not_decide_the_category(found):
    # %region_add carries an embeddings frame; the reduction it serves is the norm's
    assert found["colsum"].category == "residual+dropout+LayerNorm"


def test_bytes_read_once_per_operand_and_without_the_library_workspace(found):
    assert found["gemm"].bytes == 2 * ACTIVATIONS + 768 * 768 * 2
    assert found["norm"].bytes == 3 * ACTIVATIONS
    assert found["colsum"].bytes == ACTIVATIONS + 768 * 4


def test_flops_of_a_library_gemm_and_of_fused_attention(found):
    assert found["gemm"].flops == 2 * 64 * 768 * 768
    forward = 4 * 2 * 4 * 16 * 16 * 8
    assert found["fwd"].flops == forward and not found["fwd"].backward
    assert found["bwd"].flops == 2 * forward and found["bwd"].backward


def test_a_while_loop_body_counts_its_trip_count(found):
    assert found["u"].calls == 3


def test_prediction_arithmetic(found):
    calibration = gpu_cost.Calibration("test", peak_flops=1e15, memory_bandwidth=2e12, bandwidth_fraction=0.5,
                                       gemm_flops=1e14, attention_fwd_flops=1e13, attention_bwd_flops=5e12,
                                       launch_s=2e-6, sources=())
    prediction = gpu_cost.predict(list(found.values()), calibration)
    bandwidth = 1e12
    gemm = max(found["gemm"].flops / 1e14, found["gemm"].bytes / bandwidth)
    attention = max(found["fwd"].flops / 1e13, found["fwd"].bytes / bandwidth) \
        + max(found["bwd"].flops / 5e12, found["bwd"].bytes / bandwidth)
    memory = (found["norm"].bytes + found["colsum"].bytes + found["rope"].bytes + 3 * found["u"].bytes) / bandwidth
    launches = 1 + 2 + 3 + 3
    assert prediction.kernels == launches
    assert prediction.step_s == pytest.approx(gemm + attention + memory + launches * 2e-6)
    rows = {row["category"]: row for row in prediction.rows}
    assert rows["optimizer"]["kernels"] == 3
    assert rows["GEMM"]["ms"] == pytest.approx(gemm * 1e3)
    assert prediction.mfu(1e9, 1e15) == pytest.approx(1e9 / prediction.step_s / 1e15)


def test_calibrations_name_their_sources_and_print():
    for calibration in gpu_cost.CALIBRATIONS.values():
        assert calibration.sources and calibration.sources[0].startswith("docs/results/")
        assert 0 < calibration.bandwidth < calibration.memory_bandwidth
        assert {row["constant"] for row in gpu_cost.calibration_rows(calibration)} >= {"GEMM rate", "sources"}


def test_variants_parse_into_step_specs():
    base = cost.StepSpec(size="tiny", forms=None)
    name, spec = cost.parse_variant("fast:forms=bf16_mlm_logits,rope_half_pairs;hidden_dropout=0;batch=128;"
                                    "xla_gpu_enable_triton_gemm=true", base)
    assert name == "fast"
    assert spec == dataclasses.replace(base, forms=("bf16_mlm_logits", "rope_half_pairs"), hidden_dropout=0.0,
                                       batch=128, compiler_options={"xla_gpu_enable_triton_gemm": True})
    assert cost.parse_variant("none:forms=", base)[1].forms == ()
    with pytest.raises(ConfigError, match="unknown key"):
        cost.parse_variant("x:colour=red", base)
    with pytest.raises(ConfigError, match="NAME:KEY=VALUE"):
        cost.parse_variant("no_settings", base)


def test_a_variant_and_the_baseline_can_set_the_layers_gradient_checkpointing():
    """`--variant full:remat=full` and `--remat dots` compile the step with model.remat set."""
    name, spec = cost.parse_variant("full:remat=full", cost.StepSpec(size="tiny"))
    assert name == "full" and spec.remat == "full" and spec.model_config().remat == "full"
    command = cli.CommandFlags("bench cost")
    cost.define_flags(command)
    assert cost.base_spec(command.parse(["--remat", "dots"])[0]).model_config().remat == "dots"
    assert cost.base_spec(command.parse([])[0]).model_config().remat == "none"
    with pytest.raises(ConfigError, match="remat"):
        cost.parse_variant("bad:remat=some", cost.StepSpec(size="tiny"))[1].model_config()
