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
  reference  every scheme + the `none` control, tiny model, 3 seeds, 4.1M tokens, shuffle
         probe, extrapolation to 8x, context extension of rope at 4x: the comparison in
         docs/ablation.md (which gives its time on a 2-core CPU)
  smoke  tiny model, 2 schemes, 40 steps on the embedded corpus (BERT vocab), MRPC on
         256 examples: a CPU check of the whole pipeline in a few minutes
  onset  the reference recipe for 20,000 steps (41M tokens), 3 seeds (5 for rope, learned
         and none), each scheme at its own learning rate: the onset study in docs/ablation.md
  long   learned and rope from `onset` at twice its budget (40,000 steps, 82M tokens), 5 seeds
         each, vmapped 5 at a time: the comparison the onset budget left undecided, sized
         for an accelerator (its CPU time: docs/ablation.md)
  gpu_tiny, gpu_mini, gpu_small, gpu_smoke
         the comparison sized for one accelerator call of <= 9 minutes (roformer.ablation.study):
         every scheme, 8 seeds x 3 learning rates per scheme in one vmapped program, rate chosen
         on a validation split, warmup-stable-decay with cooldowns at three budgets, a test split
         of >= 200k masked predictions; gpu_smoke is the same pipeline at CPU-test size
Any key can be changed on the command line, e.g. `--config.schemes=rope,learned
--config.pretrain.model.size=tiny --config.budget_tokens=2000000 --config.glue.task=mrpc`.
"""
import ml_collections

from configs import base, glue
from roformer.config_files import shared_data
from roformer.errors import ConfigError

SHARED_DATA = shared_data()


def get_config(arg=None):
    c = ml_collections.ConfigDict()
    # Comma list of scheme config files (configs/<name>.py) or short names:
    # learned, sinusoidal, shaw, t5, alibi, rope, rope_linear, none.
    c.schemes = "learned,sinusoidal,shaw,t5,rope"
    # Pretraining seeds 0..seeds-1 per scheme (the seed sets initialisation, data order and
    # masking; every scheme of one seed sees the same). Differences to `reference` get a 95%
    # interval over the seeds.
    c.seeds = 1
    # Per-scheme exceptions, "scheme=value,...": more seeds for some schemes (e.g. "rope=5,none=5";
    # the others run `seeds`), and each scheme's own learning rate (e.g. "learned=1e-3"; the
    # others use pretrain.train.learning_rate), as chosen by scripts/lr_sweep.py.
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
    # hosts, at most one per core; roformer.ablation.parallel): small runs such as :reference's train
    # faster as two processes than as one, but each process pays for its start, so only runs
    # long enough gain (docs/performance.md). Each run keeps its workdir, metrics, checkpoints
    # and report row; its output goes to DIR/logs/<run>.log.
    c.parallel = 1
    # The ablation's processes (the command's own and, with parallel > 1, the runs') keep the
    # programs they compile in DIR/compile_cache (jax's persistent compilation cache), so the
    # seeds of a scheme and a resumed run load them instead of compiling them again; False
    # compiles in every process.
    c.compile_cache = True
    # Seeds of a scheme pretrained together, this many at a time, stacked in one vmapped step on
    # one device (roformer.train.seeds): on an accelerator a small run leaves the device mostly
    # idle; on XLA:CPU it gains nothing (docs/performance.md). Same workdirs, records and resume;
    # the runs' other stages go as before. 1: every run on its own.
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

    # Shared GLUE fine-tuning config (configs/glue.py layout); task "" skips GLUE.
    g = c.glue = glue.get_config()
    g.task = "sst2,mrpc"
    g.seeds = 3
    g.data_dir = str(SHARED_DATA / "glue")

    # Held-out MLM loss at multiples of the pretraining length, over the same text at
    # every length: the first 4x tokens of `num_docs` held-out documents that long, cut
    # into full windows (so positions really reach factor * seq_len).
    ext = c.extrapolation = ml_collections.ConfigDict()
    ext.factors = "1,2,4,8"
    ext.num_docs = 64
    ext.batch_size = 8
    ext.scalings = "linear,ntk,yarn"   # extra eval-only rope_scaling variants for rotary schemes

    # Context extension (Chen et al. 2023, position interpolation): continue pretraining the
    # `scheme` models at `factor` x the length (same tokens per step) for `steps` steps under
    # each method (none = plain extrapolation, linear = position interpolation, ntk, yarn,
    # base = rope_base `base`), and evaluate the held-out loss at that length every
    # `eval_every` steps on the extrapolation windows.
    x = c.extension = ml_collections.ConfigDict()
    x.enabled = False
    x.scheme = "rope"
    x.seeds = 0                  # extend the models of pretraining seeds 0..seeds-1 (0: every seed)
    x.methods = "none,linear,ntk,yarn,base"
    x.factor = 4
    x.base = 500_000.0
    x.steps = 200
    x.eval_every = 50
    x.learning_rate = 2e-4
    x.warmup_steps = 20

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
        ext.factors = "1,2,4"
        c.seeds = 2
        x.enabled = True
        x.factor = 2
        x.steps = 10
        x.eval_every = 5
        x.warmup_steps = 2
    elif arg == "reference":
        _reference(c)
    elif arg == "onset":
        # The onset study: the reference recipe run 10x longer (20,000 steps, 41M tokens), to where
        # BERT-style models are known to start using word order, with more seeds for the schemes
        # whose onset varies most; each scheme at its own best learning rate from the sweep
        # (docs/ablation.md#learning-rate-per-scheme).
        _reference(c)
        c.scheme_seeds = "rope=5,learned=5,none=5"
        # Each scheme's best of 5e-4 (where 1e-3 was best), 1e-3, 2e-3 and 4e-3 at the reference
        # budget, seed 0 (scripts/lr_sweep.py; the table in docs/ablation.md), except learned and
        # sinusoidal: 1e-3, their better rate at this budget (seed 0; 2e-3 was best at the shorter
        # one), in docs/ablation.md#learning-rate-per-scheme.
        c.scheme_learning_rates = "learned=1e-3,sinusoidal=1e-3,shaw=1e-3,t5=1e-3,alibi=1e-3,rope=2e-3,none=1e-3"
        c.budget_tokens = 20_000 * 16 * 128
        c.parallel = 2                       # two runs at a time on a 2-core CPU (docs/ablation.md)
        pre.train.eval_every = 250
        pre.train.checkpoint_every = 1_000
    elif arg == "long":
        # At the onset budget learned positions start using word order in every seed but are
        # still closing on rope at its end (docs/ablation.md, the gap-trend table), so 41M
        # tokens do not say whether they catch up. The same recipe and rates at twice the
        # budget, for those two schemes only. The seeds of a scheme train as one vmapped step
        # (an accelerator's mode; a CPU host trains more with --config.vmap_seeds=1
        # --config.parallel=2, docs/ablation.md). Evaluations every 1,000 steps (the onsets seen so far are
        # 0.5-31M tokens, 2M apart at this spacing); no GLUE, context extension or longer
        # evaluation lengths, whose compilations would cost more than the comparison on a
        # lent accelerator (each is a flag away).
        _reference(c)
        c.schemes = "learned,rope"
        c.seeds = 5
        c.scheme_learning_rates = "learned=1e-3,rope=2e-3"
        c.budget_tokens = 40_000 * 16 * 128
        c.vmap_seeds = 5
        pre.train.eval_every = 1_000
        pre.train.checkpoint_every = 10_000   # each save is one per seed, a second or so on a GPU host
        g.task = ""
        c.extension.enabled = False
        c.extrapolation.factors = "1"
        c.extrapolation.scalings = ""
    elif arg in GPU_VARIANTS:
        _study(c, arg)
    elif arg:
        raise ConfigError(f"unknown configs/ablation.py variant {arg!r}; choose 'smoke', 'reference', 'onset', "
                          f"'long', {', '.join(repr(v) for v in GPU_VARIANTS)} or nothing")
    return c


# The accelerator comparison's sizes (roformer.ablation.study): each variant's budgets are what
# fits one device call with every scheme's compilation and evaluations, by the one accelerator
# throughput measured so far, scaled for an H100 and 24 members (how: docs/ablation.md, the
# accelerator comparison). `time_limit_s` stops before a scheme that would not finish in time
# (the command resumes there); the report's time table gives what the device did. The splits
# come from a pack (study.data_pack), so the device does no text work.
GPU_VARIANTS = ("gpu_tiny", "gpu_mini", "gpu_small", "gpu_smoke")


def _study(c, arg):
    """configs/ablation.py:gpu_* (the comparison of docs/ablation.md#the-accelerator-comparison)."""
    _reference(c)
    pre = c.pretrain
    st = c.study = ml_collections.ConfigDict()
    # rope first: the reference, so a comparison exists as soon as a second scheme finishes.
    st.schemes = "rope,shaw,learned,t5,alibi,sinusoidal,none"
    st.reference = "rope"
    st.seeds = 8
    # Three rates a factor 2 apart around the reference sweep's best (1e-3 and 2e-3 at 4.1M
    # tokens, docs/ablation.md#learning-rate-per-scheme), so each of those lies inside the grid.
    st.learning_rates = "7e-4,1.4e-3,2.8e-3"
    st.budget_steps = "500,1000,2000"       # each a budget's end: 1.02M, 2.05M, 4.10M tokens per member
    st.cooldown_fraction = 0.2              # each budget decays over its last 20% (Hägele et al. 2024)
    st.warmup_steps = 200
    st.eval_every = 100                     # trunk evaluations; budgets and cooldown starts are multiples
    st.validation_fraction = 0.02           # documents, by content hash, disjoint from the test split
    st.test_fraction = 0.08
    st.validation_rows = 256
    st.variant_rows = 64                    # validation rows the order-horizon variants are made of
    st.windows = "2,4,8,16,32,64,128"
    st.test_mask_draws = 2                  # each test row masked twice: >= 200k predictions
    st.min_test_predictions = 200_000
    st.max_test_rows = 0                    # 0: every test row
    st.eval_batch = 64                      # rows per evaluation call, per member (their logits: vocab x 20 each)
    st.margin = 0.02                        # nats: |difference| below this is "equivalent" (TOST)
    st.order_threshold = 0.1
    st.bootstrap = 2000
    st.memory_limit_gib = 0.0               # 0: the device's own
    # The splits as one file (python -m roformer.ablation.study pack VARIANT PATH), for a machine
    # without the corpus; "": made from pretrain.data here.
    st.data_pack = ""
    st.time_limit_s = 480.0                 # no scheme starts that would end after this (0: none)
    pre.model.num_heads = 4                 # ALiBi needs >= 4 heads (roformer.ablation.study.ALIBI_MIN_HEADS)
    pre.train.weight_decay = 0.01
    c.glue.task = ""
    c.extension.enabled = False
    if arg == "gpu_mini":
        pre.model.size = "mini"
        st.learning_rates = "5e-4,1e-3,2e-3"
        st.budget_steps = "240,480,960"     # 0.49M, 0.98M, 1.97M tokens per member
        st.eval_every = 48
        st.warmup_steps = 96
    elif arg == "gpu_small":                # the stretch: 4 x 512, 8 heads
        pre.model.size = "small"
        pre.model.num_heads = 8
        st.learning_rates = "2.5e-4,5e-4,1e-3"
        st.budget_steps = "120,240,480"     # 0.25M, 0.49M, 0.98M tokens per member
        st.eval_every = 24
        st.warmup_steps = 48
    elif arg == "gpu_smoke":                # the pipeline at CPU-test size, on the embedded corpus
        st.schemes = "rope,alibi,sinusoidal"
        st.seeds = 2
        st.learning_rates = "1e-3,2e-3"
        st.budget_steps = "10,20"
        st.eval_every = 2
        st.warmup_steps = 2
        st.validation_fraction = 0.2
        st.test_fraction = 0.2
        st.validation_rows = 8
        st.variant_rows = 4
        st.windows = "2,8,32"
        st.min_test_predictions = 100
        st.max_test_rows = 16
        st.eval_batch = 8
        st.bootstrap = 200
        st.time_limit_s = 0.0
        pre.model.hidden_size = 32
        pre.model.intermediate_size = 64
        pre.model.num_layers = 1
        pre.data.source = "embedded"
        pre.data.files = ""
        pre.data.file_format = "auto"
        pre.data.vocab_size = 1000
        pre.train.seq_len = 32
        pre.train.batch_size = 4


def _reference(c):
    """The reference comparison (configs/ablation.py:reference)."""
    pre, g, x = c.pretrain, c.glue, c.extension
    # The reference comparison: every scheme and the `none` control, 3 seeds, a budget
    # at which the schemes separate. The recipe is the
    # small-budget one measured in docs/ablation.md (no dropout, a vocabulary sized to
    # the model, batch 16 at a high learning rate); it applies to every scheme alike.
    c.schemes = "learned,sinusoidal,shaw,t5,alibi,rope,none"
    c.seeds = 3
    pre.model.size = "tiny"
    pre.model.hidden_dropout = 0.0
    pre.model.attention_dropout = 0.0
    pre.data.vocab = ""              # a WordPiece vocabulary trained on the corpus ...
    pre.data.vocab_size = 8_000      # ... sized to a 2-layer, 128-wide model
    pre.train.batch_size = 16
    pre.train.learning_rate = 2e-3
    pre.train.warmup_steps = 200
    pre.train.eval_every = 200
    pre.train.eval_batches = 16
    pre.train.checkpoint_every = 500
    pre.train.progress_bar = False
    c.budget_tokens = 2_000 * 16 * 128   # 2,000 steps, 4.1M tokens (~0.45 passes)
    # SST-2 is the GLUE task that leaves its majority class (50.9) at this budget: 2,000
    # training rows, one fine-tuning seed per pretraining seed.
    g.task = "sst2"
    g.seeds = 1
    g.max_train_examples = 2_000
    g.num_epochs = 3.0
    g.max_seq_len = 64
    g.learning_rate = 1e-3
    x.enabled = True
    x.seeds = 1                  # seed 0's rope model; the time goes to the 3-seed comparison
    x.factor = 4
    x.steps = 100
    x.eval_every = 25
    x.learning_rate = 5e-4
    x.warmup_steps = 10
