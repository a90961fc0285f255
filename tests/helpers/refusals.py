"""A tiny pretraining run's config for the refusal tests, and the check that a refused run
leaves its workdir byte for byte as it was."""
from pathlib import Path

import pytest

from helpers import MICRO_MODEL, tiny_run_config
from roformer.train import train_and_evaluate

OVERRIDES = {
    **MICRO_MODEL,
    "train.steps": 4, "train.batch_size": 8, "train.seq_len": 32, "train.warmup_steps": 1,
    "train.log_every": 2, "train.eval_every": 4, "train.eval_batches": 1, "train.eval_attention_stats": False,
    "train.checkpoint_every": 4, "train.keep_checkpoints": 2, "train.progress_bar": False,
    "mesh.num_devices": 1,
}


def make_config(cache: Path, **extra):
    return tiny_run_config(cache, OVERRIDES, **extra)


def snapshot(workdir: Path) -> dict[str, bytes | None]:
    """Every file (its bytes) and directory (None) under `workdir`."""
    if not workdir.exists():
        return {}
    return {str(p.relative_to(workdir)): (p.read_bytes() if p.is_file() else None) for p in sorted(workdir.rglob("*"))}



def refused_leaves_it_alone(workdir: Path, config, error, match: str) -> None:
    before = snapshot(workdir)
    with pytest.raises(error, match=match):
        train_and_evaluate(config, workdir)
    after = snapshot(workdir)
    assert after.keys() == before.keys(), sorted(set(after) ^ set(before))
    assert [name for name in before if before[name] != after[name]] == []
