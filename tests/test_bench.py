"""Smoke tests of the benchmarks: tiny shapes, one round, well-formed rows and JSON.

Timings are not checked (the machine is shared); only that each benchmark runs
end to end through `python -m roformer.bench`'s main and reports what it should.
"""
import json

import pytest

from roformer.bench import __main__ as bench_main
from roformer.bench.common import alternate, format_table, ratio_stats


def run_bench(tmp_path, *argv):
    out = tmp_path / "result.json"
    assert bench_main.main([*argv, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["benchmark"] == argv[0]
    assert result["machine"]["platform"] == "cpu"
    assert result["rows"]
    return result


def test_ratio_stats_and_alternate():
    assert ratio_stats([2.0, 4.0, 3.0], [1.0, 2.0, 1.0]) == {"median": 2.0, "min": 2.0, "max": 3.0}
    with pytest.raises(ValueError, match="equally long"):
        ratio_stats([1.0], [1.0, 2.0])
    times = alternate({"a": lambda: 1, "b": lambda: 2}, rounds=3, iters=1, warmup=0)
    assert set(times) == {"a", "b"} and all(len(t) == 3 for t in times.values())
    assert format_table([{"x": 1.23456, "y": "z"}]).splitlines()[2] == "| 1.235 | z |"


@pytest.mark.parametrize("backward", [False, True])
def test_rope_bench(tmp_path, capsys, backward):
    result = run_bench(tmp_path, "rope", "--lengths", "8", "16", "--dtypes", "float32", "bfloat16",
                       "--heads", "2", "--head-dim", "8", "--rounds", "2", "--iters", "1",
                       *(["--backward"] if backward else []))
    variants = {"copy", "complex", "complex_half", "complex_stack", "real_interleaved", "rotate_half",
                "cis_table"}
    assert {r["variant"] for r in result["rows"]} == variants
    assert len(result["rows"]) == 2 * 2 * len(variants)
    assert {r["pass"] for r in result["rows"]} == {"fwd+bwd" if backward else "fwd"}
    assert all(r["ms"] > 0 and r["x_copy_min"] <= r["x_copy"] <= r["x_copy_max"] for r in result["rows"])
    targeted = [c for c in result["comparisons"] if "target" in c]
    assert len(targeted) == 4 and all(isinstance(c["met"], bool) for c in targeted)  # 2 per dtype
    printed = capsys.readouterr().out
    assert "| variant |" in printed and "| complex |" in printed and "complex / copy" in printed


def test_step_and_scaling_bench(tmp_path):
    common = ["--vocab-size", "64", "--rounds", "1", "--iters", "1", "--peak-size", "128"]
    # the accelerator path's switches: fused attention needs attention dropout off
    result = run_bench(tmp_path, "step", "--sizes", "tiny", "--seq-lens", "16", "--batch", "2",
                       "--schemes", "learned", "rope", "--attention-impl", "xla", "--attention-dropout", "0",
                       *common)
    rows = {r["scheme"]: r for r in result["rows"]}
    assert set(rows) == {"learned", "rope"}
    assert rows["learned"]["x_learned"] == 1.0
    assert all(r["tokens_s"] > 0 and r["mfu"] > 0 and r["GFLOP_step"] > 0 for r in rows.values())

    result = run_bench(tmp_path, "scaling", "--size", "tiny", "--seq-lens", "32", "--tokens", "64",
                       "--schemes", "rope", *common)
    assert [(r["scheme"], r["seq"], r["batch"]) for r in result["rows"]] == [("rope", 32, 2)]
    assert result["rows"][0]["growth"] == 1.0 and result["rows"][0]["ms_per_1k_tokens"] > 0


def test_hf_bench(tmp_path):
    result = run_bench(tmp_path, "hf", "--size", "tiny", "--seq-len", "16", "--batch", "2",
                       "--vocab-size", "64", "--rounds", "1", "--iters", "1")
    assert [r["impl"] for r in result["rows"]] == ["ours_jax", "hf_torch"]
    assert result["comparisons"][0]["median"] > 0
    assert "target" not in result["comparisons"][0]  # the target is stated at mini/128/32 only


def test_unknown_benchmark_is_rejected():
    with pytest.raises(SystemExit):
        bench_main.main(["nope"])
