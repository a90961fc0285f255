"""What the commands tell a person: `--help` exits 0 on every command and subcommand, and a
command ends with one line naming its outputs."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import patient

REPO = Path(__file__).resolve().parents[1]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=patient(300))


@pytest.mark.parametrize("args, expected", [
    (("roformer.data", "--help"), ["python -m roformer.data prepare", "tokenizer train"]),
    (("roformer.data", "prepare", "--help"), ["--processes:", "config keys of configs/base.py",
                                               "data.vocab_size = "]),
    (("roformer.data", "prepare", "--config=configs/tiny.py", "-h"), ["config keys of configs/tiny.py",
                                                                      "train.steps = 250"]),
    (("roformer.data", "tokenizer", "--help"), ["train", "encode"]),
    (("roformer.data", "tokenizer", "train", "--help"), ["--vocab-size:", "--out:"]),
    (("roformer.convert", "--help"), ["from-hf", "to-hf", "--rope-layout:"]),
    (("roformer.bench", "--help"), ["python -m roformer.bench <rope|step"]),
    (("roformer.convert", "to-hf", "--help"), ["--step"]),
    (("roformer.evaluate", "--help"), ["--workdir", "--step", "--eval-batches", "--out"]),
])
def test_help_exits_0(args, expected):
    proc = run(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for text in expected:
        assert text in proc.stdout, text


def test_data_prepare_without_its_config_file_is_one_line():
    proc = run("roformer.data", "prepare", "--config=configs/no_such.py:smoke")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == ["error: --config=configs/no_such.py:smoke: no such config file "
                                        "configs/no_such.py"]


def test_data_commands_say_a_bad_input_file_in_one_line(tmp_path):
    """`prepare` and `tokenizer` turn a data error into one line and status 2, as pretraining does."""
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"caf\xe9\n")
    proc = run("roformer.data", "tokenizer", "encode", "--vocab", str(tmp_path / "no_vocab.txt"), "hello")
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr
    proc = run("roformer.data", "prepare", "--config=configs/tiny.py", "--config.data.source=files",
               f"--config.data.files={bad}", f"--config.data.cache_dir={tmp_path / 'cache'}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: data.files: ") and "not valid UTF-8" in proc.stderr


def test_data_without_a_command_is_a_usage_error():
    proc = run("roformer.data")
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        "error: give a command, prepare or tokenizer (see --help)"]


def named_paths(line: str, root: Path) -> list[Path]:
    return [Path(word.rstrip(",")) for word in line.split() if word.startswith(str(root))]


@pytest.mark.slow
def test_glue_ends_with_a_line_naming_its_outputs(tmp_path, shared_data):
    workdir = tmp_path / "glue"
    proc = run("roformer.glue", "--config=configs/glue.py:smoke", "--config.task=wnli", "--config.max_steps=2",
               "--config.max_train_examples=16", "--config.max_eval_examples=16", "--config.model.size=tiny",
               f"--config.data_dir={shared_data / 'glue'}",
               f"--config.vocab={shared_data / 'vocab' / 'bert-base-uncased-vocab.txt'}", f"--workdir={workdir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.splitlines()[-1]
    assert last.startswith("done: results in ")
    named = named_paths(last, workdir)   # results x2, metrics, TensorBoard, the model and its HF export
    assert len(named) == 6 and all(p.exists() for p in named), named
    assert named[-2:] == [workdir / "models" / "wnli" / "seed0", workdir / "models" / "wnli" / "hf"]


@pytest.mark.slow
def test_pretraining_off_a_terminal_logs_plain_progress_and_compile_lines(tmp_path):
    """stderr is a pipe here: no bar redraws (carriage returns), a plain progress line, the
    first call of each step announced with its time; stdout: the summary as one short line,
    then the line naming the outputs."""
    workdir = tmp_path / "run"
    proc = run("roformer.pretrain", "--config=configs/tiny.py", f"--workdir={workdir}", "--config.train.steps=4",
               "--config.train.eval_every=4", "--config.train.checkpoint_every=4", "--config.train.log_every=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "\r" not in proc.stderr
    for text in ("compiling the train step ...", "compiled the train step in ", "compiling the evaluation step ...",
                 "compiling the attention-statistics step ...", "pretrain: step 4 of 4 (100%)"):
        assert text in proc.stderr, text
    summary, last = proc.stdout.splitlines()[-2:]
    assert summary.startswith("summary: 4 steps; train loss ") and len(summary) < 300
    assert summary.endswith(f"(all of it in {workdir}/summary.json)")
    assert last.startswith(f"done: metrics in {workdir}/metrics.jsonl")


def test_tokenizing_off_a_terminal_draws_no_bar(tmp_path):
    """The token-shard build's bar stays off when stderr is a file (as here): its closing
    log line says what it did."""
    proc = run("roformer.data", "prepare", "--config=configs/tiny.py", f"--config.data.cache_dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "\r" not in proc.stderr and "tok/s]" not in proc.stderr
    assert re.search(r"\] tokenized \d+ docs / \d+ tokens in ", proc.stderr)   # the closing line
