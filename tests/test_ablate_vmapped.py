"""config.vmap_seeds: a scheme's seeds pretrained together in one vmapped step
(roformer.train.seeds), each still a run of its own in the ablation.

One test trains real smoke-size runs both ways, kills each ablation with SIGKILL
mid-training, resumes it and compares the held-out losses; the others check the settings.
"""
import pytest

from roformer.ablation import runner
from roformer.ablation.state import AblationState

from test_ablate import small_config, stub_figures
from test_ablate_parallel import held_out_losses, kill_after_first_checkpoints, tiny_config, why_failed


@pytest.mark.parametrize("changes, message", [
    ({"vmap_seeds": 0}, "vmap_seeds=0"),
    ({"vmap_seeds": 2, "pretrain.train.phases": "20:64:8,20:128:4"}, "phases"),
    ({"vmap_seeds": 2, "pretrain.train.init_from": "/a/pretrain/workdir"}, "warm-start"),
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


@pytest.mark.slow
def test_vmapped_seeds_give_the_losses_of_runs_in_turn_and_resume_after_kill(tmp_path, monkeypatch):
    stub_figures(monkeypatch)
    runs = ["rope/seed0", "rope/seed1"]
    results = {}
    for vmap_seeds in (1, 2):
        config = tiny_config(1)
        config.schemes, config.seeds, config.vmap_seeds = "rope", 2, vmap_seeds
        workdir = tmp_path / f"vmap{vmap_seeds}"
        # In turn, only the first run has started when it is killed; vmapped, both.
        kill_after_first_checkpoints(workdir, config, runs[:vmap_seeds])
        result = runner.run_ablation(config, workdir)   # resumes from the checkpoints
        assert [r["status"] for r in result["runs"]] == ["done", "done"], why_failed(workdir, result)
        results[vmap_seeds] = held_out_losses(workdir, runs)
        assert all(sorted(losses) == [20, 40] for losses in results[vmap_seeds].values())
        records = AblationState(workdir).data
        assert {records[run]["pretrain"]["result"].get("seeds_in_step") for run in runs} == (
            {2} if vmap_seeds == 2 else {None})
        assert all(records[run]["extrapolation"]["status"] == "done" for run in runs)
    for run in runs:   # float rounding: a product of two stacked seeds may be summed in another order
        assert results[2][run] == pytest.approx(results[1][run], rel=1e-5, abs=1e-5)
