"""What every command line shares (roformer/cli.py): a user error is one stderr line and
exit status 2 (ROFORMER_TRACEBACK=1 brings the traceback back), a misspelt config key
gets a did-you-mean, a bug keeps its traceback, library INFO logs only with --verbosity,
and --help lists the config keys with their defaults."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from roformer import cli
from roformer.glue.readers import read_local
from roformer.glue.tasks import TASKS

from helpers import patient

REPO = Path(__file__).resolve().parents[1]


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=patient(600))


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    return lines[0]


def test_misspelt_config_key_is_one_line_with_a_did_you_mean(tmp_path):
    command = ("roformer.pretrain", "--config=configs/tiny.py", f"--workdir={tmp_path / 'run'}",
               "--config.train.stepz=5")
    assert one_error_line(run(*command)) == (
        "error: --config.train.stepz: configs/tiny.py has no key train.stepz; did you mean --config.train.steps?")
    shown = run(*command, env={cli.TRACEBACK_ENV: "1"})
    assert shown.returncode != 0 and "Traceback (most recent call last)" in shown.stderr
    # GLUE's config file is the default one when --config is not given
    line = one_error_line(run("roformer.glue", f"--workdir={tmp_path / 'glue'}", "--config.tsk=sst2"))
    assert line.endswith("configs/glue.py has no key tsk; did you mean --config.task?")
    line = one_error_line(run("roformer.ablate", "--config=configs/ablation.py:smoke",
                              f"--workdir={tmp_path / 'ablation'}", "--config.pretrain.trian.steps=5"))
    assert line.endswith("has no key pretrain.trian; did you mean --config.pretrain.train?")
    assert not any(tmp_path.iterdir())


def test_refused_input_is_one_line_without_a_workdir_left_behind(tmp_path):
    """A value our checks refuse (here a data glob that matches nothing, found after the
    workdir lock was taken) ends the run with one line and no empty workdir."""
    command = ("roformer.pretrain", "--config=configs/tiny.py", f"--workdir={tmp_path / 'run'}",
               "--config.data.source=files", f"--config.data.files={tmp_path}/nothing*")
    assert one_error_line(run(*command)) == f"error: data.files: glob '{tmp_path}/nothing*' matched no files"
    assert not (tmp_path / "run").exists()
    shown = run(*command, env={cli.TRACEBACK_ENV: "1"})
    assert "Traceback (most recent call last)" in shown.stderr and "ConfigError: data.files" in shown.stderr


def test_ablation_report_of_a_workdir_without_an_ablation_is_one_line(tmp_path):
    """--report_to reads an ablation's workdir and trains nothing: a directory that holds no
    ablation is refused on one line, and nothing is written."""
    line = one_error_line(run("roformer.ablate", "--config=configs/ablation.py:smoke", f"--workdir={tmp_path}",
                              f"--report_to={tmp_path / 'report'}"))
    assert line == (f"error: {tmp_path.resolve()} holds no ablation (ablation_config.json is missing): give the "
                    "workdir of a `python -m roformer.ablate` run")
    assert not any(tmp_path.iterdir())


def test_the_study_command_refuses_on_one_line_and_ablate_points_to_it(tmp_path):
    """The study is its own command (roformer.study), with the shared error handling; a study
    config given to the ablation names that command."""
    assert one_error_line(run("roformer.study", "frobnicate")).startswith("error: unexpected arguments: ['frobnicate']")
    assert one_error_line(run("roformer.study", "--config=configs/study.py:gpu_huge", f"--workdir={tmp_path}")
                          ).endswith("unknown configs/study.py variant 'gpu_huge'; choose one of 'gpu_tiny', "
                                     "'gpu_tiny_long', 'gpu_tiny_end', 'gpu_mini', 'gpu_mini_long', 'gpu_small', 'gpu_smoke'")
    line = one_error_line(run("roformer.ablate", "--config=configs/ablation.py:gpu_tiny", f"--workdir={tmp_path}"))
    assert "python -m roformer.study --config=configs/study.py:gpu_tiny --workdir=DIR" in line
    assert not any(tmp_path.iterdir())


def test_flag_mistakes_and_a_missing_config_file_are_one_line(tmp_path):
    workdir = f"--workdir={tmp_path / 'run'}"
    assert one_error_line(run("roformer.pretrain", "--config=configs/tny.py", workdir)) == (
        "error: --config=configs/tny.py: no such config file configs/tny.py")
    assert "did you mean: workdir" in one_error_line(run("roformer.pretrain", "--config=configs/tiny.py",
                                                         f"--workdr={tmp_path}")).lower()
    assert one_error_line(run("roformer.pretrain", "--config=configs/tiny.py:size=mini,foo=1", workdir)) == (
        "error: flag --config=configs/tiny.py:size=mini,foo=1: unknown config argument 'foo=1'; "
        "choose from ['size=...', 'source=...', 'accel=...']")
    assert one_error_line(run("roformer.pretrain", "--config=configs/tiny.py", workdir, "stray")) == (
        "error: unexpected arguments: ['stray']")


@pytest.mark.parametrize("command, config, expected", [
    ("roformer.pretrain", None, ["--workdir:", "config keys of configs/base.py", "train.steps = 1000",
                                 "model.position = 'rope'"]),
    ("roformer.pretrain", "configs/tiny.py:size=mini", ["config keys of configs/tiny.py:size=mini",
                                                        "train.steps = 250", "model.size = 'mini'"]),
    ("roformer.glue", None, ["config keys of configs/glue.py", "task = 'all'", "per_task.rte.learning_rate = None"]),
    ("roformer.ablate", "configs/ablation.py:smoke", ["schemes = ", "pretrain.train.steps = ", "glue.task = "]),
])
def test_help_exits_0_listing_the_config_keys(command, config, expected):
    proc = run(command, *([f"--config={config}"] if config else []), "--help")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for text in expected + ["--verbosity", cli.TRACEBACK_ENV]:
        assert text in proc.stdout, text


def test_user_errors_are_precise(tmp_path, capsys):
    """An error our code raises on bad input (here GlueDataError, a UserError) is the user's;
    a ValueError from elsewhere (numpy) is a bug and keeps its traceback."""
    with pytest.raises(SystemExit) as exited, cli.user_errors():
        read_local(TASKS["sst2"], "train", tmp_path)
    assert exited.value.code == 2
    assert capsys.readouterr().err == f"error: SST-2 train split not found: no file {tmp_path}/SST-2/train.tsv\n"
    with pytest.raises(ValueError, match="reshape"), cli.user_errors():
        np.zeros(4).reshape(3)
    with pytest.raises(KeyError), cli.user_errors():
        {}["bug"]
    assert cli.is_user_error(FileNotFoundError(2, "No such file or directory", "x.txt"))
    assert cli.error_line(FileNotFoundError(2, "No such file or directory", "x.txt")) == (
        "no such file or directory: x.txt")
    assert cli.error_line(ValueError("a differs:\n  x: 1 vs 2\nUse a new workdir")) == (
        "a differs: x: 1 vs 2; Use a new workdir")


USER_ERROR_SCRIPT = """
import sys

import numpy as np

from roformer import cli
from roformer.errors import ConfigError


def refuse(value):
    return ConfigError(f"x={value}: must be at least 0")


def check(value):
    if value < 0:
        raise refuse(value)   # the message is built elsewhere, and this file is not roformer's


def main(argv):
    if argv[1] == "config":
        [check(v) for v in (1, -1)]
    elif argv[1] == "thrown":
        def steps():
            yield
        gen = steps()
        next(gen)
        gen.throw(ConfigError("thrown into a generator: the innermost frame is a yield"))
    else:
        np.zeros(4).reshape(3)   # a ValueError from library code: a bug


sys.exit(cli.entry_point(main)(sys.argv))
"""


def run_script(script: Path, *args: str) -> subprocess.CompletedProcess:
    """Run `script` (outside the repository) with this checkout's roformer first on the path."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, str(script), *args], cwd=REPO, capture_output=True, text=True,
                          env=env, timeout=patient(600))


@pytest.mark.parametrize("case, message", [
    ("config", "error: x=-1: must be at least 0"),
    ("thrown", "error: thrown into a generator: the innermost frame is a yield")])
def test_a_user_error_is_known_by_its_type_wherever_it_is_raised(tmp_path, case, message):
    """A ConfigError raised from a helper, outside roformer/, or with no `raise` line at the
    innermost frame is still one line and status 2."""
    script = tmp_path / "main.py"
    script.write_text(USER_ERROR_SCRIPT)
    proc = run_script(script, case)
    assert proc.returncode == 2 and proc.stderr.splitlines() == [message], proc.stderr[-3000:]


def test_a_library_value_error_keeps_its_traceback(tmp_path):
    script = tmp_path / "main.py"
    script.write_text(USER_ERROR_SCRIPT)
    proc = run_script(script, "library")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback (most recent call last)" in proc.stderr and "ValueError: cannot reshape" in proc.stderr
    assert not cli.is_user_error(ValueError("a bare ValueError is not known to be the user's"))


def test_every_command_module_imports_beside_the_others():
    """A test (or a notebook) imports helpers from several commands in one process: only
    roformer.pretrain defines its flags on import; the others define theirs when run, so no
    two --config flags meet."""
    modules = ["roformer.pretrain", "roformer.glue.__main__", "roformer.ablate", "roformer.capability",
               "roformer.data.__main__", "roformer.evaluate", "roformer.convert", "roformer.bench.__main__",
               "roformer.study.__main__"]
    code = "import importlib\n" + "".join(f"importlib.import_module({m!r})\n" for m in modules)
    proc = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1],
                          capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=patient(300))
    assert proc.returncode == 0, proc.stderr[-2000:]
