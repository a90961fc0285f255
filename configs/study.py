"""The position-scheme study: `python -m roformer.study --config=configs/study.py:VARIANT --workdir=DIR`.

Per scheme, one vmapped program trains every seed x learning rate of the scheme at once, on
the device-held splits of one corpus, with a warmup-stable-decay schedule whose cooldowns give
every budget's loss from one run; the report compares the schemes on a test split (how it
works: roformer/study/session.py; what it found: docs/ablation.md). The `pretrain` section is
configs/ablation.py:reference's (the reference recipe: tiny model, trained vocabulary); the
`study` section is the study's own. Variants (each the keys it changes in `VARIANTS`):
  gpu_tiny, gpu_mini, gpu_small   the comparison sized for a GPU in under 9 minutes each
  gpu_tiny_long                   gpu_tiny to 41M tokens per member, resumed over several calls
  gpu_tiny_end                    rope and learned to 82M tokens per member: the end state
  gpu_mini_long                   gpu_mini to 32.8M tokens: the members the downstream arm fine-tunes
  gpu_smoke                       the pipeline at CPU-test size, on the embedded corpus
Any key can be changed on the command line, e.g. `--config.study.schemes=rope,learned`.
The `downstream` section is the downstream arm's (roformer.study.downstream): which members the
study keeps and how `python -m roformer.study downstream` fine-tunes and judges them.
"""
import math

import ml_collections

from roformer.configs import ablation, glue
from roformer.errors import ConfigError


def get_config(arg=None):
    arg = arg or "gpu_tiny"
    if arg not in VARIANTS:
        raise ConfigError(f"unknown configs/study.py variant {arg!r}; choose one of "
                          f"{', '.join(repr(v) for v in VARIANTS)}")
    c = ml_collections.ConfigDict()
    reference = ablation.get_config("reference")
    c.pretrain = reference.pretrain
    c.study = ml_collections.ConfigDict(STUDY)
    c.recipe_check = ml_collections.ConfigDict(RECIPE_CHECK)
    c.downstream = ml_collections.ConfigDict(DOWNSTREAM)
    c.downstream.glue = glue.get_config()
    for key, value in DOWNSTREAM_GLUE.items():
        set_key(c.downstream.glue, key, value)
    for key, value in variant_keys(arg).items():
        set_key(c, key, value)
    # Not what the study trains (study.budget_steps is): part of each scheme's record
    # fingerprint, so it keeps the value the records made before the study had a config file of
    # its own were made with (the reference's token budget at this batch shape).
    train = c.pretrain.train
    c.pretrain.train.steps = math.ceil(reference.budget_tokens / (train.batch_size * train.seq_len))
    return c


def set_key(config, key, value):
    """config's value at the dotted path `key`."""
    *sections, name = key.split(".")
    for section in sections:
        config = config[section]
    config[name] = value


def variant_keys(arg):
    """The keys a variant changes in the defaults, those of the variant it builds on first."""
    builds_on, keys = VARIANTS[arg]
    return {**(variant_keys(builds_on) if builds_on else {}), **keys}


# The accelerator comparison (roformer.study): every scheme, 8 seeds x 3 learning
# rates per scheme in one vmapped program, the rate chosen on a validation split,
# warmup-stable-decay with cooldowns at three budgets, a test split of >= 200k masked
# predictions. Each size's budgets fit `time_limit_s` on one H100 or H200 (docs/study.md);
# `time_limit_s`, your time limit, stops before a scheme that would not finish in time (the
# command resumes there). The splits come from a pack (study.data_pack), so the device does
# no text work.
STUDY = {
    # rope first: the reference, so a comparison exists as soon as a second scheme finishes.
    "schemes": "rope,shaw,learned,t5,alibi,sinusoidal,none",
    "reference": "rope",
    "seeds": 8,
    "learning_rates": "7e-4,1.4e-3,2.8e-3",   # a factor 2 apart around the reference sweep's best
    # After every scheme's grid: a scheme whose rate is at the grid's edge at some budget trains
    # its seeds one step beyond that edge too, so the grid brackets each optimum (or says it does not).
    "extend_edges": True,
    # Each a budget's end; the last two in the last quarter of the log-token range, so the flat
    # test has a slope to read (roformer.study.end_state.check_flat_window).
    "budget_steps": "500,1000,1500,2000",
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
    "order_threshold": 0.1,
    "bootstrap": 2000,
    "memory_limit_gib": 0.0,                  # 0: the device's own
    # The splits as one file (python -m roformer.study pack --config=configs/study.py:VARIANT PATH), for a machine
    # without the corpus; "": made from pretrain.data here.
    "data_pack": "",
    "time_limit_s": 480.0,                    # no scheme starts that would end after this (0: none)
    # The pre-registration (roformer.study.preregistration; docs/end-state.md): fixed before any
    # run is scored and printed at the top of the report. Report-only: they change no record.
    "equivalence_margin": 0.05,               # nats: the TOST margin of every "equivalent"
    "equivalence_reason": "about 5% in perplexity, below the differences between position schemes papers report",
    "slope_margin": 0.01,                     # nats per doubling of the tokens: the flat test's
    "slope_reason": "a fifth of the equivalence margin per doubling: a gap moving less would not cross the "
                    "margin within the next two doublings",
    # Each scheme's rate is chosen on the tuning seeds' validation loss and scored on the
    # scored seeds' test loss (disjoint, within range(seeds)), so no scored seed's noise picks its rate.
    "tuning_seeds": "0,1",
    "scored_seeds": "2,3,4,5,6,7",
    "power_target": 0.8,
    "planning_seed_sds": "0.03,0.05,0.07",
    "planning_reason": "around the paired Shaw - rope seed sd of the first GPU comparison",
    # The next groups' programs compiled on worker threads (one each) while the device trains
    # this one; 2 keeps the device fed while a group compiles in up to twice its training time.
    "compile_ahead": 2,
}


# `python -m roformer.study recipe` (roformer.study.recipe_check): the study's warmup and batch
# were chosen with rope; this trains `scheme` at other warmups and batches (at equal tokens) on
# the tuning seeds only and applies the rule below, fixed before it runs. Not part of any
# scheme's record: the study's fingerprints read only the `study` and `pretrain` sections.
RECIPE_CHECK = {
    "scheme": "learned",
    "warmup_steps": "100,200,400",            # at the study's batch (the study's 200 among them)
    "batch_sizes": "8,16,32",                 # at equal tokens: budgets, evaluations and warmup scaled
    "margin": 0.02,                           # nats of the scheme's validation loss at the last budget
    "margin_reason": "less than half the equivalence margin: a recipe that costs less cannot turn a verdict alone",
    "inherited": "the reference recipe's, chosen with rope as the baseline: batch 16 the recipe sweep's best at "
                 "equal tokens, warmup 10% of the first budget's 2,000 steps, no warmup and 30% within its noise "
                 "(docs/results/2026-11-24-recipe-sweep.md)",
}


# The downstream arm (roformer.study.downstream, docs/study-follow-ups.md): the study keeps each scheme's
# chosen-rate scored members (kept/<scheme>/seed<k>: roformer.convert's format with the
# tokenizer), and `python -m roformer.study downstream` fine-tunes each on the CPU with
# roformer.glue for every task x fine-tuning seed. The verdict rules are fixed here, before any
# member is fine-tuned, and printed at the top of its report. None of these keys changes a
# scheme's record (they are not study.* keys).
DOWNSTREAM = {
    "keep_members": True,              # the study saves the chosen-rate scored members (MBs each)
    # CoLA and STS-B need word order; SST-2 barely does (a `none` model scored with rope there):
    # the order-insensitive control, expected to fail the positive control below.
    "tasks": "cola,stsb,sst2",
    # The positive control: a task counts only where the reference (study.reference) scores
    # above this scheme, the interval of their paired difference over pretraining seeds above 0.
    "control": "none",
    "level": 0.95,                     # the paired intervals' (equivalence: its two one-sided tests at 1 - level)
    "equivalence_margin": 1.0,         # points of the task's headline metric (x100)
    "equivalence_reason": "half the 1-2 point GLUE differences between position schemes papers report",
}


# `downstream.glue` is configs/glue.py's config with these keys changed (the stage sets task,
# init and the compilation cache per run): a pretrained mini reached CoLA MCC 19.0 with this
# protocol (docs/results/2026-11-22-glue-pretraining-evidence.md); every row of CoLA and STS-B,
# SST-2 (a control) at CoLA's 8,551 rows; 3 fine-tuning seeds per member (averaged within it).
DOWNSTREAM_GLUE = {
    "seeds": 3,
    "learning_rate": 2e-4,
    "num_epochs": 5.0,
    "batch_size": 32,
    "max_seq_len": 128,
    "per_task.sst2.max_train_examples": 8551,
    "save_models": "none",
    "progress_bar": False,
}


# Each variant: the variant it builds on (None: the defaults) and the keys it changes, by
# their dotted paths.
VARIANTS = {
    "gpu_tiny": (None, {
        "pretrain.model.num_heads": 4,        # ALiBi needs >= 4 heads (roformer.study.plan.ALIBI_MIN_HEADS)
        "pretrain.train.weight_decay": 0.01,
    }),
    # gpu_tiny to the onset study's 41M tokens, where learned and T5 positions use order
    # (gpu_tiny's 4.1M is before they start): 2-3 schemes within `time_limit_s`, the rest resumed.
    "gpu_tiny_long": ("gpu_tiny", {
        "study.budget_steps": "5000,10000,15000,20000",
        "study.eval_every": 500,
    }),
    # The end state (docs/end-state.md): rope against learned (BERT's default against RoFormer's
    # claim) to 82M tokens per member, log-spaced budgets with three in the last quarter of the
    # log-token range for the flat test. One scheme's group fits one call of the default time
    # limit on an H100 or H200 at gpu_tiny's measured tokens/s; each call resumes the last.
    "gpu_tiny_end": ("gpu_tiny", {
        "study.schemes": "rope,learned",
        "study.budget_steps": "2500,5000,10000,20000,30000,40000",
        "study.eval_every": 500,
    }),
    "gpu_mini": ("gpu_tiny", {
        "pretrain.model.size": "mini",
        "study.learning_rates": "5e-4,1e-3,2e-3",
        "study.budget_steps": "240,480,720,960",
        "study.eval_every": 48,
        "study.warmup_steps": 96,
    }),
    # gpu_mini to 32.8M tokens per member, the budget of the pretrained mini that separated
    # from random init on CoLA (docs/results/2026-11-22-glue-pretraining-evidence.md): the
    # members the downstream arm fine-tunes. Several runs, each resuming the last.
    "gpu_mini_long": ("gpu_mini", {
        "study.budget_steps": "4000,8000,12000,16000",
        "study.eval_every": 400,
    }),
    "gpu_small": ("gpu_tiny", {                  # the stretch: 4 x 512, 8 heads
        "pretrain.model.size": "small",
        "pretrain.model.num_heads": 8,
        "study.learning_rates": "2.5e-4,5e-4,1e-3",
        "study.budget_steps": "120,240,360,480",
        "study.eval_every": 24,
        "study.warmup_steps": 48,
    }),
    "gpu_smoke": ("gpu_tiny", {                  # the pipeline at CPU-test size, on the embedded corpus
        "study.schemes": "rope,alibi,sinusoidal",
        "study.seeds": 2,
        "study.learning_rates": "1e-3,2e-3",
        "study.budget_steps": "10,18,20",
        "study.tuning_seeds": "0",               # seeds 2: one tunes, one is scored
        "study.scored_seeds": "1",
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
        "recipe_check.warmup_steps": "2,4",
        "recipe_check.batch_sizes": "4,8",
        "pretrain.model.hidden_size": 32,
        "pretrain.model.intermediate_size": 64,
        "pretrain.model.num_layers": 1,
        "pretrain.data.source": "embedded",
        "pretrain.data.files": "",
        "pretrain.data.file_format": "auto",
        "pretrain.data.vocab_size": 1000,
        "pretrain.train.seq_len": 32,
        "pretrain.train.batch_size": 4,
        # The downstream arm at test size: a few hundred rows, one epoch, two fine-tuning seeds.
        "downstream.glue.seeds": 2,
        "downstream.glue.learning_rate": 1e-3,
        "downstream.glue.num_epochs": 1.0,
        "downstream.glue.max_seq_len": 32,        # the smoke model's positions (a learned table holds 32)
        "downstream.glue.max_train_examples": 300,
        "downstream.glue.max_eval_examples": 200,
        "downstream.glue.per_task.sst2.max_train_examples": 300,
    }),
}
