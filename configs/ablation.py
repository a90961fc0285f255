"""Position-scheme ablation: `python -m roformer.ablate --config=configs/ablation.py --workdir=DIR`.

Every scheme is pretrained from the same `pretrain` section (model size, data, optimiser,
budget, seeds: identical data order and initialisation seed), then fine-tuned with the
same `glue` section and evaluated for length extrapolation. A scheme is a pretraining
config file in configs/ (or its short name below); only its model keys are taken, so
nothing but the position scheme differs between runs.

Defaults: learned absolute, sinusoidal, Shaw relative, T5 bias and rotary at the `mini`
size, sequence 128, on the shared English Wikipedia (../shared/data/wikipedia_en) with the
BERT uncased vocabulary, for a budget of 10M tokens, then SST-2 and MRPC with 3 seeds.
Variants (`configs/ablation.py:<arg>`, each the keys it changes in `VARIANTS`; what each
is for, what it costs and what it found: docs/ablation.md):
  smoke      tiny model, 2 schemes, 40 steps on the embedded corpus: the whole pipeline on a CPU
  reference  every scheme + the `none` control, tiny model, 3 seeds, 4.1M tokens
  onset      the reference recipe for 41M tokens, more seeds and a learning rate per scheme
  long       learned and rope from `onset` at twice its budget, 5 vmapped seeds each
The accelerator comparison's variants (gpu_tiny, gpu_mini, gpu_small, gpu_smoke,
gpu_tiny_long) are configs/study.py's, for `python -m roformer.study`.
Any key can be changed on the command line, e.g. `--config.schemes=rope,learned
--config.pretrain.model.size=tiny --config.budget_tokens=2000000 --config.glue.task=mrpc`.
A list key (schemes, stages, extrapolation.factors, extrapolation.scalings,
extension.methods) takes a comma list there, or the flag once per item.
"""
import ml_collections

from roformer.configs import base, glue
from roformer.config_files import shared_data
from roformer.errors import ConfigError

SHARED_DATA = shared_data()


def get_config(arg=None):
    c = ml_collections.ConfigDict()
    # Scheme config files (configs/<name>.py) or short names: learned, sinusoidal, shaw, t5,
    # alibi, rope, rope_linear, none.
    c.schemes = ("learned", "sinusoidal", "shaw", "t5", "rope")
    # The stages of every scheme's run, in order (roformer.ablation.plan.STAGES): pretraining,
    # then any of the evaluations of its model.
    c.stages = ("pretrain", "extrapolation", "glue")
    # Pretraining seeds 0..seeds-1 per scheme (the seed sets initialisation, data order and
    # masking; every scheme of one seed sees the same). Differences to `reference` get a 95%
    # interval over the seeds.
    c.seeds = 1
    # Per-scheme exceptions, "scheme=value,...": more seeds for some schemes (e.g. "rope=5,none=5";
    # the others run `seeds`), and each scheme's own learning rate (e.g. "learned=1e-3"; the
    # others use pretrain.train.learning_rate), as chosen by scripts/lr_sweep.py. Text, as a
    # mapping has no command-line form of its own.
    c.scheme_seeds = ""
    c.scheme_learning_rates = ""
    c.reference = "rope"
    # RoFormer's convergence claim (Fig. 3) compares the reference with this scheme's curves
    # (BERT's learned absolute positions); "" or a scheme not run skips it.
    c.baseline = "learned"
    # A scheme "uses word order" once shuffling each held-out document's tokens raises its
    # loss by this much (nats, mean over seeds).
    c.order_threshold = 0.1
    # Runs trained at once, each in a process of its own with XLA:CPU's one-core settings (CPU
    # hosts, at most one per core; roformer.ablation.parallel): each process pays for its start,
    # so only runs long enough gain (docs/performance.md). Each run keeps its workdir, metrics,
    # checkpoints and report row; its output goes to DIR/logs/<run>.log.
    c.parallel = 1
    # The ablation's processes (the command's own and, with parallel > 1, the runs') keep the
    # programs they compile in DIR/compile_cache (jax's persistent compilation cache), so the
    # seeds of a scheme and a resumed run load them instead of compiling them again; False
    # compiles in every process.
    c.compile_cache = True
    # Seeds of a scheme pretrained together, this many at a time, stacked in one vmapped step on
    # one device (roformer.train.seeds): an accelerator's mode for small runs (docs/performance.md).
    # Same workdirs, records and resume; the runs' other stages go as before. 1: every run on its own.
    c.vmap_seeds = 1
    # Seconds between the session's progress lines (each training run's step, the steps done
    # and left over all runs, an estimate of the time left; roformer.ablation.progress);
    # 0: none.
    c.progress_every_s = 120.0

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

    # Shared GLUE fine-tuning config (configs/glue.py layout); task "" skips GLUE (as leaving
    # "glue" out of `stages` does).
    g = c.glue = glue.get_config()
    g.task = "sst2,mrpc"
    g.seeds = 3
    g.source = "local"
    g.data_dir = str(SHARED_DATA / "glue")

    # Held-out MLM loss at multiples of the pretraining length, over the same text at
    # every length: the first 4x tokens of `num_docs` held-out documents that long, cut
    # into full windows (so positions really reach factor * seq_len).
    ext = c.extrapolation = ml_collections.ConfigDict()
    ext.factors = (1, 2, 4, 8)
    ext.num_docs = 64
    ext.batch_size = 8
    ext.scalings = ("linear", "ntk", "yarn")   # extra eval-only rope_scaling variants for rotary schemes

    # Context extension (Chen et al. 2023, position interpolation): continue pretraining the
    # `scheme` models at `factor` x the length (same tokens per step) for `steps` steps under
    # each method (none = plain extrapolation, linear = position interpolation, ntk, yarn,
    # base = rope_base `base`), and evaluate the held-out loss at that length every
    # `eval_every` steps on the extrapolation windows.
    x = c.extension = ml_collections.ConfigDict()
    x.enabled = False
    x.scheme = "rope"
    x.seeds = 0                  # extend the models of pretraining seeds 0..seeds-1 (0: every seed)
    x.methods = ("none", "linear", "ntk", "yarn", "base")
    x.factor = 4
    x.base = 500_000.0
    x.steps = 200
    x.eval_every = 50
    x.learning_rate = 2e-4
    x.warmup_steps = 20

    if arg:
        for key, value in variant_keys(arg).items():
            *sections, name = key.split(".")
            node = c
            for section in sections:
                node = node[section]
            node[name] = value
    return c


def variant_keys(arg):
    """The keys a variant changes in the defaults, those of the variant it builds on first."""
    if arg in STUDY_VARIANTS:
        raise ConfigError(f"configs/ablation.py:{arg} is now configs/study.py:{arg}, for its own command: "
                          f"python -m roformer.study --config=configs/study.py:{arg} --workdir=DIR")
    if arg not in VARIANTS:
        raise ConfigError(f"unknown configs/ablation.py variant {arg!r}; choose one of "
                          f"{', '.join(repr(v) for v in VARIANTS)} or nothing")
    builds_on, keys = VARIANTS[arg]
    return {**(variant_keys(builds_on) if builds_on else {}), **keys}


# The reference recipe (no dropout, a vocabulary sized to the model, batch 16 at a high
# learning rate) applies to every scheme alike; docs/capability.md gives its sweep.
REFERENCE = {
    "schemes": ("learned", "sinusoidal", "shaw", "t5", "alibi", "rope", "none"),
    "seeds": 3,
    "pretrain.model.size": "tiny",
    "pretrain.model.hidden_dropout": 0.0,
    "pretrain.model.attention_dropout": 0.0,
    "pretrain.data.vocab": "",              # a WordPiece vocabulary trained on the corpus ...
    "pretrain.data.vocab_size": 8_000,      # ... sized to a 2-layer, 128-wide model
    "pretrain.train.batch_size": 16,
    "pretrain.train.learning_rate": 2e-3,
    "pretrain.train.warmup_steps": 200,
    "pretrain.train.eval_every": 200,
    "pretrain.train.eval_batches": 16,
    "pretrain.train.checkpoint_every": 500,
    "pretrain.train.progress_bar": False,
    "budget_tokens": 2_000 * 16 * 128,      # 2,000 steps
    "glue.task": "sst2",
    "glue.seeds": 1,                        # one fine-tuning seed per pretraining seed
    "glue.max_train_examples": 2_000,
    "glue.num_epochs": 3.0,
    "glue.max_seq_len": 64,
    "glue.learning_rate": 1e-3,
    "extension.enabled": True,
    "extension.seeds": 1,                   # seed 0's rope model; the time goes to the 3-seed comparison
    "extension.factor": 4,
    "extension.steps": 100,
    "extension.eval_every": 25,
    "extension.learning_rate": 5e-4,
    "extension.warmup_steps": 10,
}

# The study's variants, now configs/study.py's: named so an old command line says where they went.
STUDY_VARIANTS = ("gpu_tiny", "gpu_tiny_long", "gpu_mini", "gpu_small", "gpu_smoke")

# Each variant: the variant it builds on (None: the defaults) and the keys it changes, by
# their dotted paths.
VARIANTS = {
    "smoke": (None, {
        "schemes": ("learned", "rope"),
        "seeds": 2,
        "pretrain.model.size": "tiny",
        "pretrain.data.source": "embedded",
        "pretrain.data.files": "",
        "pretrain.data.file_format": "auto",
        # GLUE reads the pretraining tokenizer from the vocab file the run names.
        "pretrain.data.vocab": str(SHARED_DATA / "vocab" / "bert-base-uncased-vocab.txt"),
        "pretrain.train.seq_len": 64,
        "pretrain.train.batch_size": 16,
        "pretrain.train.warmup_steps": 5,
        "pretrain.train.log_every": 5,
        "pretrain.train.eval_every": 20,
        "pretrain.train.eval_batches": 2,
        "pretrain.train.checkpoint_every": 20,
        "budget_tokens": 40 * 16 * 64,      # 40 steps
        "glue.task": "mrpc",
        "glue.seeds": 1,
        "glue.max_train_examples": 256,
        "glue.max_eval_examples": 128,
        "glue.num_epochs": 1.0,
        "glue.max_seq_len": 64,
        "extrapolation.num_docs": 8,
        "extrapolation.factors": (1, 2, 4),
        "extension.enabled": True,
        "extension.factor": 2,
        "extension.steps": 10,
        "extension.eval_every": 5,
        "extension.warmup_steps": 2,
    }),
    "reference": (None, REFERENCE),
    # Run to where BERT-style models are known to start using word order, more seeds for the
    # schemes whose onset varies most, each scheme at its own rate (scripts/lr_sweep.py;
    # docs/capability.md#learning-rate-per-scheme).
    "onset": ("reference", {
        "scheme_seeds": "rope=5,learned=5,none=5",
        "scheme_learning_rates": "learned=1e-3,sinusoidal=1e-3,shaw=1e-3,t5=1e-3,alibi=1e-3,rope=2e-3,none=1e-3",
        "budget_tokens": 20_000 * 16 * 128,   # 20,000 steps
        "parallel": 2,                        # two runs at a time on a 2-core CPU
        "pretrain.train.eval_every": 250,
        "pretrain.train.checkpoint_every": 1_000,
    }),
    # The one comparison `onset` left undecided (docs/ablation.md): learned against rope at twice
    # the budget, the seeds of a scheme in one vmapped step (an accelerator's mode; on a CPU
    # --config.vmap_seeds=1 --config.parallel=2). No GLUE, context extension or longer
    # evaluation lengths, whose compilations would cost more than the comparison on an
    # accelerator (each is a flag away).
    "long": ("reference", {
        "schemes": ("learned", "rope"),
        "stages": ("pretrain", "extrapolation"),
        "seeds": 5,
        "scheme_learning_rates": "learned=1e-3,rope=2e-3",
        "budget_tokens": 40_000 * 16 * 128,   # 40,000 steps
        "vmap_seeds": 5,
        "pretrain.train.eval_every": 1_000,
        "pretrain.train.checkpoint_every": 10_000,   # each save is one per seed
        "extension.enabled": False,
        "extrapolation.factors": (1,),
        "extrapolation.scalings": (),
    }),
}
