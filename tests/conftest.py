"""Test setup shared by every test module: the environment (XLA's flags, set by importing
`helpers` first), the suite's compilation cache, the order of the tests and the check of
their lane markers, and the fixtures every package's tests use (those of the tiny finished
run are written in tests/helpers/refusals.py). Helpers that tests import live in
tests/helpers/, not here."""
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from helpers import REPO_ROOT, SHARED_DATA   # first: it sets XLA's flags before jax is imported

# The tiny finished pretraining run (tiny_cache, tiny_run, tiny_run_copy) several modules' tests read.
pytest_plugins = ["helpers.refusals"]


def pytest_configure(config):
    """One jax compilation cache for the whole suite: many tests (and the commands they start
    as processes) compile the same tiny programs, and a cache hit costs a file read instead of
    a compilation. Set in the controlling process before xdist starts its workers, so they
    and every process they start share it; a JAX_COMPILATION_CACHE_DIR of the caller's is kept."""
    if hasattr(config, "workerinput") or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return
    from roformer.ablation.parallel import compile_cache_settings

    directory = Path(tempfile.mkdtemp(prefix="roformer-tests-jax-cache-"))
    config._roformer_jax_cache = directory
    os.environ.update({name: str(value) for name, value in compile_cache_settings(directory).items()})


def pytest_collection_modifyitems(config, items):
    """The slow tests first (a stable sort keeps each group's order), so that none of them
    starts last and leaves one xdist worker running alone at the end of the suite. A test
    marked both `fast` (itself or by its module's `pytestmark`) and `slow` is refused: the
    fast lane (`-m fast`, docs/testing.md) must never start a slow one."""
    both = [item.nodeid for item in items if item.get_closest_marker("fast") and item.get_closest_marker("slow")]
    if both:
        raise pytest.UsageError("tests marked both fast and slow (mark the module's other tests `fast` one by one "
                                "instead of the module): " + ", ".join(both))
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_unconfigure(config):
    directory = getattr(config, "_roformer_jax_cache", None)
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.fail(f"shared data not found at {SHARED_DATA}; set ROFORMER_SHARED_DATA")
    return SHARED_DATA


@pytest.fixture(scope="session")
def wiki_cache(tmp_path_factory) -> Path:
    """One token-shard cache for every test that reads the shared Wikipedia files."""
    return tmp_path_factory.getbasetemp() / "wiki_cache"


@pytest.fixture(scope="session")
def fake_study(tmp_path_factory) -> Path:
    """A study workdir of `configs/study.py:gpu_smoke` with fake records (random losses at the
    real shapes: every scheme's grid and a group beyond it) and its report, made by
    scripts/study_report_time.py. Read only: copy it to change it."""
    import runpy

    workdir = tmp_path_factory.mktemp("fake_study") / "study"
    runpy.run_path(str(REPO_ROOT / "scripts" / "study_report_time.py"))["main"](["gpu_smoke", "--dir", str(workdir)])
    return workdir
