"""MLM pretraining: optimizer, sharding, steps, checkpoints, metrics, FLOPs, loop."""
from roformer.train.loop import build_model_config, train_and_evaluate
from roformer.train.metrics import read_metrics

__all__ = ["build_model_config", "read_metrics", "train_and_evaluate"]
