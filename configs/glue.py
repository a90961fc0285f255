"""GLUE fine-tuning: `python -m roformer.glue --config=configs/glue.py --workdir=DIR`.

Defaults: one hyper-parameter set for every task, Cramming's "GLUE-sane" in lr 4e-5, 5 epochs,
10% warmup and max length 128, BERT's batch 32, linear decay, weight decay 0.01 and clipping
1.0 (docs/glue.md says how to run Cramming's exactly), 5 seeds, median reported. `per_task.<task>.<key>` overrides one task (None = global).

Arguments (comma-separated, e.g. `configs/glue.py:smoke,accel=gpu`):
  smoke       4 tasks, 2,000 training rows, 3 epochs at 5e-4, 256 dev rows: minutes on a
              CPU, and a mini model from random init beats the trivial baselines on SST-2
              and STS-B (it learns; MRPC and CoLA stay at theirs);
  accel=gpu   the accelerator setting (also accel=tpu): bf16 compute and no attention
              dropout, so attention runs as the fused kernel (roformer.accelerator).
"""
import ml_collections

from roformer.accelerator import apply_accelerator_setting, parse_config_arg
from roformer.model import ModelConfig

TASK_NAMES = ("cola", "sst2", "mrpc", "stsb", "qqp", "mnli", "qnli", "rte", "wnli")
# Keys a task may override; the rest is shared.
PER_TASK_KEYS = {"learning_rate": float, "batch_size": int, "num_epochs": float,
                 "max_steps": int, "warmup_fraction": float, "weight_decay": float,
                 "max_seq_len": int, "max_train_examples": int, "grad_accum": int}


def get_config(arg=None):
    c = ml_collections.ConfigDict()
    c.task = "all"                  # a task, a comma list ("sst2,mrpc") or "all" (+AX via MNLI)
    c.init = "none"                 # pretraining workdir | HF RoFormer dir | "none" (random init)
    c.init_step = -1                # pretraining checkpoint step; -1 = latest

    # Data: local GLUE dir (download_glue_data.py layout), HF datasets, or TFDS. auto: data_dir
    # when given, else the shared data's GLUE copy where there is one (a checkout's
    # ../shared/data/glue), else HF datasets (roformer.glue.readers.glue_source).
    c.source = "auto"               # auto | local | hf | tfds
    c.data_dir = ""
    c.hf_path = "nyu-mll/glue"
    c.hf_cache_dir = ""
    c.tfds_data_dir = ""
    # Tokenizer: "" = the one that came with `init`; else a vocab.txt or tokenizer.json.
    c.vocab = ""
    c.lowercase = True              # for config.vocab=vocab.txt (uncased BERT vocab: True)

    # Model. From a checkpoint the architecture is the checkpoint's; size / vocab_size set
    # here must then match it (a mismatch is refused). With init=none: size "" -> "mini".
    # Dropout, the compute dtype (model.dtype, as in pretraining), the attention kernel
    # (attention_impl: auto picks the fastest this device and model allow) and gradient
    # checkpointing (remat: none|full|dots, docs/pretraining.md) start at ModelConfig's
    # defaults, not the checkpoint's: a run on another device may need others.
    c.model = ml_collections.ConfigDict(dict(
        size="", vocab_size=0, position="", hidden_dropout=ModelConfig.hidden_dropout,
        attention_dropout=ModelConfig.attention_dropout, dtype=ModelConfig.dtype,
        attention_impl=ModelConfig.attention_impl, remat=ModelConfig.remat))

    # Protocol.
    c.learning_rate = 4e-5
    c.batch_size = 32
    # Gradient accumulation (pretraining's train.grad_accum): each step's batch_size examples
    # run as grad_accum micro-batches of batch_size / grad_accum, their gradients summed before
    # the one update: the same step in a micro-batch's memory, for a batch that does not fit.
    c.grad_accum = 1
    c.num_epochs = 5.0
    c.max_steps = 0                 # > 0 caps the optimizer steps (smoke runs)
    c.warmup_fraction = 0.1
    c.decay = "linear"              # linear | cosine
    c.weight_decay = 0.01
    c.b1 = 0.9
    c.b2 = 0.98
    c.eps = 1e-6
    c.clip_norm = 1.0
    c.max_seq_len = 128
    c.seeds = 5                     # seeds 0..seeds-1; the median over them is reported
    c.max_train_examples = 0        # > 0: first N training rows (smoke runs, tests)
    c.max_eval_examples = 0         # > 0: first N dev rows
    c.eval_batch_size = 128
    c.predict_test = False          # write leaderboard TSVs + zip (with the median-seed model)
    # Fine-tuned models kept in models/<task>/seed<k>/ (roformer.convert's format, tokenizer
    # included) and the median seed's exported to models/<task>/hf/ (HF
    # RoFormerForSequenceClassification): "median", "all" seeds, or "none".
    c.save_models = "median"
    c.log_every = 50
    # Every this many steps (rounded up to a call of 16) a seed's fine-tuning state is saved in
    # <workdir>/resume/<task>/seed<k>, so that a killed run, run again, goes on from there with
    # the same result; a task's states are removed once its results are written. 0 = off.
    c.checkpoint_every = 1000
    c.progress_bar = True           # a bar per task and seed (on a terminal)
    # jax's persistent compilation cache: "auto" = ~/.cache/roformer-jax/xla on a GPU/TPU (off
    # on CPU), "" = off, else a directory. A rerun, another checkpoint or more seeds then
    # load their programs instead of compiling them.
    c.compilation_cache_dir = "auto"
    # How training batches are laid out (roformer.glue.finetune): "step" pads each batch to
    # its own length bucket, "call" the 16 batches of one program call to their longest (no
    # branch per length, which on a GPU is a host wait per step), "packed" lays a batch's
    # examples end to end in rows of max_seq_len (each its own segment). "auto" packs a task
    # where that computes at most 0.8 of the tokens, else call on GPUs, step elsewhere. The
    # same batches in the same order; dropout masks are drawn for the layout's shape.
    c.train_padding = "auto"
    # How prediction batches are padded: "bucket" to the power-of-two length that holds
    # their longest example, "full" to max_seq_len (one program per head, shared by the
    # tasks); "auto" buckets on a CPU, full on accelerators (fewer programs to compile).
    c.eval_padding = "auto"
    placeholder = ml_collections.config_dict.placeholder  # typed None: CLI-overridable
    c.per_task = ml_collections.ConfigDict({
        t: ml_collections.ConfigDict({k: placeholder(typ) for k, typ in PER_TASK_KEYS.items()})
        for t in TASK_NAMES})

    args = parse_config_arg(arg, flags=("smoke",), keys=("accel",), where="configs/glue.py")
    if "smoke" in args:
        # Long enough that a random-init mini model beats the trivial baselines on SST-2 and
        # STS-B (a check that fine-tuning learns, docs/glue.md), still minutes on a CPU.
        c.task = "sst2,mrpc,cola,stsb"
        c.seeds = 1
        c.max_train_examples = 2000
        c.max_eval_examples = 256
        c.num_epochs = 3.0
        c.learning_rate = 5e-4
        c.max_seq_len = 64
    if "accel" in args:
        apply_accelerator_setting(c.model, args["accel"])
    return c
