"""What the training tests share: the tiny model and synthetic batch of the step tests, the
default optimizer, and the micro pretraining runs (one run, vmapped seeds)."""
from pathlib import Path

import numpy as np
import pytest

from roformer.model import ModelConfig
from roformer.train import read_metrics
from roformer.train.config import TrainConfig
from roformer.train.optim import make_optimizer

from helpers import MICRO_MODEL, tiny_run_config

TINY = ModelConfig(vocab_size=128, hidden_size=32, num_layers=1, num_heads=4, intermediate_size=64,
                   max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0)


def synthetic_batch(seed: int, batch: int = 8, length: int = 32, preds: int = 6, vocab: int = 128):
    """A packed MLM batch in the pipeline's format: two documents per row."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(5, vocab, (batch, length)).astype(np.int32)
    split = length // 2
    positions = np.concatenate([np.arange(split), np.arange(length - split)])[None].repeat(batch, 0)
    segments = np.concatenate([np.ones(split), 2 * np.ones(length - split)])[None].repeat(batch, 0)
    masked = np.sort(np.stack([rng.choice(length, preds, replace=False) for _ in range(batch)]), 1)
    labels = np.take_along_axis(ids, masked, 1)
    inputs = ids.copy()
    np.put_along_axis(inputs, masked, 4, 1)
    weights = np.ones((batch, preds), np.float32)
    weights[:, -1] = 0.0                      # a padding slot
    return {"input_ids": inputs, "token_type_ids": np.zeros_like(ids),
            "positions": positions.astype(np.int32), "segment_ids": segments.astype(np.int32),
            "masked_positions": masked.astype(np.int32), "masked_labels": labels.astype(np.int32),
            "masked_weights": weights}


def optimizer(**overrides):
    """make_optimizer with the default AdamW settings (TrainConfig), 10 steps, warmup 2, lr 1e-2."""
    tc = TrainConfig()
    settings = dict(learning_rate=1e-2, warmup_steps=2, total_steps=10, decay=tc.decay, weight_decay=tc.weight_decay,
                    b1=tc.b1, b2=tc.b2, eps=tc.eps, clip_norm=tc.clip_norm)
    return make_optimizer(**{**settings, **overrides})


# The micro pretraining run: 8 steps of batch 8 x 32 on one device, logged every step, a
# checkpoint every 2 (two kept), no held-out evaluation before step 1000.
MICRO_RUN = {
    **MICRO_MODEL,
    "train.steps": 8, "train.batch_size": 8, "train.seq_len": 32, "train.warmup_steps": 2,
    "train.log_every": 1, "train.eval_every": 1000, "train.eval_batches": 1,
    "train.checkpoint_every": 2, "train.keep_checkpoints": 2, "train.progress_bar": False,
    "train.async_checkpoints": False, "train.peak_flops_per_device": 1e11,
    "mesh.num_devices": 1,
}


def make_config(cache: Path, **extra):
    return tiny_run_config(cache, MICRO_RUN, **extra)


SEEDS = (0, 1)
# Evaluated at steps 4 and 8, checkpoints every 2 steps (two kept).
SEED_EXTRA = {"train.phases": "", "train.steps": 8, "train.eval_every": 4}


def seed_configs(cache, seeds=SEEDS, **extra):
    """One micro run's config per seed, as a vmapped group trains them."""
    return [make_config(cache, **SEED_EXTRA, **extra, **{"train.seed": seed}) for seed in seeds]


def rows(workdir):
    """(step, training loss or held-out loss) of every metrics row."""
    return [(r["step"], r.get("loss", r.get("eval_loss"))) for r in read_metrics(workdir)]


def losses_match(got, want):
    assert [s for s, _ in got] == [s for s, _ in want]
    # One program for K seeds may sum a product in another order than one seed's: float rounding.
    assert [x for _, x in got] == pytest.approx([x for _, x in want], rel=1e-5, abs=1e-5)
