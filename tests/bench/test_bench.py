"""Smoke tests of the benchmarks: tiny shapes, one or two rounds, well-formed rows and JSON.

Timings are not checked (the machine is shared); only that each benchmark runs
end to end through `python -m roformer.bench`'s main and reports what it should.
"""
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from helpers import COMPILE_FAST_FLAGS, needs_torch, needs_transformers, patient

from roformer import host_memory
from roformer.bench import __main__ as bench_main
from roformer.bench import flags as flags_bench
from roformer.bench import rope as rope_bench
from roformer.bench.common import alternate, format_table, ratio_stats
from roformer.bench.hf import flax_port_peer
from roformer.machine import cpu_identity
from roformer.model import ModelConfig, rope

REPO = Path(__file__).resolve().parents[2]


def run_bench(tmp_path, *argv):
    out = tmp_path / "result.json"
    assert bench_main.main([*argv, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["benchmark"] == argv[0]
    assert result["machine"]["platform"] == "cpu"
    assert result["machine"]["cpu"] == cpu_identity()   # which processor, also on a VM of one name
    # like the training commands, the benchmark process kept freed host memory (glibc, CPU only)
    expected = platform.libc_ver()[0] == "glibc" and os.environ.get(host_memory.ENV) != "0"
    assert result["machine"]["host_memory_retained"] is expected
    assert result["rows"]
    assert "target" not in out.read_text()   # benchmarks report figures; targets live in the docs
    return result


def within(row, column):
    return row[f"{column}_min"] <= row[column] <= row[f"{column}_max"]


@pytest.mark.fast
def test_ratio_stats_and_alternate():
    assert ratio_stats([2.0, 4.0, 3.0], [1.0, 2.0, 1.0]) == {"median": 2.0, "min": 2.0, "max": 3.0}
    with pytest.raises(ValueError, match="equally long"):
        ratio_stats([1.0], [1.0, 2.0])
    times = alternate({"a": lambda: 1, "b": lambda: 2}, rounds=3, iters=1, warmup=0)
    assert set(times) == {"a", "b"} and all(len(t) == 3 for t in times.values())
    # The order rotates and runs backwards every other round: no variant always follows the
    # same one or sits at the same place in a round.
    order = []
    alternate({name: (lambda name=name: order.append(name)) for name in "abc"}, rounds=4, iters=1, warmup=0)
    assert "".join(order) == "abc" + "acb" + "cab" + "cba"
    assert format_table([{"x": 1.23456, "y": "z"}]).splitlines()[2] == "| 1.235 | z |"


def test_rope_bench_covers_lengths_batches_and_passes(tmp_path, capsys):
    result = run_bench(tmp_path, "rope", "--lengths=8,16", "--batches=1,2", "--heads", "2",
                       "--head-dim", "8", "--rounds", "2", "--iters", "1")
    variants = {"copy", "complex", "complex_half", "complex_stack", "complex_pairs", "real_interleaved",
                "rotate_half", "cis_table", "call"}
    rows = result["rows"]
    assert {(r["batch"], r["length"], r["pass"]) for r in rows} == {
        (b, n, p) for b in (1, 2) for n in (8, 16) for p in ("fwd", "fwd+bwd")}
    assert len(rows) == 8 * len(variants) and {r["variant"] for r in rows} == variants
    assert {r["dtype"] for r in rows} == {"float32"}
    assert all(r["ms"] > 0 and within(r, "x_copy") and within(r, "x_real") for r in rows)
    for row in rows:
        if row["variant"] in ("copy", row["fastest_real"]):   # each shape's references
            assert row["x_copy" if row["variant"] == "copy" else "x_real"] == 1.0
    printed = capsys.readouterr().out
    assert "| variant |" in printed and "| complex |" in printed and "| x_real |" in printed


@pytest.mark.fast
def test_rope_bench_pairs_variant_is_the_models_product_and_its_vjp():
    x = jax.random.normal(jax.random.key(0), (2, 8, 3, 16))
    cotangent = jax.random.normal(jax.random.key(1), x.shape)
    inv_freq, _ = rope.rope_frequencies(16)
    cis = rope.rope_cis(jax.numpy.broadcast_to(jax.numpy.arange(8), (2, 8)), inv_freq)
    as_pairs = (2, 8, 3, 8, 2)
    out, vjp = jax.vjp(lambda p: rope_bench.complex_pairs(p, cis), x.reshape(as_pairs))
    ref, ref_vjp = jax.vjp(lambda x: rope.apply_rope(x, cis), x)
    assert out.shape == as_pairs
    np.testing.assert_allclose(out.reshape(x.shape), ref, atol=1e-6)
    np.testing.assert_allclose(vjp(cotangent.reshape(as_pairs))[0].reshape(x.shape), ref_vjp(cotangent)[0],
                               atol=1e-6)


def test_step_and_scaling_bench(tmp_path, capsys):
    common = ["--vocab-size", "64", "--rounds", "1", "--iters", "1", "--peak-size", "128"]
    # the accelerator path's switches: fused attention needs attention dropout off
    result = run_bench(tmp_path, "step", "--sizes", "tiny", "--seq-lens", "16", "--batch", "2",
                       "--schemes", "rope", "--attention-impl", "xla", "--attention-dropout", "0",
                       "--dropout-rng-impls=threefry2x32,rbg", "--hidden-dropouts=0.1,0", *common)
    rows = {(r["dropout_rng"], r["hidden_dropout"]): r for r in result["rows"]}
    assert set(rows) == {(i, h) for i in ("threefry2x32", "rbg") for h in (0.1, 0)}
    assert rows["threefry2x32", 0]["x_dropout_ref"] == 1.0 and rows["rbg", 0]["x_dropout_ref"] > 0
    assert rows["rbg", 0.1]["x_hidden_ref"] == 1.0 and rows["rbg", 0]["x_hidden_ref"] > 0
    assert all("x_learned" not in r for r in rows.values())   # no learned baseline among the schemes
    assert all(r["tokens_s"] > 0 and r["mfu"] > 0 and r["GFLOP_step"] > 0 for r in rows.values())
    # the first step's loss, from the same initial parameters and batch for every dropout key
    assert len({r["loss_step1"] for r in rows.values() if r["hidden_dropout"] == 0}) == 1
    # a line per compiled variant while it runs, not silence until the table
    progress = capsys.readouterr().err
    assert progress.count("step tiny/16/2 rope: compiling ...") == 4 and "compiled in" in progress

    result = run_bench(tmp_path, "scaling", "--size", "tiny", "--seq-lens", "32", "--tokens", "64",
                       "--schemes=learned,rope", *common)
    rows = {r["scheme"]: r for r in result["rows"]}
    assert [(r["scheme"], r["seq"], r["batch"]) for r in result["rows"]] == [("learned", 32, 2), ("rope", 32, 2)]
    assert rows["learned"]["x_learned"] == 1.0 and rows["rope"]["x_learned"] > 0
    assert rows["rope"]["growth"] == 1.0 and rows["rope"]["ms_per_1k_tokens"] > 0


def test_profile_bench_splits_a_traced_step_by_kind(tmp_path):
    result = run_bench(tmp_path, "profile", "--size", "tiny", "--seq-len", "16", "--batch", "2",
                       "--vocab-size", "64", "--steps", "1", "--top", "5", "--trace-dir", str(tmp_path / "trace"),
                       "--attention-impl", "cudnn", "--attention-dropout", "0")
    # no cuDNN on a CPU: the profile goes on with XLA attention, and says so first
    assert result["notes"][0].startswith("cuDNN attention failed (") and "profiled with XLA attention" in result["notes"][0]
    kinds = {row["kind"]: row for row in result["rows"]}
    assert list(kinds) == ["matmul", "layout copy", "reduction", "random bits", "elementwise and other"]
    assert kinds["matmul"]["ms_step"] > 0 and kinds["random bits"]["ms_step"] > 0   # dots; dropout masks
    assert abs(sum(row["share"] for row in result["rows"]) - 1.0) < 1e-9
    top = result["tables"]["most expensive ops"]["rows"]
    assert len(top) == 5 and all(row["ms_step"] > 0 and row["kind"] in kinds for row in top)
    assert all((row["GFLOP/s"] is None) == (row["kind"] != "matmul") for row in top)
    assert all(row["GB/s"] > 0 for row in top)
    assert result["step_ms"] > 0 and result["traced_ms"] > 0
    kernel = result["kernel"]
    assert kernel["page_faults_per_step"] >= 0 and kernel["user_cpu_ms_per_step"] > 0
    assert kernel["system_cpu_ms_per_step"] >= 0
    assert any(note.startswith("per untraced step: ") for note in result["notes"])
    # the union of the ops' intervals: at most the per-kind sum, which counts overlaps twice
    assert 0 < result["busy_ms"] <= result["traced_ms"] + 1e-6
    assert 0 <= result["concurrent_ms"] <= result["busy_ms"]
    assert any(note.startswith("ops running: ") for note in result["notes"])
    matmuls = {row["matmul"]: row for row in result["tables"]["the step's matmul shapes alone"]["rows"]}
    assert list(matmuls) == ["q/k/v/output projection", "feed-forward in", "feed-forward out",
                             "attention scores (batched)", "attention values (batched)",
                             "MLM decoder (masked positions)", "2,048^2 matmul"]
    assert all(row["ms"] > 0 and row["GFLOP/s"] > 0 and row["cpu_per_wall"] > 0 for row in matmuls.values())
    assert list((tmp_path / "trace").rglob("*.xplane.pb"))   # kept for TensorBoard / Perfetto
    assert "ENTRY" in (tmp_path / "trace" / "train_step.hlo.txt").read_text()
    # the kept trace read again, as one copied from another machine is
    again = run_bench(tmp_path, "profile", "--from-trace", str(tmp_path / "trace"), "--steps", "1", "--top", "5")
    assert [row["kind"] for row in again["rows"]] == list(kinds)
    assert again["traced_ms"] == pytest.approx(result["traced_ms"])
    assert [row["op"] for row in again["tables"]["most expensive ops"]["rows"]] == [row["op"] for row in top]


@pytest.mark.fast
def test_op_events_names_gpu_kernels_by_their_instruction(tmp_path):
    import gzip
    import json

    from roformer.bench.profile import op_events
    gpu = [   # host launch events named after instructions; kernels with args.hlo_op
        {"ph": "X", "name": "loop_add_fusion.1", "ts": 0, "dur": 5, "pid": 1},
        {"ph": "X", "name": "loop_add_fusion_1", "ts": 10, "dur": 2, "pid": 2, "args": {"hlo_op": "loop_add_fusion.1"}},
        {"ph": "X", "name": "sm90_xmma_gemm_bf16bf16", "ts": 12, "dur": 30, "pid": 2,
         "args": {"hlo_op": "custom-call.3", "hlo_module": "jit_train_step"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:GPU:0"}},
    ]
    (tmp_path / "gpu").mkdir()
    with gzip.open(tmp_path / "gpu" / "h.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": gpu}, f)
    assert op_events(tmp_path / "gpu") == [("loop_add_fusion.1", 10e-6, 12e-6), ("custom-call.3", 12e-6, 42e-6)]
    cpu = [{"ph": "X", "name": "dot.2", "ts": 1, "dur": 3}, {"ph": "i", "name": "marker", "ts": 2}]
    (tmp_path / "cpu").mkdir()
    with gzip.open(tmp_path / "cpu" / "h.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": cpu}, f)
    assert op_events(tmp_path / "cpu") == [("dot.2", 1e-6, 4e-6)]


@pytest.mark.fast
def test_kernels_run_from_a_command_buffer_are_matched_by_their_kernel_names(tmp_path):
    """XLA runs a GPU step's kernels in CUDA graphs: every kernel then carries the command
    buffer as its hlo_op, so the kernel's own name must say which instruction it is."""
    import gzip
    import json

    from roformer.bench.profile import op_events, step_breakdown
    buffer = {"hlo_op": "command_buffer_1", "hlo_module": "jit_train_step"}
    events = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "X", "name": "loop_add_fusion_1", "ts": 0, "dur": 2, "pid": 1, "args": buffer},
        {"ph": "X", "name": "input_reduce_fusion", "ts": 2, "dur": 3, "pid": 1, "args": buffer},
        {"ph": "X", "name": "nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NNN", "ts": 5, "dur": 10, "pid": 1, "args": buffer},
        {"ph": "X", "name": "cudnn_generated_fort_native_sdpa_sm90_flash_fprop", "ts": 15, "dur": 4, "pid": 1, "args": buffer},
        {"ph": "X", "name": "BUFFER_FLUSH", "ts": 0, "dur": 50, "pid": 2},
    ]
    with gzip.open(tmp_path / "vm.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    program = {"loop_add_fusion.1": {"kind": "elementwise and other", "shape": "f32[8]", "op": "add", "flops": 0.0, "bytes": 64},
               "input_reduce_fusion": {"kind": "reduction", "shape": "f32[1]", "op": "reduce_sum", "flops": 0.0, "bytes": 36}}
    breakdown = step_breakdown(op_events(tmp_path), program, steps=1, top=10, library_kernels=True)
    ms = {row["kind"]: row["ms_step"] for row in breakdown["rows"]}
    assert ms == pytest.approx({"matmul": 0.014, "layout copy": 0, "reduction": 0.003, "random bits": 0,
                                "elementwise and other": 0.002})
    assert breakdown["traced_ms"] == pytest.approx(0.019) and breakdown["busy_ms"] == pytest.approx(0.019)
    assert [op["op"] for op in breakdown["top"]][:2] == ["nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NNN",
                                                        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop"]
    # without library kernels (a CPU trace) only instructions count
    program = {name: entry for name, entry in program.items() if not name.startswith(("nvjet", "cudnn"))}
    assert step_breakdown(op_events(tmp_path), program, 1, 10, library_kernels=False)["traced_ms"] == pytest.approx(0.005)


@pytest.mark.fast
def test_busy_and_concurrent_time_of_intervals():
    from roformer.bench.profile import busy_and_concurrent
    # [0, 4) and [1, 3) overlap for 2 s; [5, 6) alone; a gap [4, 5) counts for neither
    busy, concurrent = busy_and_concurrent([(0.0, 4.0), (1.0, 3.0), (5.0, 6.0)])
    assert (busy, concurrent) == (5.0, 2.0)
    busy, concurrent = busy_and_concurrent([(0.0, 2.0), (0.5, 1.0), (0.75, 3.0)])   # three deep at 0.75-1
    assert (busy, concurrent) == (3.0, 1.5)
    assert busy_and_concurrent([]) == (0.0, 0.0)


@pytest.mark.fast
def test_matmul_shapes_of_a_step():
    from roformer.bench.profile import matmul_shapes
    config = ModelConfig.from_preset("mini", vocab_size=1000)
    shapes = matmul_shapes(config, batch=2, seq_len=16)
    assert shapes["q/k/v/output projection"][:2] == ((32, 256), (256, 256))
    assert shapes["feed-forward out"][:2] == ((32, 1024), (1024, 256))
    assert shapes["attention scores (batched)"][:2] == ((8, 16, 64), (8, 16, 64))   # batch x heads
    assert shapes["attention values (batched)"][:2] == ((8, 16, 16), (8, 16, 64))
    assert shapes["MLM decoder (masked positions)"][:2] == ((2 * 3, 256), (1000, 256))   # round(0.15 x 16) + 1


@pytest.mark.fast
def test_parse_program_kinds_of_instructions():
    from roformer.bench.profile import parse_program
    hlo = """HloModule m

%fused_dot (p0: f32[4,4], p1: f32[4,4]) -> f32[4,4] {
  %p0 = f32[4,4]{1,0} parameter(0)
  %p1 = f32[4,4]{1,0} parameter(1)
  ROOT %dot.1 = f32[4,4]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_transpose (p0: f32[4,4]) -> f32[16] {
  %p0 = f32[4,4]{1,0} parameter(0)
  %transpose.1 = f32[4,4]{0,1} transpose(%p0), dimensions={1,0}
  ROOT %bitcast.1 = f32[16]{0} bitcast(%transpose.1)
}

ENTRY %main (a: f32[4,4], b: f32[4,4]) -> f32[4,4] {
  %a = f32[4,4]{1,0} parameter(0)
  %b = f32[4,4]{1,0} parameter(1)
  %a3 = f32[2,5,4]{2,1,0} parameter(2)
  %b3 = f32[2,5,3]{2,1,0} parameter(3)
  %mm = f32[4,4]{1,0} fusion(%a, %b), kind=kCustom, calls=%fused_dot, metadata={op_name="jit(f)/dot_general"}
  %bmm = f32[2,4,3]{2,1,0} dot(%a3, %b3), lhs_batch_dims={0}, lhs_contracting_dims={1}, rhs_batch_dims={0}, rhs_contracting_dims={1}
  %tr = f32[16]{0} fusion(%mm), kind=kLoop, calls=%fused_transpose, metadata={op_name="jit(f)/transpose"}
  %bits = u32[4,4]{1,0} add(%a, %b), metadata={op_name="jit(f)/jit(_bernoulli)/jit(_uniform)/add"}
  ROOT %out = f32[4,4]{1,0} multiply(%a, %b), metadata={op_name="jit(f)/mul"}
}
"""
    program = parse_program(hlo)
    assert {name: program[name]["kind"] for name in ("mm", "tr", "bits", "out")} == {
        "mm": "matmul", "tr": "layout copy", "bits": "random bits", "out": "elementwise and other"}
    assert program["mm"]["op"] == "jit(f)/dot_general"
    # 2 x outputs x contracted size; a fusion counts the dots it calls
    assert program["mm"]["flops"] == 2 * 16 * 4 and program["bmm"]["flops"] == 2 * 24 * 5
    assert program["tr"]["flops"] == program["out"]["flops"] == 0
    # bytes read and written: operands and result (4-byte floats)
    assert program["mm"]["bytes"] == 3 * 16 * 4 and program["bmm"]["bytes"] == (40 + 30 + 24) * 4
    assert program["tr"]["bytes"] == (16 + 16) * 4


@pytest.mark.fast
def test_a_gpu_library_gemm_is_a_matmul_with_its_flops():
    from roformer.bench.profile import parse_program
    hlo = """HloModule m

ENTRY %main (a: bf16[32768,768], b: bf16[768,3072]) -> bf16[32768,3072] {
  %a = bf16[32768,768]{1,0} parameter(0)
  %b = bf16[768,3072]{1,0} parameter(1)
  %custom-call.3 = (bf16[32768,3072]{1,0}, s8[4194304]{0}) custom-call(%a, %b), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"alpha_real":1,"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  ROOT %get-tuple-element = bf16[32768,3072]{1,0} get-tuple-element(%custom-call.3), index=0
}
"""
    gemm = parse_program(hlo)["custom-call.3"]
    assert gemm["kind"] == "matmul" and gemm["flops"] == 2 * 32768 * 3072 * 768
    assert gemm["bytes"] == (32768 * 3072 + 32768 * 768 + 768 * 3072) * 2 + 4194304


@pytest.mark.fast
def test_bytes_of_array_and_tuple_shapes_and_operands_of_an_instruction():
    from roformer.bench.gpu_cost import operand_names as _operands
    from roformer.bench.profile import _bytes
    assert _bytes("bf16[128,768]{1,0}") == 128 * 768 * 2 and _bytes("f32[]") == 4
    assert _bytes("(bf16[128,768]{1,0}, pred[64,512]{1,0}, c64[2]{0})") == 128 * 768 * 2 + 64 * 512 + 16
    assert _operands("%a, %b.1), kind=kLoop, calls=%fused_dot, metadata={op_name=\"f(%x)\"}") == ["a", "b.1"]
    assert _operands("), custom_call_target=\"x\"") == []


@pytest.mark.fast
def test_early_returns_names_matmuls_traced_faster_than_the_probe():
    from roformer.bench.profile import early_returns
    program = {"slow": {"flops": 4e9}, "fast": {"flops": 2e9}, "faster": {"flops": 1e9}}
    rate = {"slow": 100.0, "fast": 1000.0, "faster": 400.0}
    note, = early_returns(rate, program, probe_gflops=200.0)
    assert note.startswith("2 matmul op(s) traced above 1.5x the 200 GFLOP/s probe, e.g. fast (2.00 GFLOP")
    assert "faster (1.00 GFLOP at 400 GFLOP/s)" in note and "slow" not in note
    assert early_returns({"slow": 100.0}, program, probe_gflops=200.0) == []


@pytest.mark.slow
@needs_torch
@needs_transformers
def test_hf_bench_with_torch_compile_and_an_unavailable_flax_port(tmp_path, capsys):
    """Ours vs HF torch eager and torch.compile (the aot_eager backend: the same dynamo and
    autograd capture as inductor, without its C++ build, which takes minutes on a CPU),
    and the Flax port reported as not available when its Python cannot run. One shape: each
    shape starts the peers' processes again (several shapes: the next test)."""
    missing = tmp_path / "no-such-venv" / "python"
    result = run_bench(tmp_path, "hf", "--shapes", "tiny/16/2", "--vocab-size", "64",
                       "--rounds", "1", "--iters", "1", "--peak-size", "128",
                       "--torch-compile-backend", "aot_eager", "--flax-python", str(missing))
    assert [r["impl"] for r in result["rows"]] == ["ours_jax", "hf_torch", "hf_torch_compile"]
    ours, *peers = result["rows"]
    assert ours["mfu"] > 0 and ours["tokens_s"] > 0
    assert all(r["ours_x"] > 0 and within(r, "ours_x") for r in peers)
    # The stock peers compute the MLM head at all 16 positions, ours at the 4 masked slots.
    assert all(r["work_x"] > 1 for r in peers) and "work_x" in result["columns"]
    assert [c["name"] for c in result["comparisons"]] == [
        f"ours / {impl} tokens/s [tiny/16/2]" for impl in ("hf_torch", "hf_torch_compile")]
    flax = result["peers"]["hf_flax"]
    assert flax["measured"] == [] and set(flax["not_available"]) == {"tiny/16/2"}
    assert "cannot start" in flax["not_available"]["tiny/16/2"]
    assert result["peers"]["hf_torch_compile"]["measured"] == ["tiny/16/2"]
    assert "note: hf_flax not run at tiny/16/2: RuntimeError: cannot start" in capsys.readouterr().out
    # the PyTorch peers ran in processes of their own (hf_torch_peer.py), which report their versions
    for name in ("hf_torch", "hf_torch_compile"):
        assert result["versions"][name]["torch"] == result["versions"]["torch"]
        assert result["versions"][name]["torch_threads"] >= 1


@needs_torch
@needs_transformers
def test_hf_bench_can_keep_the_torch_peer_in_this_process(tmp_path, monkeypatch):
    """Also: ours takes the dropout keys and the backend forms it is given (what the A/B's
    ratio to the peers runs with its adopted levers)."""
    from roformer.bench import hf
    from roformer.model import backend

    built, build = [], hf.build_train_workload
    monkeypatch.setattr(hf, "build_train_workload", lambda *a, **kw: built.append(
        (kw["dropout_rng_impl"], backend.active_forms())) or build(*a, **kw))
    monkeypatch.setenv(backend.FORMS_ENV, "fused_qkv")
    # On an accelerator in the peak table, MFU divides by the table's peak, as bench step does.
    monkeypatch.setattr(hf, "vendor_peak", lambda dtype: 2e9)
    result = run_bench(tmp_path, "hf", "--shapes=tiny/16/2,tiny/32/1", "--vocab-size", "64", "--rounds", "1",
                       "--iters", "1", "--peak-size", "128", "--peers", "hf_torch", "--torch-process", "this",
                       "--dropout-rng-impl", "rbg")
    assert built == [("rbg", frozenset({"fused_qkv"}))] * 2 and result["backend_forms"] == ["fused_qkv"]
    ours = [r for r in result["rows"] if r["impl"] == "ours_jax"]
    assert all(r["peak_GFLOP_s"] == 2.0 and r["matmul_GFLOP_s"] != 2.0 for r in ours)
    assert [(r["shape"], r["impl"]) for r in result["rows"]] == [
        (shape, impl) for shape in ("tiny/16/2", "tiny/32/1") for impl in ("ours_jax", "hf_torch")]
    assert all(r["ours_x"] > 0 for r in result["rows"] if r["impl"] == "hf_torch")
    assert [c["name"] for c in result["comparisons"]] == [
        f"ours / hf_torch tokens/s [{shape}]" for shape in ("tiny/16/2", "tiny/32/1")]
    assert "hf_torch" not in result["versions"] and result["versions"]["torch_threads"] >= 1


@needs_torch
@needs_transformers
def test_the_masked_head_peer_trains_the_same_model_as_the_stock_one():
    """hf_torch_compile_masked_head's step: the MLM head at the masked positions only gives the
    loss HF's forward with labels gives (-100 elsewhere), step after step, so the updates are
    the same too; only the work differs, which work_x counts."""
    from roformer.bench.hf import peer_flops, torch_train_step
    from roformer.bench.workload import synthetic_batch
    from roformer.model import ModelConfig

    config = ModelConfig.from_preset("tiny", vocab_size=64, hidden_dropout=0.0, attention_dropout=0.0)
    batch = synthetic_batch(config, 2, 16)
    batch["masked_weights"][1, -1] = 0.0   # a padding slot counts in neither
    batch["masked_labels"][1, -1] = 7
    stock, masked = torch_train_step(config, batch), torch_train_step(config, batch, masked_head=True)
    for _ in range(3):
        assert float(masked()) == pytest.approx(float(stock()), rel=1e-5)
    ours = peer_flops("hf_torch_compile_masked_head", config, 16, 2)
    assert peer_flops("hf_torch_compile", config, 16, 2) > ours == peer_flops("hf_torch_compile_masked_head",
                                                                               config, 16, 2)


@needs_torch
@needs_transformers
def test_a_torch_peer_process_that_fails_to_build_is_reported(tmp_path):
    """A peer process whose build fails (here: an unknown size preset in its request) is
    reported with the end of its stderr, as a peer that is not available."""
    from roformer.bench.hf import ChildPeer
    with pytest.raises(RuntimeError, match="(?s)exited with code 1: .*unknown model size .no-such-size."):
        ChildPeer([sys.executable, "-m", "roformer.bench.hf_torch_peer"],
                  {"config": {"size": "no-such-size"}, "seq_len": 16, "batch": 2,
                   "compile_backend": None, "torch_threads": 0})


def test_flax_port_peer_reports_a_python_without_the_port(tmp_path, monkeypatch):
    """transformers 5 has no FlaxRoFormerForMaskedLM: the subprocess answers with the import
    error (simulated by a transformers package that fails to import) and the peer raises it."""
    fake = tmp_path / "site" / "transformers"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('this transformers has no Flax models')\n")
    monkeypatch.setenv("PYTHONPATH", str(fake.parent))
    from roformer.bench.workload import synthetic_batch
    config = ModelConfig.from_preset("tiny", vocab_size=64)
    with pytest.raises(RuntimeError, match="ImportError: this transformers has no Flax models"):
        flax_port_peer(sys.executable, config, synthetic_batch(config, 2, 16))


@pytest.mark.fast
def test_gpu_bench_refuses_a_cpu(capsys):
    with pytest.raises(SystemExit) as stopped:
        bench_main.main(["gpu"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no GPU or TPU found" in err


# Imported by none of the gpu benchmark's code: an accelerator host has jax, flax, optax and orbax only.
NOT_ON_ACCELERATOR_HOSTS = ("ml_collections", "tqdm", "tokenizers", "datasets", "tensorflow_datasets",
                            "tensorflow", "transformers", "torch", "scipy", "sklearn", "matplotlib",
                            "tensorboardX", "tensorboard", "safetensors")
DRY_RUN = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"{{name}} is not installed on an accelerator host")
sys.meta_path.insert(0, Block())
from roformer.bench.__main__ import main
sys.exit(main({argv!r}))
"""


def test_gpu_bench_cpu_dry_run_needs_only_jax_flax_optax_orbax(tmp_path):
    out = tmp_path / "gpu.json"
    argv = ["gpu", "--cpu-dry-run", "--sizes", "tiny", "--seq-lens", "16", "--tokens", "32", "--vocab-size", "64",
            "--rope-lengths", "16", "--rope-batch", "1", "--peak-size", "64", "--rounds", "1", "--iters", "1",
            "--json", str(out)]
    # No virtual devices; the suite's compile setting (tests/conftest.py) stays.
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": " ".join(COMPILE_FAST_FLAGS)}
    done = subprocess.run([sys.executable, "-c", DRY_RUN.format(blocked=NOT_ON_ACCELERATOR_HOSTS, argv=argv)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=patient(900))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [(r["size"], r["seq"], r["variant"], r["batch"]) for r in result["rows"]] == [
        ("tiny", 16, "learned/xla", 2), ("tiny", 16, "rope/xla", 2)]   # no cuDNN on a CPU
    assert all(r["mfu"] > 0 and r["tokens_s"] > 0 for r in result["rows"])
    rope_rows = result["tables"]["RoPE kernel vs copy"]["rows"]
    assert {(r["dtype"], r["pass"]) for r in rope_rows} == {
        (d, p) for d in ("float32", "bfloat16") for p in ("fwd", "fwd+bwd")}
    assert any("CPU dry run" in note for note in result["notes"]) and result["partial"] is False
    assert {"jax", "flax", "optax"} <= set(result["versions"])


def test_gpu_bench_keeps_what_it_has_when_a_group_fails(tmp_path, monkeypatch):
    """A group whose fused kernel fails is timed again with XLA attention; one that fails
    anyway, or a RoPE shape that fails, becomes a note; the JSON so far is on disk while
    later groups run."""
    from roformer.bench import gpu
    out = tmp_path / "gpu.json"
    calls, on_disk = [], {}

    def fake_group(size, seq_len, kernels, args, table_peak):
        calls.append((size, tuple(kernels)))
        if out.exists():
            on_disk[size] = json.loads(out.read_text())
        if size == "mini" and "cudnn" in kernels:
            raise RuntimeError("cuDNN refused this shape\nsecond line")
        if size == "small":
            raise MemoryError()
        return [{"size": size, "seq": seq_len, "variant": f"rope/{kernels[0]}"}]

    monkeypatch.setattr(gpu, "train_group", fake_group)
    monkeypatch.setattr(gpu, "attention_kernels", lambda platform: (["cudnn", "xla"], []))
    def fake_rope(batch, length, heads, head_dim, dtype, *, backward, rounds, iters):
        if dtype == "bfloat16" and backward:
            raise ValueError("no bf16 backward here")
        return [{"shape": "8x16", "variant": "copy"}]

    monkeypatch.setattr(gpu.rope_bench, "bench_shape", fake_rope)
    args = bench_main.parse_args(["gpu", "--cpu-dry-run", "--sizes=tiny,mini,small", "--seq-lens", "16",
                                  "--rope-lengths", "16", "--json", str(out)])
    result = gpu.run(args)
    assert calls == [("small", ("cudnn", "xla")), ("small", ("xla",)), ("mini", ("cudnn", "xla")),
                     ("mini", ("xla",)), ("tiny", ("cudnn", "xla"))]   # largest first
    assert [(r["size"], r["variant"]) for r in result["rows"]] == [("tiny", "rope/cudnn"), ("mini", "rope/xla")]
    failures = [n for n in result["notes"] if "attention failed" in n]
    assert failures == [
        "small/16 with cudnn+xla attention failed (MemoryError: ); timed again with XLA attention alone",
        "small/16 with xla attention failed (MemoryError: )",
        "mini/16 with cudnn+xla attention failed (RuntimeError: cuDNN refused this shape); "
        "timed again with XLA attention alone"]
    assert "RoPE bfloat16 8x16 fwd+bwd failed (ValueError: no bf16 backward here)" in result["notes"]
    assert result["partial"] is False
    # written after the RoPE table and after each group: what tiny's group found on disk
    assert on_disk["small"]["partial"] and on_disk["small"]["rows"] == []
    assert on_disk["tiny"]["tables"]["RoPE kernel vs copy"]["rows"] == [{"shape": "8x16", "variant": "copy"}] * 3
    assert [r["size"] for r in on_disk["tiny"]["rows"]] == ["mini"] and on_disk["tiny"]["machine"]["platform"]


@pytest.mark.slow   # four benchmark processes start jax and compile
def test_runs_bench_times_one_process_runs_side_by_side_and_vmapped_seeds(tmp_path):
    result = run_bench(tmp_path, "runs", "--shapes", "tiny/16/2", "--modes=one,procs,vmap,procs_vmap",
                       "--parallel", "2", "--seeds-per-process", "3", "--rounds", "2", "--steps", "1")
    rows = {row["mode"]: row for row in result["rows"]}
    assert list(rows) == ["one", "procs", "vmap", "procs_vmap"]
    assert [rows[m]["runs"] for m in rows] == [1, 2, 2, 6]   # procs_vmap: 2 processes x 3 seeds
    assert rows["one"]["x_one"] == 1.0
    for row in rows.values():
        assert row["tokens_s"] > 0 and row["rss_MB_per_run"] > 0 and row["cpu_per_wall"] > 0
        assert "device_MB_per_run" not in row   # an accelerator's memory; on CPU the RSS holds all
        assert within(row, "x_one")
        assert row["runs_per_hour"] == pytest.approx(row["tokens_s"] * 3600 / (2000 * 16 * 2))


@pytest.mark.fast
def test_unknown_benchmark_is_rejected(capsys):
    with pytest.raises(SystemExit) as stopped:
        bench_main.main(["nope"])
    assert stopped.value.code == 2 and capsys.readouterr().err.startswith("error: no benchmark 'nope'; choose one of rope,")


@pytest.mark.fast
def test_gpu_bench_versions_name_the_copy_that_import_takes(tmp_path, monkeypatch):
    """A package carried onto the path ahead of an installed one is the one imported, so it
    is the version the result records (not whichever copy the listing meets last)."""
    from roformer.bench import gpu

    info = tmp_path / "flax-9.9.9.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: flax\nVersion: 9.9.9\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert gpu.versions()["flax"] == "9.9.9"


def test_flags_bench_runs_each_flag_set_in_its_own_process_between_two_references(tmp_path, capsys):
    # An unknown flag stops only its own process (which shows the set reached XLA_FLAGS there);
    # the reference runs before and after it still give their rows.
    result = run_bench(tmp_path, "flags", "--flag-set=--xla_no_such_flag_here=1", "--step-args",
                       "--sizes tiny --seq-lens 16 --batch 2 --schemes rope --vocab-size 64 --rounds 1 --iters 1")
    first, failed, last = result["rows"]
    assert [row["xla_flags"] for row in result["rows"]] == ["(none)", "--xla_no_such_flag_here=1", "(none)"]
    assert failed["error"].startswith("exit status") and "ms_step" not in failed
    assert (first["size"], first["seq"], first["scheme"], first["batch"]) == ("tiny", 16, "rope", 2)
    assert first["x_ref"] == 1.0 and first["dloss_step1"] == 0.0
    # the same initial parameters and batch in every process: the same first loss, to the bit
    assert last["loss_step1"] == first["loss_step1"] and last["dloss_step1"] == 0.0
    assert last["x_ref"] == pytest.approx(last["ms_step"] / first["ms_step"])
    assert any("drift" in note for note in result["notes"])
    # each set's figures also on stderr as it ends (a command stopped from outside keeps them in its log)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("flags ")]
    assert lines[0] == f"flags (none): {first['ms_step']:.3f} ms per step, first loss {first['loss_step1']:.6f}"
    assert lines[1].startswith("flags --xla_no_such_flag_here=1: exit status") and len(lines) == 3


def test_flags_bench_starts_no_backend_of_its_own_and_takes_the_candidates_of_the_steps_platform():
    # On a GPU a backend in the parent would hold the memory the steps' processes need.
    script = """
from types import SimpleNamespace
from jax._src import xla_bridge
from roformer.bench import flags
ran = []
def fake_step(flag_set, step_args, timeout_s):
    ran.append(flag_set)
    row = {"size": "tiny", "seq": 16, "scheme": "rope", "dropout_rng": "threefry2x32", "hidden_dropout": 0.0,
           "ms_step": 2.0, "loss_step1": 4.0}
    return flags.StepRun(flag_set, [row], "gpu", None)
flags.run_step = fake_step
result = flags.run(SimpleNamespace(flag_set=None, step_args="", timeout_s=1.0, combine_below=0.0))
assert ran == ["", *flags.CANDIDATES["gpu"], ""], ran
assert not xla_bridge.backends_are_initialized()
print("ok", len(result["rows"]))
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["ok", str(len(flags_bench.CANDIDATES["gpu"]) + 2)]


@pytest.mark.fast
def test_flags_bench_times_the_sets_that_won_together_before_the_last_reference(monkeypatch):
    ms = {"": 2.0, "--a": 1.0, "--b": 1.9, "--c": 3.0, "--d": 1.0, "--a --b": 0.9}
    ran = []

    def fake_step(flag_set, step_args, timeout_s):
        ran.append(flag_set)
        if flag_set == "--d":
            return flags_bench.StepRun(flag_set, [], None, "exit status 1: Unknown flag")
        row = {"size": "tiny", "seq": 16, "scheme": "rope", "dropout_rng": "threefry2x32", "hidden_dropout": 0.0,
               "ms_step": ms[flag_set], "loss_step1": 4.0}
        return flags_bench.StepRun(flag_set, [row], "cpu", None)

    monkeypatch.setattr(flags_bench, "run_step", fake_step)
    result = flags_bench.run(SimpleNamespace(flag_set=["--a", "--b", "--c", "--d"], step_args="",
                                                timeout_s=1.0, combine_below=0.99))
    assert ran == ["", "--a", "--b", "--c", "--d", "--a --b", ""]   # --b: 0.95x; --d failed
    assert [row["x_ref"] for row in result["rows"] if "x_ref" in row] == [1.0, 0.5, 0.95, 1.5, 0.45, 1.0]
    ran.clear()
    flags_bench.run(SimpleNamespace(flag_set=["--a", "--c"], step_args="", timeout_s=1.0, combine_below=0.99))
    assert ran == ["", "--a", "--c", ""]   # one winner: nothing to combine


def test_glue_loop_bench_times_a_preset_model_and_only_the_loops_asked_for(tmp_path):
    result = run_bench(tmp_path, "glue_loop", "--preset", "tiny", "--variants=finetune,bare", "--batch", "4",
                       "--max-len", "32", "--steps", "8", "--steps-per-call", "4", "--rounds", "1",
                       "--paddings=step,call")
    assert [(row["variant"], row["steps_per_call"], row["padding"]) for row in result["rows"]] == [
        ("finetune", 4, "step"), ("bare", 4, "step"), ("finetune", 4, "call"), ("bare", 4, "call")]
    for row in result["rows"]:
        assert row["steps_s"] > 0 and within(row, "steps_s") and "x_per_step_loop" not in row
    assert result["notes"][0].startswith("model: tiny, accel=cpu setting")


@pytest.mark.slow   # compiles four train programs: a minute and more on 2 shared cores
def test_glue_loop_bench_times_the_loops_and_breaks_the_host_time_down(tmp_path):
    result = run_bench(tmp_path, "glue_loop", "--hidden", "16", "--batch", "4", "--max-len", "32", "--steps", "6",
                       "--steps-per-call=1,4", "--rounds", "1", "--program-size", "tiny")
    rows = {(row["variant"], row["steps_per_call"]): row for row in result["rows"]}
    assert list(rows) == [("per-step loop", 1), ("finetune", 1), ("bare", 1), ("finetune", 4), ("bare", 4)]
    assert rows["per-step loop", 1]["x_per_step_loop"] == 1.0
    for row in rows.values():
        assert row["steps_s"] > 0 and within(row, "steps_s") and row["host_ms_step"] > 0
    parts = result["tables"]["host time per step, by part"]["rows"]
    assert len(parts) == 7 and all(part["us_per_step"] > 0 for part in parts)
    assert any("base model" in part["part"] for part in parts)
    sizes = result["tables"]["train program, tiny"]["rows"]
    assert [(row["steps_per_call"], row["lengths"]) for row in sizes] == [(1, [16, 32]), (4, [16, 32])]
    assert all(row["stablehlo_lines"] > 0 and row["compile_s"] > 0 and row["serialized_mib"] > 0 for row in sizes)
