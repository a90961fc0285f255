"""GLUE evaluation only: the models a tiny fine-tuning run kept, reloaded from its workdir,
score what the run recorded for their seeds and write the same submission; a workdir
without saved models, a task without any and a config that disagrees are refused in one
line, before anything is written."""
import json
import os
import subprocess
import sys
import zipfile

import pytest

from roformer.errors import ConfigError
from roformer.glue import run as glue_run
from roformer.glue.evaluate import evaluate_glue

from helpers import REPO_ROOT, patient
from helpers.glue import tiny_config


@pytest.fixture(scope="module")
def vocab(shared_data):
    return str(shared_data / "vocab" / "bert-base-uncased-vocab.txt")


@pytest.fixture(scope="module")
def trained(shared_data, vocab, tmp_path_factory):
    """A tiny run that keeps every seed's model (save_models=all) and writes a submission."""
    config = tiny_config(shared_data, vocab, "mrpc,stsb")
    config.seeds = 2
    config.save_models = "all"
    config.predict_test = True
    workdir = tmp_path_factory.mktemp("glue") / "run"
    return config, workdir, glue_run.run_glue(config, workdir)


def submission(workdir) -> dict[str, str]:
    with zipfile.ZipFile(workdir / "submission.zip") as zf:
        return {name: zf.read(name).decode() for name in zf.namelist()}


def test_eval_only_scores_the_saved_models_as_the_run_recorded_them(trained, tmp_path):
    config, workdir, results = trained
    out = tmp_path / "eval"
    evaluated = evaluate_glue(config, workdir, out)
    for task in ("mrpc", "stsb"):
        recorded, scored = results["tasks"][task], evaluated["tasks"][task]
        assert set(scored["seeds"]) == {"0", "1"}
        for seed in ("0", "1"):
            assert scored["seeds"][seed]["validation"] == pytest.approx(recorded["seeds"][seed]["validation"],
                                                                       rel=1e-6, abs=1e-7)
        assert scored["median"]["validation"] == pytest.approx(recorded["median"]["validation"])
        assert scored["submitted_seed"] == recorded["submitted_seed"]
    # the median seed's test predictions: the training run's submission, file for file
    assert submission(out) == submission(workdir)
    assert json.loads((out / "glue_results.json").read_text())["tasks"]["mrpc"]["median"] == \
        evaluated["tasks"]["mrpc"]["median"]
    assert "| MRPC | validation | f1 |" in (out / "glue_results.md").read_text()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {(r["task"], r["seed"]) for r in rows} == {(t, s) for t in ("mrpc", "stsb") for s in (0, 1)}
    assert not any("loss" in r for r in rows)   # nothing trained


def test_eval_only_refusals_are_one_line_and_write_nothing(trained, tmp_path):
    config, workdir, _ = trained
    out = tmp_path / "eval"

    def refused(saved, match, **overrides):
        cfg = config.copy_and_resolve_references()
        for key, value in overrides.items():
            section, _, name = key.rpartition(".")
            (cfg[section] if section else cfg)[name] = value
        with pytest.raises(ConfigError, match=match) as error:
            evaluate_glue(cfg, saved, out)
        assert "\n" not in str(error.value) and not out.exists()

    refused(tmp_path / "absent", "no such directory")
    (tmp_path / "empty").mkdir()
    refused(tmp_path / "empty", r"holds no saved fine-tuned models \(models/<task>/seed<k>\)")
    refused(workdir, r"has no saved model of rte \(it has models of mrpc, stsb\)", task="mrpc,rte")
    refused(workdir, r"config.max_seq_len gives mrpc 64 tokens, but its model .* was fine-tuned with 32",
            max_seq_len=64)
    refused(workdir, "does not match the config: hidden_size: config.model.size='mini'", **{"model.size": "mini"})
    with pytest.raises(ConfigError, match="the evaluated run's own workdir"):
        evaluate_glue(config, workdir, workdir)


@pytest.mark.slow
def test_eval_only_command_ends_with_the_line_naming_its_outputs(trained, shared_data, tmp_path):
    config, workdir, results = trained
    out = tmp_path / "eval"
    proc = subprocess.run(
        [sys.executable, "-m", "roformer.glue", "--config=configs/glue.py", f"--eval_only={workdir}",
         f"--workdir={out}", "--config.task=mrpc", f"--config.data_dir={config.data_dir}",
         f"--config.max_seq_len={config.max_seq_len}", f"--config.max_eval_examples={config.max_eval_examples}"],
        cwd=REPO_ROOT, capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=patient(300))
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.splitlines()[-1]
    assert last == glue_run_done_line(out)
    scored = json.loads((out / "glue_results.json").read_text())["tasks"]["mrpc"]["median"]["validation"]
    assert scored == pytest.approx(results["tasks"]["mrpc"]["median"]["validation"])

    proc = subprocess.run([sys.executable, "-m", "roformer.glue", f"--eval_only={tmp_path / 'absent'}",
                           f"--workdir={tmp_path / 'eval2'}"], cwd=REPO_ROOT, capture_output=True, text=True,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=patient(300))
    assert proc.returncode == 2 and proc.stderr.splitlines()[-1].startswith("error: --eval_only=")


def glue_run_done_line(workdir) -> str:
    from roformer.glue.__main__ import done_line

    return done_line(str(workdir), {})


def test_a_second_run_in_the_same_workdir_replaces_its_tasks_models_and_eval_only_skips_the_rest(
        trained, shared_data, vocab, tmp_path, caplog):
    """A later run into the workdir (STS-B only, one seed, the median's model kept) replaces
    STS-B's models, so no seed of the earlier run stays beside its own; MRPC's models are the
    earlier run's, which its config.json and glue_results.json no longer describe, so
    --eval_only leaves them out and says so."""
    import shutil

    _, first, _ = trained
    workdir = tmp_path / "run"
    shutil.copytree(first, workdir)
    config = tiny_config(shared_data, vocab, "stsb")
    config.seeds = 1
    glue_run.run_glue(config, workdir)
    assert sorted(p.name for p in (workdir / "models" / "stsb").iterdir() if p.name.startswith("seed")) == ["seed0"]
    assert (workdir / "models" / "mrpc" / "seed1").is_dir()   # the earlier run's, left where it was
    with caplog.at_level("WARNING", logger="roformer.glue"):
        evaluated = evaluate_glue(config, workdir, tmp_path / "eval")
    assert set(evaluated["tasks"]) == {"stsb"} and set(evaluated["tasks"]["stsb"]["seeds"]) == {"0"}
    assert "models of mrpc are from an earlier run" in caplog.text
