"""A tiny pretraining run for the tests of what a finished run refuses or keeps: its config,
the fixtures that train it once per test process (tests/conftest.py registers them for every
test module), and the check that a refused run leaves its workdir byte for byte as it was."""
import shutil
from pathlib import Path

import pytest

from helpers import MICRO_MODEL, tiny_run_config

OVERRIDES = {
    **MICRO_MODEL,
    "train.steps": 4, "train.batch_size": 8, "train.seq_len": 32, "train.warmup_steps": 1,
    "train.log_every": 2, "train.eval_every": 4, "train.eval_batches": 1, "train.eval_attention_stats": False,
    "train.checkpoint_every": 4, "train.keep_checkpoints": 2, "train.progress_bar": False,
    "mesh.num_devices": 1,
}


def make_config(cache: Path, **extra):
    return tiny_run_config(cache, OVERRIDES, **extra)


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory) -> Path:
    """The data cache (tokenizer and token shards) of the tiny runs made by `make_config`."""
    return tmp_path_factory.mktemp("data_cache")


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, tiny_cache) -> Path:
    """The tiny run finished: 4 steps, a checkpoint at step 4. Read only: `tiny_run_copy` to change it."""
    from roformer.train import train_and_evaluate

    workdir = tmp_path_factory.mktemp("finished") / "run"
    train_and_evaluate(make_config(tiny_cache), workdir)
    return workdir


@pytest.fixture
def tiny_run_copy(tiny_run, tmp_path) -> Path:
    """A copy of the finished tiny run, this test's to change."""
    workdir = tmp_path / "run"
    shutil.copytree(tiny_run, workdir)
    return workdir


def snapshot(workdir: Path) -> dict[str, bytes | None]:
    """Every file (its bytes) and directory (None) under `workdir`."""
    if not workdir.exists():
        return {}
    return {str(p.relative_to(workdir)): (p.read_bytes() if p.is_file() else None) for p in sorted(workdir.rglob("*"))}


def refused_leaves_it_alone(workdir: Path, config, error, match: str) -> None:
    from roformer.train import train_and_evaluate

    before = snapshot(workdir)
    with pytest.raises(error, match=match):
        train_and_evaluate(config, workdir)
    after = snapshot(workdir)
    assert after.keys() == before.keys(), sorted(set(after) ^ set(before))
    assert [name for name in before if before[name] != after[name]] == []
