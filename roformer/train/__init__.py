"""MLM pretraining: optimizer, sharding, steps, checkpoints, metrics, FLOPs, loop.

The loop and its dependencies (ml_collections, tqdm, the input pipeline) load on first
use, so the step, state and FLOPs modules import on a host that has only jax, flax,
optax and orbax (`python -m roformer.bench gpu`).
"""
import importlib

_EXPORTS = {"build_model_config": "roformer.train.config", "train_and_evaluate": "roformer.train.loop",
            "read_metrics": "roformer.train.metrics"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
