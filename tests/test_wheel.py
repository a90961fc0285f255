"""A non-editable install works outside the checkout: the wheel holds every module and the
config files (configs/ installs as roformer.configs), and its commands find them.

The wheel is built from a copy of the project's files without build isolation (no network:
the `test` extra brings the setuptools it needs), installed with `pip install --target`,
and run from a directory with no configs/ in it, with the target first on PYTHONPATH."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from helpers import patient

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "roformer", "configs")


def _checkout_modules() -> set[str]:
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "roformer").rglob("*.py")}
    modules |= {f"roformer/configs/{p.name}" for p in (ROOT / "configs").glob("*.py")}
    return modules


def _run(args: list[str], cwd: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=patient(300))


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path]:
    """(the wheel, the --target directory it is installed into)."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"
    source.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        elif (ROOT / name).exists():
            shutil.copy2(ROOT / name, source / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    build = _run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(tmp / "dist"),
                  str(source)], cwd=tmp, env=os.environ.copy())
    assert build.returncode == 0, build.stdout + build.stderr
    (wheel,) = (tmp / "dist").glob("roformer_jax-*.whl")
    target = tmp / "site"
    install = _run([*pip, "install", "--no-deps", "--no-index", "--target", str(target), str(wheel)],
                   cwd=tmp, env=os.environ.copy())
    assert install.returncode == 0, install.stdout + install.stderr
    return wheel, target


def _outside_env(target: Path) -> dict:
    env = os.environ.copy()
    env["PYTHONPATH"] = os.pathsep.join([str(target), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["JAX_PLATFORMS"] = "cpu"
    return env


def test_wheel_holds_every_module_and_config_file(installed):
    wheel, _ = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = _checkout_modules() - names
    assert not missing, f"the wheel lacks {sorted(missing)}: list the package in pyproject.toml"
    assert "roformer/py.typed" in names   # type checkers read the annotations of an installed package
    # the version is written once, in roformer/__init__.py, and the metadata reads it
    version = re.search(r'^__version__ = "(.+)"$', (ROOT / "roformer" / "__init__.py").read_text(), re.M)[1]
    assert f"roformer_jax-{version}.dist-info/METADATA" in names
    assert f"roformer_jax-{version}.dist-info/licenses/LICENSE" in names
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "roformer-pretrain = roformer.console_scripts:pretrain" in zipfile.ZipFile(wheel).read(
        entry_points).decode()


def test_installed_command_runs_outside_the_checkout(installed, tmp_path):
    _, target = installed
    env = _outside_env(target)
    where = _run([sys.executable, "-c", "import roformer.config_files as c; print(c.CONFIG_DIR)"], tmp_path, env)
    assert Path(where.stdout.strip()) == target / "roformer" / "configs", where.stderr

    help_ = _run([sys.executable, "-m", "roformer.pretrain", "--help"], tmp_path, env)
    assert help_.returncode == 0, help_.stderr
    assert "train.steps = " in help_.stdout
    assert str(target / "roformer" / "configs" / "base.py") in help_.stdout


def test_console_script_takes_configs_path_from_the_package(installed, tmp_path):
    """`--config=configs/<name>.py` with no such file here: the installed file, which
    imports its base as `roformer.configs.base`."""
    _, target = installed
    script = target / "bin" / "roformer-pretrain"
    assert script.exists(), sorted(p.name for p in (target / "bin").iterdir())
    help_ = _run([sys.executable, str(script), "--config=configs/tiny.py:size=mini", "--help"], tmp_path,
                 _outside_env(target))
    assert help_.returncode == 0, help_.stderr
    assert str(target / "roformer" / "configs" / "tiny.py") in help_.stdout
    assert "model.size = 'mini'" in help_.stdout
    assert "--workdir: Run directory" in help_.stdout   # the command's own flags, as with python -m

    # a name the package does not ship stays a missing file (roformer-data: no jax to import)
    missing = _run([sys.executable, str(target / "bin" / "roformer-data"), "prepare", "--config=configs/no_such.py"],
                   tmp_path, _outside_env(target))
    assert missing.returncode == 2
    assert missing.stderr.strip() == "error: --config=configs/no_such.py: no such config file configs/no_such.py"
