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
  gpu_tiny, gpu_mini, gpu_small, gpu_smoke
             the comparison sized for one accelerator call (roformer.ablation.study)
  gpu_tiny_long
             gpu_tiny to 41M tokens per member, over several accelerator calls
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
    if arg not in VARIANTS:
        raise ConfigError(f"unknown configs/ablation.py variant {arg!r}; choose one of "
                          f"{', '.join(repr(v) for v in VARIANTS)} or nothing")
    builds_on, keys = VARIANTS[arg]
    return {**(variant_keys(builds_on) if builds_on else {}), **keys}


# The reference recipe (no dropout, a vocabulary sized to the model, batch 16 at a high
# learning rate) applies to every scheme alike; docs/ablation.md gives its measurements.
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

# The accelerator comparison (roformer.ablation.study): every scheme, 8 seeds x 3 learning
# rates per scheme in one vmapped program, the rate chosen on a validation split,
# warmup-stable-decay with cooldowns at three budgets, a test split of >= 200k masked
# predictions. Each size's budgets are what fits one device call (how they were sized:
# docs/ablation.md, the accelerator comparison); `time_limit_s` stops before a scheme that
# would not finish in time (the command resumes there). The splits come from a pack
# (study.data_pack), so the device does no text work.
STUDY = {
    # rope first: the reference, so a comparison exists as soon as a second scheme finishes.
    "schemes": "rope,shaw,learned,t5,alibi,sinusoidal,none",
    "reference": "rope",
    "seeds": 8,
    "learning_rates": "7e-4,1.4e-3,2.8e-3",   # a factor 2 apart around the reference sweep's best
    # After every scheme's grid: a scheme whose rate is at the grid's edge at some budget trains
    # its seeds one step beyond that edge too, so the grid brackets each optimum (or says it does not).
    "extend_edges": True,
    "budget_steps": "500,1000,2000",          # each a budget's end
    "cooldown_fraction": 0.2,                 # each budget decays over its last 20% (Hägele et al. 2024)
    "warmup_steps": 200,
    "eval_every": 100,                        # trunk evaluations; budgets and cooldown starts are multiples
    "validation_fraction": 0.02,              # documents, by content hash, disjoint from the test split
    "test_fraction": 0.08,
    "validation_rows": 256,
    "variant_rows": 64,                       # validation rows the order-horizon variants are made of
    "windows": "2,4,8,16,32,64,128",
    "test_mask_draws": 2,                     # each test row masked twice: >= 200k predictions
    "min_test_predictions": 200_000,
    "max_test_rows": 0,                       # 0: every test row
    "eval_batch": 64,                         # rows per evaluation call, per member (their logits: vocab x 20 each)
    "margin": 0.02,                           # nats: |difference| below this is "equivalent" (TOST)
    "order_threshold": 0.1,
    "bootstrap": 2000,
    "memory_limit_gib": 0.0,                  # 0: the device's own
    # The splits as one file (python -m roformer.ablation.study pack VARIANT PATH), for a machine
    # without the corpus; "": made from pretrain.data here.
    "data_pack": "",
    "time_limit_s": 480.0,                    # no scheme starts that would end after this (0: none)
    # The next groups' programs compiled on worker threads (one each) while the device trains
    # this one; 2 keeps the device fed while a group compiles in up to twice its training time.
    "compile_ahead": 2,
}

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
    # docs/ablation.md#learning-rate-per-scheme).
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
    # evaluation lengths, whose compilations would cost more than the comparison on a lent
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
    "gpu_tiny": ("reference", {
        "study": STUDY,
        "pretrain.model.num_heads": 4,        # ALiBi needs >= 4 heads (roformer.ablation.study.ALIBI_MIN_HEADS)
        "pretrain.train.weight_decay": 0.01,
        "glue.task": "",
        "extension.enabled": False,
    }),
    # gpu_tiny to the onset study's 41M tokens, where learned and T5 positions use order
    # (gpu_tiny's 4.1M is before they start): 2-3 schemes a device call, the rest resumed.
    "gpu_tiny_long": ("gpu_tiny", {
        "study.budget_steps": "5000,10000,20000",
        "study.eval_every": 500,
    }),
    "gpu_mini": ("gpu_tiny", {
        "pretrain.model.size": "mini",
        "study.learning_rates": "5e-4,1e-3,2e-3",
        "study.budget_steps": "240,480,960",
        "study.eval_every": 48,
        "study.warmup_steps": 96,
    }),
    "gpu_small": ("gpu_tiny", {                  # the stretch: 4 x 512, 8 heads
        "pretrain.model.size": "small",
        "pretrain.model.num_heads": 8,
        "study.learning_rates": "2.5e-4,5e-4,1e-3",
        "study.budget_steps": "120,240,480",
        "study.eval_every": 24,
        "study.warmup_steps": 48,
    }),
    "gpu_smoke": ("gpu_tiny", {                  # the pipeline at CPU-test size, on the embedded corpus
        "study.schemes": "rope,alibi,sinusoidal",
        "study.seeds": 2,
        "study.learning_rates": "1e-3,2e-3",
        "study.budget_steps": "10,20",
        "study.eval_every": 2,
        "study.warmup_steps": 2,
        "study.validation_fraction": 0.2,
        "study.test_fraction": 0.2,
        "study.validation_rows": 8,
        "study.variant_rows": 4,
        "study.windows": "2,8,32",
        "study.min_test_predictions": 100,
        "study.max_test_rows": 16,
        "study.eval_batch": 8,
        "study.bootstrap": 200,
        "study.time_limit_s": 0.0,
        # On a CPU the device is the host's own cores, so compiling ahead competes with training:
        # one group ahead runs the path at the least cost.
        "study.compile_ahead": 1,
        "pretrain.model.hidden_size": 32,
        "pretrain.model.intermediate_size": 64,
        "pretrain.model.num_layers": 1,
        "pretrain.data.source": "embedded",
        "pretrain.data.files": "",
        "pretrain.data.file_format": "auto",
        "pretrain.data.vocab_size": 1000,
        "pretrain.train.seq_len": 32,
        "pretrain.train.batch_size": 4,
    }),
}
