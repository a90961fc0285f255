"""Capability check: `python -m roformer.capability --config=configs/capability.py --workdir=DIR`.

Every scheme of the reference comparison (and the `none` control) trains from scratch on a
synthetic corpus where word order decides the answer (`pairs`) and where left and right do
(`direction`), with the reference comparison's recipe (configs/ablation.py:reference: the
tiny model, no dropout, AdamW at 2e-3) at sequence 32 and batch 64 (its 2,048 tokens per
step); roformer/capability.py says why a bag of words cannot pass `pairs` and why a scheme
blind to direction cannot pass `direction`. Results and run time on a 2-core CPU:
docs/results/2026-11-25-capability-and-learning-rates.md.
Variants (`configs/capability.py:<arg>`):
  smoke  two schemes, a few steps, a small corpus: the whole pipeline in minutes on a CPU. A
         pipeline check (judge = "pipeline"): 20 steps teach no scheme either rule, so it
         passes when every scheme trains and is probed and `none` stays within its bounds
"""
import ml_collections

from roformer.configs import ablation
from roformer.errors import ConfigError


def get_config(arg=None):
    c = ablation.get_config("reference")
    # Symmetric ALiBi's outputs reverse with its input (direction); with the tiny preset's 2
    # heads its slopes (1/16, 1/256) let no head prefer an adjacent word (pairs), which the
    # results page's 8-head run separates from the symmetry.
    c.expect_fail = "alibi:direction,alibi:pairs"
    c.threshold = 0.8                   # accuracy every order-aware scheme must reach
    c.seed = 0                          # the world's rules, the corpus, initialisation, data order
    c.judge = "schemes"                 # schemes: each passes or fails as expected | pipeline (roformer.capability)
    corpus = c.corpus = ml_collections.ConfigDict()
    corpus.num_symbols = 16             # keys, values and direction symbols: 16 of each
    corpus.num_fillers = 16
    corpus.pairs_per_doc = 8            # `none` can be right at most 1/8 of the time on pairs
    corpus.max_filler = 12              # filler words on each side of `x y`: 0..12, independently
    corpus.direction_per_pairs = 1      # direction documents after each pairs document
    corpus.train_docs = 24_000
    corpus.probe_docs = 500             # held-out documents per task
    pre = c.pretrain
    pre.data.packing = "document"       # one document per row: no document is cut at a row's end
    # One document per row and every document fits in 32 tokens: batch 64 x 32 is the reference's
    # 2,048 tokens per step with twice the documents (examples of each rule) that 32 x 64 holds.
    pre.train.seq_len = 32
    pre.train.batch_size = 64
    pre.train.steps = 2_500
    pre.train.warmup_steps = 100
    pre.train.eval_every = 100
    pre.train.eval_batches = 4
    pre.train.checkpoint_every = 100
    pre.train.keep_checkpoints = 100    # every checkpoint is probed
    pre.train.log_every = 50
    pre.data.vocab = ""                 # set to the corpus's own word list at run time
    for key in ("stages", "seeds", "reference", "baseline", "order_threshold", "budget_tokens", "glue",
                "extrapolation", "extension"):   # the comparison's keys that do not apply here
        del c[key]
    if arg == "smoke":
        c.judge = "pipeline"
        c.schemes = ("rope", "none")
        corpus.train_docs = 2_000
        corpus.probe_docs = 40
        pre.train.steps = 20
        pre.train.warmup_steps = 5
        pre.train.eval_every = 10
        pre.train.checkpoint_every = 10
        pre.train.log_every = 5
    elif arg:
        raise ConfigError(f"unknown configs/capability.py variant {arg!r}; choose 'smoke' or nothing")
    return c
