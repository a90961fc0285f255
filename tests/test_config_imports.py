"""The config files are the package roformer.configs, so every command reads them from any
directory, one holding a `configs/` package of its own included (roformer/config_files.py);
a user's config file that still imports the old top-level `configs` is refused in one line."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def own_configs(tmp_path):
    """A working directory with a `configs` package of its own (a user's project), which
    has no `base` module, and a user config file that imports the old name."""
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "__init__.py").write_text('"""A user\'s own configs."""\n')
    (tmp_path / "configs" / "mine.py").write_text("def get_config():\n    return {}\n")
    (tmp_path / "old_style.py").write_text(
        "from configs import base\n\n\ndef get_config(arg=None):\n    return base.get_config(arg)\n")
    return tmp_path


def run(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    # this checkout's roformer, whichever directory the command runs in
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": path}, timeout=600)


# one process per command: pretraining's in the fast lane, the others marked slow
@pytest.mark.parametrize("command, config, expected", [
    ("roformer.pretrain", "configs/rotary.py:size=tiny", "model.position = 'rope'"),
    pytest.param("roformer.glue", "configs/glue.py", "task = 'all'", marks=pytest.mark.slow),
    pytest.param("roformer.ablate", "configs/ablation.py:smoke", "pretrain.train.steps = ", marks=pytest.mark.slow),
    pytest.param("roformer.capability", "configs/capability.py:smoke", "judge = 'pipeline'",
                 marks=pytest.mark.slow),
    pytest.param("roformer.data", "configs/tiny.py", "data.source = ", marks=pytest.mark.slow),
])
def test_every_config_command_reads_the_shipped_configs_beside_a_users_own_configs_package(
        own_configs, command, config, expected):
    args = (command, "prepare") if command == "roformer.data" else (command,)
    proc = run(own_configs, *args, f"--config={config}", "--help")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert expected in proc.stdout


@pytest.mark.slow
def test_a_config_override_is_parsed_there_too(own_configs):
    """The flags path (ml_collections loading the file), not only --help's: a misspelt key
    is refused with its did-you-mean, which needs the file loaded."""
    proc = run(own_configs, "roformer.pretrain", "--config=configs/tiny.py", "--config.train.stepz=3")
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --config.train.stepz: "), proc.stderr[-3000:]
    assert lines[0].endswith("configs/tiny.py has no key train.stepz; did you mean --config.train.steps?")


@pytest.mark.slow
@pytest.mark.parametrize("command", ["roformer.evaluate", "roformer.convert"])
def test_the_commands_without_a_config_start_there_too(own_configs, command):
    proc = run(own_configs, command, "--help")
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("help_flag", [[], pytest.param(["--help"], marks=pytest.mark.slow)])
def test_a_user_config_that_imports_the_old_configs_package_is_refused_in_one_line(own_configs, help_flag):
    proc = run(own_configs, "roformer.pretrain", "--config=old_style.py", "--workdir=w", *help_flag)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[0].startswith("error: --config=old_style.py: the config file imports the package `configs`")
    assert "from roformer.configs import base" in lines[0]


@pytest.mark.slow
def test_a_relative_configs_path_from_the_repository_root_still_works():
    proc = run(REPO, "roformer.pretrain", "--config=configs/rotary.py", "--help")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "config keys of configs/rotary.py" in proc.stdout
