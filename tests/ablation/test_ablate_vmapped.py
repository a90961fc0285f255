"""config.vmap_seeds: a scheme's seeds pretrained together in one vmapped step
(roformer.train.seeds), each still a run of its own in the ablation.

One test trains real smoke-size runs both ways, kills each ablation with SIGKILL
mid-training, resumes it and compares the held-out losses; the others check the settings.
"""
import logging
import re

import pytest

from roformer.ablation import runner
from roformer.ablation.state import AblationState
from roformer.train import seeds as train_seeds
from roformer.train.guard import TrainingDiverged

from helpers.ablation import (FakeStages, held_out_losses, kill_after_first_checkpoints, small_config, stub_figures,
                              tiny_config, why_failed)


@pytest.mark.parametrize("changes, message", [
    ({"vmap_seeds": 0}, "vmap_seeds=0"),
    ({"vmap_seeds": 2, "pretrain.train.phases": "20:64:8,20:128:4"}, "phases"),
    ({"vmap_seeds": 2, "pretrain.train.init_from": "/a/pretrain/workdir"}, "warm-start"),
    ({"vmap_seeds": 2, "pretrain.train.dropout_rng_impl": "rbg"}, "threefry2x32 only"),
])
def test_validate_refuses_what_vmapped_seeds_cannot_do(changes, message):
    config = small_config()
    for path, value in changes.items():
        *parents, key = path.split(".")
        section = config
        for parent in parents:
            section = section[parent]
        section[key] = value
    with pytest.raises(ValueError, match=message):
        runner.run_ablation(config, "/nonexistent/never/written")


def test_the_vmapped_pass_records_each_seed_and_does_not_retry_a_failed_one_in_the_session(tmp_path, monkeypatch):
    """The group's outcomes as train_seeds_and_evaluate gives them: a seed finished earlier on
    its own (its summary has no seeds_in_step), one that trained in the group, one that diverged."""
    stub_figures(monkeypatch)
    stages = FakeStages()
    stages.install(monkeypatch)
    groups = []

    def train_group(configs, workdirs):
        groups.append([c.train.seed for c in configs])
        done = {"final_step": configs[0].train.steps, "preempted": False}
        return [dict(done), {**done, "seeds_in_step": 3}, TrainingDiverged("diverged in a test")]

    monkeypatch.setattr(train_seeds, "train_seeds_and_evaluate", train_group)
    config = small_config("rope", seeds=3)
    config.vmap_seeds, config.glue.task, config.extension.enabled = 4, "", False
    (tmp_path / "errors").mkdir()
    (tmp_path / "errors" / "rope.seed0.pretrain.txt").write_text("an earlier failure")
    runner.run_ablation(config, tmp_path)
    assert groups == [[0, 1, 2]]
    records = AblationState(tmp_path).data
    assert [records[f"rope/seed{k}"]["pretrain"].get("result", {}).get("seeds_in_step") for k in (0, 1)] == [1, 3]
    assert records["rope/seed2"]["pretrain"]["status"] == "failed"
    assert "diverged in a test" in records["rope/seed2"]["pretrain"]["error"]
    assert not (tmp_path / "errors" / "rope.seed0.pretrain.txt").exists()
    # The stages after pretraining ran for the seeds that trained; the failed seed is left for
    # the next session, not trained again alone in this one.
    assert stages.calls == [("rope/seed0", "extrapolation"), ("rope/seed1", "extrapolation")]


@pytest.mark.slow
def test_vmapped_seeds_resume_after_kill_and_give_the_losses_of_runs_in_turn(tmp_path, monkeypatch, caplog):
    stub_figures(monkeypatch)
    caplog.set_level(logging.INFO, logger="roformer.ablate")
    runs = ["rope/seed0", "rope/seed1"]
    results = {}
    for vmap_seeds in (1, 2):
        config = tiny_config(1)
        config.schemes, config.seeds, config.vmap_seeds = ("rope",), 2, vmap_seeds
        config.progress_every_s = 1.0
        workdir = tmp_path / f"vmap{vmap_seeds}"
        if vmap_seeds > 1:   # killed once both seeds saved step 10 (in turn, tests/ablation/test_ablate_parallel.py)
            kill_after_first_checkpoints(workdir, config, runs)
        caplog.clear()
        result = runner.run_ablation(config, workdir)   # resumes from the checkpoints
        assert [r["status"] for r in result["runs"]] == ["done", "done"], why_failed(workdir, result)
        # the session's progress: vmapped seeds write their own metrics as runs alone do
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("progress: ")]
        assert any(re.search(r"rope/seed[01] (at step \d+ of 40|finished)", line) for line in lines), lines
        results[vmap_seeds] = held_out_losses(workdir, runs)
        assert all(sorted(losses) == [20, 40] for losses in results[vmap_seeds].values())
        records = AblationState(workdir).data
        assert {records[run]["pretrain"]["result"].get("seeds_in_step") for run in runs} == (
            {2} if vmap_seeds == 2 else {None})
        assert all(records[run]["extrapolation"]["status"] == "done" for run in runs)
    for run in runs:   # float rounding: a product of two stacked seeds may be summed in another order
        assert results[2][run] == pytest.approx(results[1][run], rel=1e-5, abs=1e-5)
