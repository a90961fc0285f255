"""The one-command GPU script of the end-to-end check: it parses, refuses an unknown stage or
missing data before running anything, and its table reads what the stages leave (here a GLUE
results file written by run_glue's format and the other stages' files, made up; the XLA flag
sets' runs of glue_flags with their logs). The same for scripts/bench_accelerator.sh and its
ab step's table."""
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_end_to_end.sh"


def test_the_script_parses_and_refuses_a_bad_stage_or_missing_data_before_running(tmp_path):
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    bad = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out")], env={"STEPS": "pretrain glu", "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and "unknown stage 'glu'" in bad.stderr and " glue_flags " in bad.stderr
    missing = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out")], capture_output=True, text=True, cwd=ROOT,
                             env={"DATA": str(tmp_path / "nowhere"), "PATH": "/usr/bin:/bin"})
    assert missing.returncode == 2 and "missing" in missing.stderr
    assert not (tmp_path / "out").exists()


def run_without_data(tmp_path, **env) -> Path:
    """The script on empty data folders (stages that need data are skipped or fail); its OUTDIR."""
    data = tmp_path / "data"
    for folder in ("glue", "vocab", "wikipedia_en"):
        (data / folder).mkdir(parents=True)
    (data / "vocab" / "bert-base-uncased-vocab.txt").write_text("[PAD]\n")
    out = tmp_path / "out"
    env = {"DATA": str(data), "WORK": str(tmp_path / "work"), "PYTHON": sys.executable, "PATH": "/usr/bin:/bin", **env}
    subprocess.run(["bash", str(SCRIPT), str(out)], env=env, cwd=ROOT, capture_output=True, check=True)
    return out


def test_a_failed_stage_is_the_scripts_exit_status_and_its_files_still_come_back(tmp_path):
    """Pretraining on an empty corpus fails: the call's status says so (it said 0 before), and
    the table and log are written all the same."""
    data = tmp_path / "data"
    for folder in ("glue", "vocab", "wikipedia_en"):
        (data / folder).mkdir(parents=True)
    (data / "vocab" / "bert-base-uncased-vocab.txt").write_text("[PAD]\n")
    env = {"DATA": str(data), "WORK": str(tmp_path / "work"), "PYTHON": sys.executable, "PATH": "/usr/bin:/bin",
           "STEPS": "pretrain"}
    run = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out")], env=env, cwd=ROOT, capture_output=True)
    assert run.returncode != 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["files.tar.gz", "log.txt", "table.md"]
    assert f"=== pretrain: exit {run.returncode} after" in (tmp_path / "out" / "log.txt").read_text()


def test_the_script_leaves_the_table_the_log_and_one_archive(tmp_path):
    # an export with no pretraining workdir is skipped, so this runs only the bookkeeping
    out = run_without_data(tmp_path, STEPS="export")
    assert sorted(p.name for p in out.iterdir()) == ["files.tar.gz", "log.txt", "table.md"]
    listed = subprocess.run(["tar", "-tzf", str(out / "files.tar.gz")], capture_output=True, text=True,
                            check=True).stdout.split()
    assert sorted(listed) == ["host.txt"]
    assert "=== export: skipped (no pretraining workdir)" in (out / "log.txt").read_text()


def test_a_flag_set_that_cannot_run_whole_is_skipped_not_cut(tmp_path):
    out = run_without_data(tmp_path, STEPS="glue_flags", GLUE_FLAG_SETS=";--xla_gpu_autotune_level=0", BUDGET_S="60")
    log = (out / "log.txt").read_text()
    assert "=== glue_flags0: skipped" in log and "=== glue_flags1: skipped" in log and "limit" not in log
    assert "| 0 | (none) | - | no result | | | | | 0 | skipped (0) |" in (out / "table.md").read_text()


def test_the_table_reads_every_stage_file_and_says_what_did_not_run(tmp_path):
    (tmp_path / "stages.tsv").write_text("pretrain\t0\t101\nglue\t0\t236\npeers\t124\t200\n")
    (tmp_path / "pretrain_summary.json").write_text(json.dumps(
        {"tokens_per_sec": 545828.6, "mfu": 0.3246, "final_loss": 6.69, "wall_time_s": 52.5}))
    task = {"seeds": {"0": {"steps": 804, "train_steps_per_sec": 72.4}}, "compile_seconds": 39.7,
            "wall_seconds": 55.5, "median": {"validation": {"matthews_corr": 0.12}}}
    (tmp_path / "glue_results.json").write_text(json.dumps({"tasks": {"cola": task}, "failed": {"sst2": "OOM"}}))
    warm = {**task, "seeds": {str(i): {"steps": 804, "train_steps_per_sec": rate}
                              for i, rate in enumerate([90.0, 131.0, 140.0])},   # the median of the seeds
            "compile_seconds": 1.5, "wall_seconds": 12.0}
    (tmp_path / "glue_warm_results.json").write_text(json.dumps({"tasks": {"cola": warm}}))
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_end_to_end_table.py"), str(tmp_path)],
                         capture_output=True, text=True, check=True).stdout
    assert "| peers | 124 | 200 |" in out and "545,829 tokens/s" in out and "MFU 32.5%" in out
    assert "| cola | 1 | 804 | 72.4 | 39.7 | 55.5 | 72% | validation matthews_corr 12.0 |" in out
    assert "| sst2 | failed: OOM" in out
    cold_part, warm_part = out.split("GLUE, warm compilation cache")
    assert "met by 0 of 1 tasks; compile <= 15% of a task's wall time met by 0 of 1" in cold_part
    assert "| cola | 3 | 804 | 131.0 | 1.5 | 12.0 | 12% |" in warm_part
    assert "met by 1 of 1 tasks; compile <= 15% of a task's wall time met by 1 of 1" in warm_part
    assert "**HF export parity**: not run" in out and "**Peers (bench hf)**: not run" in out
    assert "**GLUE loop (bench glue_loop)**: not run" in out
    loop = {"rows": [{"variant": "finetune", "steps_per_call": 16, "steps_s": 140.2, "steps_s_min": 139.0,
                      "steps_s_max": 141.5, "host_ms_step": 0.21},
                     {"variant": "bare", "steps_per_call": 16, "padding": "call", "steps_s": 151.0, "steps_s_min": 150.0,
                      "steps_s_max": 152.0, "host_ms_step": 0.02}], "notes": ["model: base, accel=gpu setting"]}
    (tmp_path / "glue_loop.json").write_text(json.dumps(loop))
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_end_to_end_table.py"), str(tmp_path)],
                         capture_output=True, text=True, check=True).stdout
    assert "**GLUE loop (bench glue_loop)**: model: base, accel=gpu setting" in out
    # a row without a padding (a file from before the column) was padded per step
    assert "| finetune | 16 | step | 140.2 (139.0, 141.5) | 0.210 |" in out
    assert "| bare | 16 | call | 151.0 (150.0, 152.0) | 0.020 |" in out


def test_the_flags_table_gives_each_xla_flag_set_its_compile_time_steps_and_why_it_failed(tmp_path):
    (tmp_path / "stages.tsv").write_text("glue_flags0\t0\t41\nglue_flags1\t1\t3\n")
    for i, flags in enumerate(["", "--xla_no_such_flag=1", "--xla_gpu_autotune_level=0"]):
        (tmp_path / f"glue_flags{i}.txt").write_text(flags + "\n")
    task = {"seeds": {"0": {"steps": 804, "train_steps_per_sec": 150.0}}, "compile_seconds": 20.0,
            "wall_seconds": 40.0, "median": {"validation": {"matthews_corr": 0.1}}}
    (tmp_path / "glue_flags0_results.json").write_text(json.dumps({"tasks": {"cola": task}}))
    (tmp_path / "log.txt").write_text(
        "=== glue_flags0 (limit 75 s): env XLA_FLAGS= python -m roformer.glue\n"
        "W autotuner: Delay kernel timed out\nW autotuner: Delay kernel timed out\n=== glue_flags0: exit 0 after 41 s\n"
        "=== glue_flags1 (limit 75 s): env XLA_FLAGS=--xla_no_such_flag=1 python -m roformer.glue\n"
        "F parse_flags_from_env.cc:234] Unknown flag in XLA_FLAGS: --xla_no_such_flag=1\n\n"
        "=== glue_flags1: exit 1 after 3 s\n")
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_end_to_end_table.py"), str(tmp_path)],
                         capture_output=True, text=True, check=True).stdout
    part = out.split("GLUE cold compile under XLA flag sets")[1]
    assert "| 0 | (none) | cola | 20.0 | 150.0 | 40.0 | 50% | validation matthews_corr 10.0 | 2 | 0 (41) |" in part
    assert ("| 1 | `--xla_no_such_flag=1` | - | no result: F parse_flags_from_env.cc:234] Unknown flag in XLA_FLAGS: "
            "--xla_no_such_flag=1 | | | | | 0 | 1 (3) |") in part
    assert "| 2 | `--xla_gpu_autotune_level=0` | - | no result | | | | | 0 | not run |" in part


def test_the_accelerator_benchmarks_parse_and_refuse_an_unknown_step_before_running(tmp_path):
    script = ROOT / "scripts" / "bench_accelerator.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    bad = subprocess.run(["bash", str(script), str(tmp_path / "out")], env={"STEPS": "ab abb", "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and "unknown step 'abb'" in bad.stderr
    assert not (tmp_path / "out").exists()


def test_the_ab_step_fits_a_shorter_time_limit_when_told_so(tmp_path):
    """The whole A/B (levers at three shapes, a flag set, the torch.compile peer), and its short
    form for a shorter time limit: one shape, the levers named, a
    limit of its own, no flag set, no peer. A stand-in interpreter records each command."""
    stub = tmp_path / "python"
    stub.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "calls"}\n')
    stub.chmod(0o755)

    def commands(**env):
        (tmp_path / "calls").unlink(missing_ok=True)
        out = tmp_path / "out"
        subprocess.run(["bash", str(ROOT / "scripts" / "bench_accelerator.sh"), str(out)], cwd=ROOT, check=True,
                       capture_output=True, env={"PATH": "/usr/bin:/bin", "PYTHON": str(stub), "STEPS": "ab", **env})
        calls = (tmp_path / "calls").read_text().replace(str(out), "OUT").splitlines()
        return [c for c in calls if c.startswith(("-m roformer.bench", "scripts/"))]

    whole = commands()
    assert [c.split(" --")[0] for c in whole] == ["-m roformer.bench levers", "-m roformer.bench levers",
                                                  "-m roformer.bench hf", "scripts/bench_ab_table.py OUT 1"]
    # a flag set's run has room for both its builds (20-27 s each on an H200) within its budget
    assert "--budget-s 275" in whole[0] and "--budget-s 70" in whole[1]
    short = commands(AB_LEVERS_S="200", AB_FLAG_SETS="none", AB_HF="0", AB_SHAPES="base/512/64",
                     AB_ARGS="--variants=baseline,pallas_residual_norm,rbg_dropout")
    assert short == ["-m roformer.bench levers --shapes=base/512/64 --budget-s 165 --rounds 3 --iters 5 "
                     "--variants=baseline,pallas_residual_norm,rbg_dropout --json OUT/ab_levers.json",
                     "scripts/bench_ab_table.py OUT 0"]
    # the shapes an earlier call's budget left: its adopted levers, not the levers alone again
    later = commands(AB_ADOPTED_FROM="kept/ab_levers.json", AB_SHAPES="base/128/256 small/512/64",
                     AB_FLAG_SETS="none", AB_HF="0")
    assert later == ["-m roformer.bench levers --shapes=base/128/256,small/512/64 --budget-s 275 --rounds 3 --iters 5 "
                     "--adopted-from kept/ab_levers.json --json OUT/ab_levers.json", "scripts/bench_ab_table.py OUT 0"]
    # the script's status is its worst step's: a levers run cut at its limit shows in the call's rc
    stub.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "calls"}\ncase "$*" in *"bench levers"*) exit 124 ;; esac\n')
    cut = subprocess.run(["bash", str(ROOT / "scripts" / "bench_accelerator.sh"), str(tmp_path / "out")], cwd=ROOT,
                         capture_output=True, env={"PATH": "/usr/bin:/bin", "PYTHON": str(stub), "STEPS": "ab",
                                                   "AB_FLAG_SETS": "none", "AB_HF": "0"})
    assert cut.returncode == 124


def test_the_ab_table_gives_the_ratio_to_torch_compile_after_and_before_the_levers(tmp_path):
    def lever(run_stage, variant, tokens_s, x_tokens, forms=(), rng="threefry2x32", batch=64):
        return {"stage": run_stage, "size": "base", "seq": 512, "batch": batch, "variant": variant, "forms": list(forms),
                "dropout_rng": rng, "tokens_s": tokens_s, "x_tokens": x_tokens}

    # a row of the same forms at another batch comes first: it is not the one ab_hf ran
    levers = [lever("levers", "baseline", 500.0, 1.0), lever("levers", "all_batch_x2", 560.0, 1.12, ["fused_qkv"], batch=128),
              lever("levers", "fused_qkv", 520.0, 1.04, ["fused_qkv"]),
              lever("levers", "pallas_residual_norm", None, None, ["pallas_residual_norm"])]
    (tmp_path / "ab_levers.json").write_text(json.dumps({"rows": levers, "notes": ["adopted: fused_qkv"]}))
    flags = [{**lever("levers", "baseline", 450.0, 1.0), "xla_flags": "--xla_gpu_enable_cublaslt=true"}]
    (tmp_path / "ab_flags1.json").write_text(json.dumps({"rows": flags}))
    hf = {"rows": [{"shape": "base/512/64", "impl": "ours_jax", "mfu": 0.34},
                   {"shape": "base/512/64", "impl": "hf_torch_compile", "ours_x": 1.56, "ours_x_min": 1.5,
                    "ours_x_max": 1.6}],
          "backend_forms": ["fused_qkv"], "settings": {"dropout_rng_impl": "threefry2x32"}, "notes": []}
    (tmp_path / "ab_hf.json").write_text(json.dumps(hf))
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_ab_table.py"), str(tmp_path), "2"],
                         capture_output=True, text=True, check=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}).stdout
    table = json.loads((tmp_path / "ab.json").read_text())
    assert [row["x_baseline"] for row in table["rows"]] == [1.0, 1.12, 1.04, None, 0.9]
    [peer] = table["peers"]
    assert (peer["forms"], peer["ours_mfu"], peer["ours_x"], peer["x_levers"]) == ("fused_qkv", 0.34, 1.56, 1.04)
    assert abs(peer["ours_x_before"] - 1.5) < 1e-9
    assert "note: ab_flags2.json: no result" in out and "note: ab_levers: adopted: fused_qkv" in out
    (tmp_path / "ab_hf.json").unlink()
    subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_ab_table.py"), str(tmp_path), "1"],
                   capture_output=True, check=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    table = json.loads((tmp_path / "ab.json").read_text())
    assert table["peers"] == [] and "ab_hf.json: no result (log.txt says why)" in table["notes"]


def test_the_files_a_gpu_machine_needs_are_made_in_one_folder(tmp_path, shared_data):
    """scripts/device_files.sh's data part (the wheels need a package index, the pack has its own
    test): the four GLUE tasks, the vocab and ten Wikipedia files under DIR/data, and the folder's
    size, over MAX_MIB a failure; an unknown part is refused before anything is made."""
    script = ROOT / "scripts" / "device_files.sh"
    env = {"PATH": "/usr/bin:/bin", "SHARED": str(shared_data)}
    bad = subprocess.run(["bash", str(script), str(tmp_path / "bad")], env={**env, "PARTS": "data wheel"},
                         capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and "unknown part 'wheel'" in bad.stderr and not (tmp_path / "bad").exists()
    made = subprocess.run(["bash", str(script), str(tmp_path / "device")], env={**env, "PARTS": "data"},
                          capture_output=True, text=True, cwd=ROOT)
    assert made.returncode == 0, made.stderr
    data = tmp_path / "device" / "data"
    assert sorted(p.name for p in (data / "glue").iterdir()) == ["CoLA", "MRPC", "SST-2", "STS-B"]
    assert (data / "glue" / "CoLA" / "dev.tsv").is_file() and any((data / "vocab").iterdir())
    assert sorted(p.name for p in (data / "wikipedia_en").iterdir()) == [f"wiki_0{i}" for i in range(10)]
    assert re.search(r"device: \d+ MiB$", made.stdout, re.M)
    capped = subprocess.run(["bash", str(script), str(tmp_path / "device")], env={**env, "PARTS": "data", "MAX_MIB": "0"},
                            capture_output=True, text=True, cwd=ROOT)
    assert capped.returncode == 1 and "over MAX_MIB=0 MiB" in capped.stderr
