"""Tiny RoFormer on the embedded corpus: a ~2 minute CPU smoke run that clearly learns.

`python -m roformer.pretrain --config=configs/tiny.py --workdir=runs/tiny`
"""
from roformer.configs import base


def get_config(arg=None):
    config = base.get_config(arg)
    config.model.size = base.parse_arg(arg).get("size", "tiny")
    config.model.hidden_dropout = 0.0        # too few steps for dropout to help
    config.model.attention_dropout = 0.0
    config.data.vocab_size = 4000
    config.train.steps = 250
    config.train.batch_size = 32
    config.train.seq_len = 64
    config.train.learning_rate = 1e-3
    config.train.warmup_steps = 25
    config.train.log_every = 10
    config.train.eval_every = 100
    config.train.eval_batches = 4
    config.train.checkpoint_every = 100
    return config
