"""Position-scheme ablation: `python -m roformer.ablate --config=configs/ablation.py --workdir=DIR`.

Every scheme is pretrained from the same `pretrain` section (model size, data, optimiser,
budget, seeds: identical data order and initialisation seed), then fine-tuned with the
same `glue` section and evaluated for length extrapolation. A scheme is a pretraining
config file in configs/ (or its short name below); only its model keys are taken, so
nothing but the position scheme differs between runs.

Defaults: learned absolute, sinusoidal, Shaw relative, T5 bias and rotary at the `mini`
size, sequence 128, on the shared English Wikipedia (../shared/data/wikipedia_en, about
10M tokens) with the BERT uncased vocabulary, for a budget of 10M tokens (about one pass),
then SST-2 and MRPC with 3 seeds. Variants (`configs/ablation.py:<arg>`):
  smoke  tiny model, 2 schemes, 40 steps on the embedded corpus (BERT vocab), MRPC on
         256 examples: a CPU check of the whole pipeline in a few minutes
Any key can be changed on the command line, e.g. `--config.schemes=rope,learned
--config.pretrain.model.size=tiny --config.budget_tokens=2000000 --config.glue.task=mrpc`.
"""
from pathlib import Path

import ml_collections

from configs import base, glue

# ../shared/data beside the repository (the project's shared-data convention).
SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def get_config(arg=None):
    c = ml_collections.ConfigDict()
    # Comma list of scheme config files (configs/<name>.py) or short names:
    # learned, sinusoidal, shaw, t5, alibi, rope, rope_linear, none.
    c.schemes = "learned,sinusoidal,shaw,t5,rope"

    # Shared pretraining config (configs/base.py layout) for every scheme.
    pre = c.pretrain = base.get_config("size=mini")
    pre.data.source = "files"
    pre.data.files = str(SHARED_DATA / "wikipedia_en" / "wiki_*")
    pre.data.file_format = "wikiextractor"
    pre.data.vocab = str(SHARED_DATA / "vocab" / "bert-base-uncased-vocab.txt")
    pre.train.seq_len = 128
    pre.train.batch_size = 128
    pre.train.learning_rate = 5e-4
    pre.train.warmup_steps = 60
    pre.train.log_every = 10
    pre.train.eval_every = 100
    pre.train.eval_batches = 16
    pre.train.checkpoint_every = 100
    # The learned table stays None here: it is sized to train.seq_len, so learned
    # absolute positions are "not applicable" beyond the pretraining length.

    # Pretraining budget in tokens (> 0 overrides pretrain.train.steps; rounded up to
    # whole steps of batch_size * seq_len tokens).
    c.budget_tokens = 10_000_000

    # Shared GLUE fine-tuning config (configs/glue.py layout); task "" skips GLUE.
    g = c.glue = glue.get_config()
    g.task = "sst2,mrpc"
    g.seeds = 3
    g.data_dir = str(SHARED_DATA / "glue")

    # Held-out MLM loss at multiples of the pretraining length, over the same text at
    # every length: the first 4x tokens of `num_docs` held-out documents that long, cut
    # into full windows (so positions really reach factor * seq_len).
    ext = c.extrapolation = ml_collections.ConfigDict()
    ext.factors = "1,2,4"
    ext.num_docs = 64
    ext.batch_size = 8
    ext.scalings = "linear,ntk"     # extra eval-only rope_scaling variants for rotary schemes

    if arg == "smoke":
        c.schemes = "learned,rope"
        pre.model.size = "tiny"
        pre.data.source = "embedded"
        pre.data.files = ""
        pre.data.file_format = "auto"
        # GLUE reads the pretraining tokenizer from the vocab file the run names.
        pre.data.vocab = str(SHARED_DATA / "vocab" / "bert-base-uncased-vocab.txt")
        pre.train.seq_len = 64
        pre.train.batch_size = 16
        pre.train.warmup_steps = 5
        pre.train.log_every = 5
        pre.train.eval_every = 20
        pre.train.eval_batches = 2
        pre.train.checkpoint_every = 20
        c.budget_tokens = 40 * 16 * 64
        g.task = "mrpc"
        g.seeds = 1
        g.max_train_examples = 256
        g.max_eval_examples = 128
        g.num_epochs = 1.0
        g.max_seq_len = 64
        ext.num_docs = 8
    elif arg:
        raise ValueError(f"unknown configs/ablation.py variant {arg!r}; choose 'smoke' or nothing")
    return c
