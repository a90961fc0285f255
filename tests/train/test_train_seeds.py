"""Vmapped seeds (roformer.train.seeds): K seeds of one config in one jitted step, each an
ordinary run of its own.

Two seeds trained together give each seed's losses as it trains alone; a group stopped by
SIGTERM, one of whose seeds then loses its newest checkpoint (a kill between the seeds'
saves), resumes with that seed catching up alone and ends where the uninterrupted group
ended; a seed that diverges stops alone; configs that are not one config's seeds are refused.
"""
import logging
import shutil

import pytest

from roformer.errors import ConfigError
from roformer.train import train_and_evaluate
from roformer.train import run_log
from roformer.train import seeds as train_seeds
from roformer.train.checkpoint import Checkpointer
from roformer.train.guard import CheckpointSaveFailed, TrainingDiverged
from roformer.train.metrics import ThroughputTimer
from roformer.train.seeds import check_seed_group, train_seeds_and_evaluate
from roformer.workdir import PretrainWorkdir

from helpers.train import SEEDS, losses_match, rows, seed_configs


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("seeds_cache")


@pytest.fixture(scope="module")
def alone(cache, tmp_path_factory):
    """Each seed trained on its own (train_and_evaluate)."""
    root = tmp_path_factory.mktemp("alone")
    for config in seed_configs(cache):
        train_and_evaluate(config, root / f"seed{config.train.seed}")
    return root


@pytest.fixture(scope="module")
def together(cache, tmp_path_factory):
    """The seeds trained as one vmapped group, uninterrupted."""
    root = tmp_path_factory.mktemp("together")
    results = train_seeds_and_evaluate(seed_configs(cache), [root / f"seed{s}" for s in SEEDS])
    return root, results


def test_vmapped_seeds_train_as_each_seed_alone(cache, alone, together):
    root, results = together
    for seed, result in zip(SEEDS, results):
        assert result["final_step"] == 8 and not result["preempted"] and result["seeds_in_step"] == 2
        losses_match(rows(root / f"seed{seed}"), rows(alone / f"seed{seed}"))
        assert PretrainWorkdir(root / f"seed{seed}").steps() == PretrainWorkdir(alone / f"seed{seed}").steps()
        # What the other readers of a workdir take: its config and tokenizer, as a run alone writes them.
        assert (PretrainWorkdir(root / f"seed{seed}").run_config()["train"]["seed"] == seed)
        assert PretrainWorkdir(root / f"seed{seed}").tokenizer_file.is_file()
    assert rows(root / "seed0") != rows(root / "seed1")   # each seed its own initialisation and data
    again = train_seeds_and_evaluate(seed_configs(cache), [root / f"seed{s}" for s in SEEDS])
    assert [r["eval_loss"] for r in again] == [r["eval_loss"] for r in results]   # finished: nothing to do


def test_batches_made_in_worker_processes_train_the_same_floats(cache, together, tmp_path, caplog):
    root, _ = together   # batches made in the training process (no workers on a CPU backend)
    dirs = [tmp_path / f"seed{s}" for s in SEEDS]
    with caplog.at_level(logging.INFO, logger="roformer.train"):
        results = train_seeds_and_evaluate(seed_configs(cache), dirs, data_workers=2)
    assert " device: " in caplog.text and "; attention: softmax, " in caplog.text   # the start-up line
    assert all(r["final_step"] == 8 for r in results)
    for seed, directory in zip(SEEDS, dirs):
        assert rows(directory) == rows(root / f"seed{seed}")


def test_a_stopped_group_resumes_and_a_seed_behind_catches_up(cache, together, tmp_path, monkeypatch):
    dirs = [tmp_path / f"seed{s}" for s in SEEDS]
    stop_at = {"step": 3}   # SIGTERM saves at once; the evaluations at 4 and 8 still come
    monkeypatch.setattr(run_log.StopFlag, "should_stop", lambda self, step, every: step == stop_at["step"])
    stopped = train_seeds_and_evaluate(seed_configs(cache), dirs)
    assert all(r["preempted"] and r["final_step"] == 3 for r in stopped)
    assert all(PretrainWorkdir(d).steps() == [2, 3] for d in dirs)
    # A kill between the seeds' saves: seed 1's newest checkpoint never made it.
    shutil.rmtree(dirs[1] / "checkpoints" / "3")
    stop_at["step"] = -1
    # Resumed with batch workers: each stream continues from its seed's checkpointed state.
    resumed = train_seeds_and_evaluate(seed_configs(cache), dirs, data_workers=2)
    assert [r["start_step"] for r in resumed] == [3, 2]
    root, _ = together
    for seed, directory in zip(SEEDS, dirs):
        losses_match(rows(directory), rows(root / f"seed{seed}"))


def test_a_seed_that_diverges_or_cannot_save_stops_alone(cache, alone, tmp_path, monkeypatch):
    """Three seeds: seed 1 diverges at step 5, seed 2's last checkpoint save fails (a full
    disk); seed 0 trains on to the end as it would alone."""
    seeds = (0, 1, 2)
    dirs = [tmp_path / f"seed{s}" for s in seeds]
    flush, wait = run_log.TrainLog.flush, Checkpointer.wait

    def diverge_seed1(self, step):
        if self.writer.path.parent.resolve() == dirs[1].resolve() and step >= 5:
            self.stop("a test's divergence", step, 4)
        flush(self, step)

    def fail_seed2_at_the_end(self):
        if self.directory == (dirs[2] / "checkpoints").resolve() and (self._pending or {}).get("step") == 8:
            self.manager.wait_until_finished()
            self._failed(OSError(28, "No space left on device"))
        wait(self)

    monkeypatch.setattr(run_log.TrainLog, "flush", diverge_seed1)
    monkeypatch.setattr(Checkpointer, "wait", fail_seed2_at_the_end)
    # The two seeds left after seed 1 stopped go on in a program of their own, whose first
    # step compiles: their throughput timers start again there, as at a run's first step.
    restarts, restart = [], ThroughputTimer.restart
    monkeypatch.setattr(ThroughputTimer, "restart", lambda self: restarts.append(self) or restart(self))
    results = train_seeds_and_evaluate(seed_configs(cache, seeds=seeds), dirs)
    assert len(restarts) == 3 + 2 and len(set(map(id, restarts[3:]))) == 2
    assert isinstance(results[1], TrainingDiverged) and "a test's divergence" in str(results[1])
    assert isinstance(results[2], CheckpointSaveFailed) and "no space left" in str(results[2])
    assert not (dirs[1] / "summary.json").exists() and not (dirs[2] / "summary.json").exists()
    assert results[0]["final_step"] == 8
    losses_match(rows(dirs[0]), rows(alone / "seed0"))


@pytest.mark.parametrize("change, message", [
    ({"train.warmup_steps": 3}, "share every setting"),   # the rate may differ (test_train_seed_rates.py)
    ({"train.phases": "4:32:8,4:64:4"}, "phases"),
    ({"train.init_from": "/somewhere"}, "warm start"),
    ({"train.dropout_rng_impl": "rbg"}, "threefry2x32 only"),
])
def test_configs_that_are_not_one_configs_seeds_are_refused(cache, change, message):
    configs = seed_configs(cache)
    for key, value in change.items():
        section, name = key.split(".")
        for config in configs if name != "warmup_steps" else configs[1:]:
            config[section][name] = value
    with pytest.raises(ConfigError, match=message):
        check_seed_group(configs)


def test_seeds_must_differ_and_have_workdirs_of_their_own(cache, tmp_path):
    with pytest.raises(ConfigError, match="must differ"):
        check_seed_group(seed_configs(cache, seeds=(3, 3)))
    with pytest.raises(ConfigError, match="workdir of its own"):
        train_seeds.train_seeds_and_evaluate(seed_configs(cache), [tmp_path, tmp_path])
