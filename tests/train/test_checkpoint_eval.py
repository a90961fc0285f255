"""The held-out MLM loss of a saved checkpoint (roformer.train.checkpoint_eval, `python -m
roformer.evaluate`) is the one the training loop logged at that step, in either phase of a
two-phase run; a missing or empty workdir is one line."""
import json
import os
import subprocess
import sys

import pytest

from helpers import MICRO_MODEL, REPO_ROOT, UNWRITABLE, needs_unwritable, patient, tiny_run_config
from roformer.errors import ConfigError
from roformer.train import read_metrics, train_and_evaluate
from roformer.train.checkpoint_eval import evaluate_checkpoint

OVERRIDES = {
    **MICRO_MODEL,
    "train.steps": 4, "train.batch_size": 8, "train.seq_len": 32, "train.warmup_steps": 1,
    "train.log_every": 2, "train.eval_every": 2, "train.eval_batches": 2, "train.eval_attention_stats": False,
    "train.checkpoint_every": 2, "train.keep_checkpoints": 3, "train.progress_bar": False,
    "train.async_checkpoints": False, "mesh.num_devices": 1,
    "train.phases": "2:32:8,2:64:4",   # steps 1-2 at seq_len 32, batch 8; 3-4 at 64, batch 4
}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("pretrain") / "run"
    train_and_evaluate(tiny_run_config(tmp_path_factory.mktemp("data_cache"), OVERRIDES), workdir)
    logged = {r["step"]: r for r in read_metrics(workdir) if "eval_loss" in r}
    assert sorted(logged) == [2, 4]
    return workdir, logged


@pytest.mark.parametrize("step, shape", [(2, (8, 32)), (4, (4, 64))])
def test_a_checkpoint_scores_the_held_out_loss_the_run_logged(run, step, shape):
    workdir, logged = run
    result = evaluate_checkpoint(workdir, step=step)
    assert (result["step"], (result["batch_size"], result["seq_len"])) == (step, shape)
    for key in ("eval_loss", "eval_mlm_accuracy", "eval_shuffled_loss"):
        assert result[key] == pytest.approx(logged[step][key], rel=1e-5, abs=1e-6), key
    # The order gap is the difference of the two losses (train/loop.py), so it carries both
    # their roundings: the evaluation program is compiled apart from the loop's, and a few
    # float32 ulps of a loss near 6 are more than 1e-6 of a gap near 0.
    assert result["eval_order_gap"] == result["eval_shuffled_loss"] - result["eval_loss"]
    gap_tolerance = 1e-5 * (abs(logged[step]["eval_loss"]) + abs(logged[step]["eval_shuffled_loss"]))
    assert result["eval_order_gap"] == pytest.approx(logged[step]["eval_order_gap"], abs=gap_tolerance)
    assert result["logged"]["eval_loss"] == logged[step]["eval_loss"]


def test_more_batches_are_another_estimate(run):
    workdir, logged = run
    result = evaluate_checkpoint(workdir, eval_batches=3)
    assert result["step"] == 4 and result["eval_batches"] == 3
    assert result["eval_loss"] != pytest.approx(logged[4]["eval_loss"], rel=1e-6)


def test_evaluate_command_writes_the_step_and_names_its_output(run, tmp_path):
    workdir, logged = run
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-m", "roformer.evaluate", f"--workdir={workdir}", "--step=2"],
                          cwd=REPO_ROOT, capture_output=True, text=True, env=env, timeout=patient(300))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary, last = proc.stdout.splitlines()[-2:]
    assert summary.startswith("step 2: held-out MLM loss ") and "(the run logged " in summary
    assert last == f"done: held-out metrics in {workdir.resolve() / 'eval_2.json'}"
    written = json.loads((workdir / "eval_2.json").read_text())
    assert written["eval_loss"] == pytest.approx(logged[2]["eval_loss"], rel=1e-5)

    (tmp_path / "empty").mkdir()
    proc = subprocess.run([sys.executable, "-m", "roformer.evaluate", f"--workdir={tmp_path / 'empty'}"],
                          cwd=REPO_ROOT, capture_output=True, text=True, env=env, timeout=patient(300))
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [f"error: {tmp_path / 'empty'} is not a pretraining workdir: it has no "
                                        "checkpoints/ directory"]


def test_a_missing_workdir_or_step_is_refused(run, tmp_path):
    workdir, _ = run
    with pytest.raises(ConfigError, match="no such directory"):
        evaluate_checkpoint(tmp_path / "absent")
    with pytest.raises(ConfigError, match=r"has no checkpoint at step 3 \(it has steps \[2, 4\]\)"):
        evaluate_checkpoint(workdir, step=3)
    (tmp_path / "fresh" / "checkpoints").mkdir(parents=True)
    with pytest.raises(ConfigError, match="has no checkpoint yet"):
        evaluate_checkpoint(tmp_path / "fresh")


@needs_unwritable
def test_evaluate_refuses_an_unwritable_result_before_computing(tiny_run, monkeypatch, capsys):
    from roformer import evaluate
    from roformer.train import checkpoint_eval

    monkeypatch.setattr(checkpoint_eval, "evaluate_checkpoint", lambda *a, **k: pytest.fail("computed first"))
    with pytest.raises(SystemExit) as stopped:
        evaluate.main(["--workdir", str(tiny_run), "--out", str(UNWRITABLE / "eval.json")])
    err = capsys.readouterr().err.strip()
    assert stopped.value.code == 2 and err.startswith("error: cannot write the held-out metrics eval.json into")
