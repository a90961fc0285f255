"""config.parallel: ablation runs side by side, each in a process of its own (roformer.ablation.parallel).

The orchestration tests start fake run processes (a Python that writes what a run's
process records, or exits with a status) so merging, crashes and preemption are checked
in a second; one test trains real smoke-size runs in both modes, kills each ablation with
SIGKILL mid-training, resumes it and compares the held-out losses.
"""
import json
import logging
import os
import re
import subprocess
import sys

import pytest

from roformer import machine
from roformer.ablation import parallel as parallel_runs   # tests name their own `parallel` settings
from roformer.ablation import plan, runner, validation
from roformer.ablation.stages import PREEMPTED_EXIT, error_name, run_stages
from roformer.ablation.state import PINNED_TOKENIZER, STATE_FILE, AblationState

from helpers.ablation import (FakeStages, held_out_losses, kill_after_first_checkpoints, small_config, stub_figures,
                              tiny_config, why_failed)


# --------------------------------------------------------------------------- slots and settings


def test_core_slots_deal_the_cores_and_one_core_turns_off_xlas_thread_pool():
    cores = sorted(machine.available_cores())
    assert parallel_runs.core_slots(1) == [cores]
    slots = parallel_runs.core_slots(len(cores))
    assert slots == [[c] for c in cores]
    with pytest.raises(ValueError, match="runs at once"):
        parallel_runs.core_slots(len(cores) + 1)
    one = parallel_runs.child_env([cores[0]])
    assert parallel_runs.SINGLE_CORE_XLA_FLAGS in one["XLA_FLAGS"]
    assert os.environ.get("XLA_FLAGS", "") in one["XLA_FLAGS"]   # the caller's flags are kept
    assert parallel_runs.CORES_ENV not in one and one[parallel_runs.PARENT_ENV] == str(os.getpid())
    assert parallel_runs.child_env([cores[0]], pin=True)[parallel_runs.CORES_ENV] == str(cores[0])
    every = parallel_runs.child_env(None)
    assert parallel_runs.CORES_ENV not in every
    assert every.get("XLA_FLAGS", "") == os.environ.get("XLA_FLAGS", "")


def test_runs_on_one_gpu_do_not_each_reserve_most_of_its_memory(monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    assert parallel_runs.child_env(None)["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "true")   # a caller's own choice is kept
    assert parallel_runs.child_env([0])["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true"


def test_runs_share_a_compile_cache_unless_the_caller_keeps_their_own(tmp_path, monkeypatch):
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    assert "JAX_COMPILATION_CACHE_DIR" not in parallel_runs.child_env(None)
    env = parallel_runs.child_env(None, compile_cache=tmp_path)
    assert env["JAX_COMPILATION_CACHE_DIR"] == str(tmp_path)
    assert float(env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]) == parallel_runs.COMPILE_CACHE_MIN_SECONDS
    assert int(env["JAX_COMPILATION_CACHE_MAX_SIZE"]) > 0   # jax locks entries only with a limit
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/theirs")
    assert parallel_runs.child_env(None, compile_cache=tmp_path)["JAX_COMPILATION_CACHE_DIR"] == "/theirs"


def test_the_commands_own_process_uses_the_compile_cache_unless_the_caller_keeps_their_own(tmp_path):
    """Runs in turn compile in the ablate command's own process: it keeps its programs too."""
    code = ("import sys, jax; from pathlib import Path; from roformer.ablation import parallel; "
            "parallel.use_compile_cache(Path(sys.argv[1])); "
            "jax.jit(lambda x: x * 2)(1.0).block_until_ready(); "
            "print(jax.config.jax_compilation_cache_dir)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"   # keep even this small program
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "ours")], env=env, check=True,
                         capture_output=True, text=True).stdout
    assert out.strip() == str(tmp_path / "ours") and any((tmp_path / "ours").iterdir())
    env["JAX_COMPILATION_CACHE_DIR"] = str(tmp_path / "theirs")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "ours2")], env=env, check=True,
                         capture_output=True, text=True).stdout
    assert out.strip() == str(tmp_path / "theirs") and not (tmp_path / "ours2").exists()


def test_a_pinned_process_takes_its_cores_before_jax_starts():
    code = ("import os, sys; from roformer.ablation import parallel; parallel.enter_slot(); "
            "import jax; jax.devices(); print(sorted(os.sched_getaffinity(0)), 'jax' in sys.modules)")
    cores = sorted(machine.available_cores())[-1:]
    out = subprocess.run([sys.executable, "-c", code], env=parallel_runs.child_env(cores, pin=True), check=True,
                         capture_output=True, text=True).stdout
    assert out.strip() == f"{cores} True"


@pytest.mark.parametrize("value, message", [(0, ">= 1"), (-1, ">= 1"),
                                            (10_000, "runs at once")])
def test_validate_refuses_a_bad_parallel(value, message):
    config = small_config()
    config.parallel = value
    with pytest.raises(ValueError, match=message):
        validation.validate(plan.build_plan(config, "/ablation"))


# --------------------------------------------------------------------------- orchestration with fake processes


class FakeProcesses:
    """Stands in for `_start_run`: runs the run's stages here, with tests/ablation/test_ablate.py's fake
    stage runners, into the job's own state file as a run's process does, then starts a
    process that exits 0; or, for a run in `status`, records nothing and starts one that
    exits with that status."""

    def __init__(self, monkeypatch, status=None):
        FakeStages().install(monkeypatch)
        self.status = status or {}
        self.started = []

    def __call__(self, the_plan, state, run, cores):
        self.started.append((run.name, tuple(cores)))
        jobs_dir = the_plan.workdir / runner.JOBS_DIR
        jobs_dir.mkdir(exist_ok=True)
        job_state = AblationState(the_plan.workdir, jobs_dir / f"{error_name(run.name)}.state.json")
        job_state.data = {run.name: dict(state.data.get(run.name, {}))}
        status = self.status.get(run.name, 0)
        if status == 0:
            run_stages(job_state, the_plan, run)
        else:
            job_state.set(run.name, "pretrain", state.get(run.name, "pretrain"))
        # A run that fails or is preempted ends after the others have (they would take
        # SIGTERM for the preemption otherwise, which these fakes do not handle).
        wait = 1.0 if status else 0.0
        end = f"os.kill(os.getpid(), {-status})" if status < 0 else f"sys.exit({status})"
        return subprocess.Popen([sys.executable, "-c", f"import os, sys, time; time.sleep({wait}); {end}"])


def test_runs_go_side_by_side_in_plan_order_and_their_records_are_merged(tmp_path, monkeypatch):
    stub_figures(monkeypatch)
    fake = FakeProcesses(monkeypatch)
    monkeypatch.setattr(runner, "_start_run", fake)
    config = small_config(methods="none,linear")   # 2 schemes x 2 seeds, extension of 2 seeds x 2 methods
    config.parallel = 2
    result = runner.run_ablation(config, tmp_path)
    runs = [run for run, _ in fake.started]
    assert runs == ["learned/seed0", "rope/seed0", "learned/seed1", "rope/seed1",
                    "extension/none/seed0", "extension/linear/seed0", "extension/none/seed1",
                    "extension/linear/seed1"]
    assert [r["status"] for r in result["runs"]] == ["done"] * 4
    assert [r["status"] for r in result["extension"]["runs"]] == ["done"] * 4
    assert not (tmp_path / runner.JOBS_DIR).exists()   # every run's records taken in
    state = json.loads((tmp_path / STATE_FILE).read_text())
    assert set(state["rope/seed1"]) == {"pretrain", "extrapolation", "glue"}

    fake.started.clear()
    runner.run_ablation(config, tmp_path)   # nothing left: no process starts
    assert fake.started == []


def test_a_run_process_that_dies_is_a_failed_stage_and_the_others_go_on(tmp_path, monkeypatch):
    stub_figures(monkeypatch)
    fake = FakeProcesses(monkeypatch, status={"rope/seed0": -9})
    monkeypatch.setattr(runner, "_start_run", fake)
    config = small_config(seeds=1)
    config.extension.enabled = False
    config.parallel = 2
    result = runner.run_ablation(config, tmp_path)
    rows = {r["scheme"]: r for r in result["runs"]}
    assert rows["learned"]["status"] == "done"
    assert rows["rope"]["status"] == "failed" and rows["rope"]["failed_stage"] == "pretrain"
    assert "killed by SIGKILL" in rows["rope"]["error"]
    assert (tmp_path / "errors" / "rope.seed0.pretrain.txt").exists()

    fake.status.clear()   # the next session retries it
    result = runner.run_ablation(config, tmp_path)
    assert [run for run, _ in fake.started][-1] == "rope/seed0"
    assert [r["status"] for r in result["runs"]] == ["done", "done"]


def test_a_preempted_run_stops_the_ablation_and_a_killed_sessions_records_are_kept(tmp_path, monkeypatch):
    stub_figures(monkeypatch)
    preempted = PREEMPTED_EXIT
    fake = FakeProcesses(monkeypatch, status={"learned/seed0": preempted, "rope/seed0": preempted})
    monkeypatch.setattr(runner, "_start_run", fake)
    config = small_config(seeds=2)
    config.extension.enabled = False
    config.parallel = 2
    result = runner.run_ablation(config, tmp_path)
    assert [run for run, _ in fake.started] == ["learned/seed0", "rope/seed0"]   # no run starts after it
    assert [r["status"] for r in result["runs"]] == ["pending"] * 4

    # A session killed while a run's process had recorded its stages: the next one takes them in.
    jobs_dir = tmp_path / runner.JOBS_DIR
    jobs_dir.mkdir()
    run = plan.build_plan(config, tmp_path, str(tmp_path / PINNED_TOKENIZER)).run("rope/seed0")
    records = {stage.name: {"status": "done", "fingerprint": stage.fingerprint, "wall_s": 1.0, "result": {}}
               for stage in run.stages}
    (jobs_dir / "rope.seed0.state.json").write_text(json.dumps({"rope/seed0": records}))
    fake.status.clear()
    fake.started.clear()
    result = runner.run_ablation(config, tmp_path)
    assert [run for run, _ in fake.started] == ["learned/seed0", "learned/seed1", "rope/seed1"]
    assert [r["status"] for r in result["runs"]] == ["done"] * 4


# --------------------------------------------------------------------------- real runs: modes agree, kill -9, resume


@pytest.mark.slow
def test_side_by_side_runs_give_the_losses_of_runs_in_turn_and_resume_after_kill(tmp_path, monkeypatch, caplog):
    stub_figures(monkeypatch)
    caplog.set_level(logging.INFO, logger="roformer.ablate")
    # The ablation's own compile cache (in its workdir), not the suite's (tests/conftest.py).
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    runs = ["learned/seed0", "rope/seed0"]
    results = {}
    for parallel in (1, 2):
        config = tiny_config(parallel)
        config.progress_every_s = 1.0
        workdir = tmp_path / f"parallel{parallel}"
        # In turn, only the first run has started when it is killed; side by side, both.
        kill_after_first_checkpoints(workdir, config, runs[:parallel])
        caplog.clear()
        result = runner.run_ablation(config, workdir)   # resumes from the checkpoints
        # the session's progress, read from the runs' metrics in either mode
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("progress: ")]
        assert any(re.search(r"(learned|rope)/seed0 (at step \d+ of 40|finished)", line) for line in lines), lines
        assert [r["status"] for r in result["runs"]] == ["done", "done"], why_failed(workdir, result)
        assert {r["scheme"]: r["eval_loss"] for r in result["runs"]}   # a row per run
        results[parallel] = held_out_losses(workdir, runs)
        assert all(sorted(losses) == [20, 40] for losses in results[parallel].values())
        # The killed runs' programs (in turn: the command's own process), which the resumed
        # side-by-side runs loaded (their losses are checked below).
        assert any((workdir / runner.COMPILE_CACHE_DIR).glob("jit_train_step-*"))
        if parallel > 1:
            assert all((workdir / "logs" / f"{run.replace('/', '.')}.log").stat().st_size for run in runs)
            assert not (workdir / runner.JOBS_DIR).exists()
    # Identical floats wherever measured (here, and the reference recipe at 200 steps:
    # docs/results/archive/2026-11-25-many-runs-cpu.md); XLA:CPU on one thread may still sum some
    # product in another order than on two, hence a tolerance.
    for run in runs:
        assert results[2][run] == pytest.approx(results[1][run], rel=1e-5, abs=1e-5)
