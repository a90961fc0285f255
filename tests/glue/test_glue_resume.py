"""A killed GLUE run, run again, goes on from the fine-tuning state it saved (config.checkpoint_every)
and ends where an uninterrupted run ends: the same params, losses, scores and rows."""
import json

import jax
import numpy as np
import pytest

from helpers.glue import tiny_config
from roformer.configs import glue as glue_config
from roformer.glue import finetune as finetune_lib
from roformer.glue import run as glue_run
from roformer.glue.resume import SeedCheckpoints


class Killed(BaseException):
    """What a kill at a step is to the code under test: it ends the run there."""


CALL_INPUTS = finetune_lib.call_inputs


def count_calls(monkeypatch, kill_at: int = 0, kill=Killed) -> list:
    """Count the calls of a train program (the first step of each); with `kill_at`, the
    kill_at-th call (from 1) ends the run before it runs, as a kill there would (`kill`:
    KeyboardInterrupt for a Ctrl-C)."""
    calls = []

    def counted(program, padded, plan, rates, first):
        calls.append(first)
        if len(calls) == kill_at:
            raise kill(f"killed before the call from step {first}")
        return CALL_INPUTS(program, padded, plan, rates, first)

    monkeypatch.setattr(finetune_lib, "call_inputs", counted)
    return calls


def _small_run():
    from roformer.glue.features import Features
    from roformer.model import ModelConfig

    config = glue_config.get_config()
    config.update(batch_size=4, max_seq_len=32, num_epochs=1.0, learning_rate=1e-3)
    protocol = finetune_lib.Protocol.from_config(config, "sst2")
    model_config = ModelConfig(vocab_size=100, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)
    classifier = finetune_lib.Classifier.split(finetune_lib.create_model(model_config, 2, 0))
    rng = np.random.default_rng(0)
    ids = [rng.integers(5, 100, k).astype(np.int32) for k in rng.integers(3, 30, 26)]
    features = Features(ids, [np.zeros(len(x), np.int32) for x in ids], rng.integers(0, 2, 26).astype(np.int32),
                        np.arange(26))
    return features, protocol, classifier, finetune_lib.Programs(classifier, protocol.update_settings, False)


def test_a_seed_killed_mid_run_resumes_at_its_last_state_with_the_uninterrupted_result(tmp_path, monkeypatch):
    """Killed before its 3rd call (steps 5-6), with a state saved every 2 steps (after each
    call of 2): the rerun restores step 4 and runs only the calls after it, and its params
    and logged rows equal an uninterrupted run's bit for bit (dropout on: each step's masks
    come from the seed and the step)."""
    features, protocol, classifier, programs = _small_run()
    total = protocol.total_steps(len(features))
    assert total == 7

    def run(checkpoints=None):
        rows = []
        trained, info = finetune_lib.finetune(classifier, programs, features, protocol, seed=1, pad_id=0,
                                              log_every=1, log_fn=rows.append, progress=False, steps_per_call=2,
                                              checkpoints=checkpoints)
        return rows, jax.tree.leaves(trained.params), info

    want_rows, want_params, want_info = run()
    identity = {"task": "sst2", "seed": 1}
    count_calls(monkeypatch, kill_at=3)
    checkpoints = SeedCheckpoints(tmp_path / "seed1", identity, every=2)
    with pytest.raises(Killed):
        run(checkpoints)
    checkpoints.close()
    assert sorted(int(p.name) for p in (tmp_path / "seed1").iterdir() if p.name.isdigit()) == [4]

    calls = count_calls(monkeypatch)
    checkpoints = SeedCheckpoints(tmp_path / "seed1", identity, every=2)
    rows, params, info = run(checkpoints)
    checkpoints.close()
    assert calls == [4, 6]                       # only the calls after the saved state
    assert rows == want_rows and info["final_loss"] == want_info["final_loss"]
    for ours, theirs in zip(params, want_params):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))

    calls.clear()    # finished: its last state is restored, nothing trains
    checkpoints = SeedCheckpoints(tmp_path / "seed1", identity, every=2)
    rows, params, info = run(checkpoints)
    checkpoints.close()
    assert calls == [] and rows == want_rows and info["steps"] == total
    for ours, theirs in zip(params, want_params):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))

    # a state of another protocol (say) is not resumed: the seed trains from its start
    checkpoints = SeedCheckpoints(tmp_path / "seed1", {**identity, "protocol": "another"}, every=2)
    assert checkpoints.restore(programs.abstract_params, programs.abstract_opt_state) is None
    checkpoints.close()


@pytest.fixture(scope="module")
def vocab(shared_data):
    return str(shared_data / "vocab" / "bert-base-uncased-vocab.txt")


def _results_without_times(workdir):
    results = json.loads((workdir / "glue_results.json").read_text())
    for task in results["tasks"].values():
        for key in ("wall_seconds", "compile_seconds"):
            task.pop(key)
        for seed in task["seeds"].values():
            for key in ("train_seconds", "train_steps_per_sec"):
                seed.pop(key)
    return results


def _rows(workdir):
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_glue_run_killed_in_its_second_seed_resumes_there_and_ends_as_an_uninterrupted_run(
        shared_data, vocab, tmp_path, monkeypatch, caplog):
    """MRPC, 2 seeds of 40 steps (3 calls each), a state saved every 16 steps: stopped (Ctrl-C)
    before seed 1's second call, which says how to go on, the same run again trains only seed 1's last two calls (seed 0's
    last state and seed 1's at step 16 are restored), and its results and metrics rows are
    the uninterrupted run's; the task's states go once its results are written."""
    config = tiny_config(shared_data, vocab, tasks="mrpc")
    config.update(seeds=2, max_train_examples=80, batch_size=2, checkpoint_every=16, log_every=8,
                  save_models="none")
    glue_run.run_glue(config, tmp_path / "whole")

    count_calls(monkeypatch, kill_at=5, kill=KeyboardInterrupt)   # seed 0: calls from 0, 16, 32; seed 1: 0, stop
    with pytest.raises(KeyboardInterrupt), caplog.at_level("WARNING", logger="roformer.glue"):
        glue_run.run_glue(config, tmp_path / "killed")
    assert any(r.getMessage().startswith("MRPC interrupted: the same command again goes on from its state saved in")
               for r in caplog.records)
    assert (tmp_path / "killed" / "resume" / "mrpc" / "seed0" / "40").is_dir()
    assert (tmp_path / "killed" / "resume" / "mrpc" / "seed1" / "16").is_dir()

    calls = count_calls(monkeypatch)
    glue_run.run_glue(config, tmp_path / "killed")
    assert calls == [16, 32]
    assert _results_without_times(tmp_path / "killed") == _results_without_times(tmp_path / "whole")
    assert _rows(tmp_path / "killed") == _rows(tmp_path / "whole")
    assert not (tmp_path / "killed" / "resume").exists()
