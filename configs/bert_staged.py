"""BERT's staged recipe with rotary positions: 90% of the steps at sequence 128, the
last 10% at 512, one optimizer and one learning-rate schedule over the whole run.

    python -m roformer.pretrain --config=configs/bert_staged.py:size=base,source=files \\
        --config.data.files='corpus/*.txt' --workdir=runs/staged

Short sequences are cheaper per token (attention is quadratic in length), so most of
the budget goes there; the short last phase teaches the positions beyond 128. Each
phase is 'steps:seq_len:batch_size', optionally followed by ':lr=X', ':warmup=N' and
':max_predictions=N'; change them on the command line, e.g.
`--config.train.phases=9000:128:32,1000:512:8:max_predictions=80`. See docs/pretraining.md.
"""
from roformer.configs import base


def get_config(arg=None):
    config = base.get_config(arg)
    config.model.position = "rope"
    config.train.phases = "900000:128:256,100000:512:256"
    config.train.warmup_steps = 10_000
    return config
