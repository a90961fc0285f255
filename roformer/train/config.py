"""The `train` config section: every pretraining setting and its default, in one place,
and the phases of a staged run (`train.phases`).

configs/base.py builds its `train` section from `TrainConfig()`; the loop reads a section
back through `TrainConfig.from_section`, which refuses unknown keys and names the new
key of a retired one.
"""
from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from roformer.data.config import MIN_SEQ_LEN
from roformer.errors import ConfigError
from roformer.settings import check_all
from roformer.train.profiling import parse_profile_steps

if TYPE_CHECKING:
    import ml_collections

    from roformer.model import ModelConfig

# Keys earlier versions had in the `train` section -> the key that replaced them. They stay
# in the section as unset placeholders, so `--config.train.<old>=...` reaches the refusal.
RETIRED_KEYS = {"dtype": "model.dtype"}
# The optimizer's settings: a resume that changes one says so (roformer.train.loop).
OPTIMIZER_KEYS = ("learning_rate", "warmup_steps", "decay", "weight_decay", "b1", "b2", "eps", "clip_norm")
MAX_SEED = 2**32 - 1   # a 32-bit seed: what every random-number generator the run seeds takes
# What each setting allows (roformer.settings): checked when a TrainConfig is made, so a bad
# value stops a run before it writes anything.
RULES = {
    "steps": "int >= 1", "batch_size": "int >= 1", "seq_len": f"int >= {MIN_SEQ_LEN}",
    "learning_rate": "float > 0", "warmup_steps": "int >= 0", "decay": "choice linear cosine",
    "decay_steps": "int >= 0", "weight_decay": "float >= 0", "b1": "float in [0, 1)", "b2": "float in [0, 1)",
    "eps": "float > 0", "clip_norm": "float >= 0", "grad_accum": "int >= 1", "seed": f"int in [0, {MAX_SEED}]",
    "dropout_rng_impl": "choice threefry2x32 rbg unsafe_rbg", "init_step": "int >= -1",
    "init_grow_positions": "choice '' copy", "log_every": "int >= 1", "eval_every": "int >= 1",
    "eval_batches": "int >= 1", "eval_shuffled": "bool", "eval_attention_stats": "bool",
    "checkpoint_every": "int >= 1", "keep_checkpoints": "int >= 1", "async_checkpoints": "bool",
    "peak_flops_per_device": "float >= 0", "progress_bar": "bool", "debug_nan_step": "int >= -1",
    "divergence_factor": "float >= 0", "divergence_patience": "int >= 1", "divergence_window": "int >= 1",
}


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 100_000
    batch_size: int = 256            # global, over all processes
    seq_len: int = 512
    learning_rate: float = 1e-4
    warmup_steps: int = 10_000
    decay: str = "linear"            # linear | cosine
    decay_steps: int = 0             # schedule length; 0 -> all steps (set it to extend a run
                                     # past its schedule without changing the learning rates so far)
    weight_decay: float = 0.01
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-6
    clip_norm: float = 1.0
    grad_accum: int = 1              # micro-batches per optimizer step
    seed: int = 0
    dropout_rng_impl: str = "threefry2x32"   # dropout keys: threefry2x32 | rbg | unsafe_rbg
    phases: str = ""                 # 'steps:seq_len:batch_size[:key=value...],...' phases run in
                                     # order (override steps/seq_len/batch_size), see parse_phases
    init_from: str = ""              # warm start (parameters only, step 0): a pretraining workdir, an
                                     # HF RoFormer directory or a roformer.convert output
    init_step: int = -1              # its checkpoint step (pretraining workdir); -1 = newest
    init_grow_positions: str = ""    # "copy": repeat a shorter learned position table's rows
    log_every: int = 100
    eval_every: int = 2_000
    eval_batches: int = 20
    eval_shuffled: bool = True       # also evaluate with each document's tokens shuffled: the loss
                                     # increase (eval_order_gap) says how much the model uses word order
    eval_attention_stats: bool = True   # also log each head's mean attention distance and the hidden
                                     # states' cosine similarity across positions (roformer.model.attention_stats)
    checkpoint_every: int = 2_000
    keep_checkpoints: int = 3        # the newest; the one with the lowest held-out loss stays too
    async_checkpoints: bool = True
    peak_flops_per_device: float = 0.0   # 0 -> table (TPU/GPU) or a measured matmul peak (CPU)
    progress_bar: bool = True
    debug_nan_step: int = -1         # testing aid: poison the loss at this step
    profile_steps: str = ""          # 'first:last': trace those steps into tensorboard/plugins/profile
                                     # (roformer.train.profiling); '' = no trace
    # The divergence guard (roformer.train.guard, docs/pretraining.md): after warmup, a logged
    # loss above factor x the median of the last `window` logged losses for `patience` logs in
    # a row, or a held-out loss above factor x the best one, stops the run. 0 turns it off.
    divergence_factor: float = 3.0
    divergence_patience: int = 3
    divergence_window: int = 20

    def __post_init__(self) -> None:
        check_all("train.", self, RULES)
        if 0 < self.divergence_factor <= 1:   # a loss above 0.5 x its median is no divergence
            raise ConfigError(f"train.divergence_factor={self.divergence_factor!r} is not allowed: "
                              "0 (no guard) or a number > 1")
        parse_profile_steps(self.profile_steps)   # a malformed window: refused in one line
        if not isinstance(self.phases, str) or not isinstance(self.init_from, str):
            raise ConfigError(f"train.phases={self.phases!r} and train.init_from={self.init_from!r} must be text")

    @classmethod
    def from_section(cls, section) -> "TrainConfig":
        """The settings of a `train` config section (a ConfigDict or a mapping)."""
        values = dict(section.to_dict() if hasattr(section, "to_dict") else section)
        for old, new in RETIRED_KEYS.items():
            if values.pop(old, None) is not None:
                raise ConfigError(f"train.{old} is now {new}: set --config.{new} instead")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown train settings {unknown}; known: {sorted(known)}")
        return cls(**values)

    @property
    def schedule_steps(self) -> int:
        """Length of the learning-rate schedule."""
        return self.decay_steps or self.steps


@dataclasses.dataclass(frozen=True)
class Phase:
    """One phase of `train.phases`: it trains up to step `end` with its own batch shape."""

    end: int                             # the run's step count when the phase is done
    seq_len: int
    batch_size: int
    learning_rate: float | None = None   # lr=: this phase's peak (scales the run's schedule)
    warmup_steps: int = 0                # warmup=: ramp from 0 over the phase's first steps
    max_predictions: int = 0             # max_predictions=: masked slots per sequence (0: data's)


PHASE_SYNTAX = ("'steps:seq_len:batch_size[:lr=X][:warmup=N][:max_predictions=N]' items, "
                "e.g. '900:128:32,100:512:8:lr=5e-5:warmup=10'")
# Option name -> (Phase field, parser of a valid value).
PHASE_OPTIONS = {"lr": ("learning_rate", float), "warmup": ("warmup_steps", int),
                 "max_predictions": ("max_predictions", int)}


def parse_phases(train) -> list[Phase]:
    """The phases of a `train` section: `train.phases`, a comma list of
    'steps:seq_len:batch_size' items with optional ':key=value' options (BERT's recipe is
    '900000:128:256,100000:512:256'), or one phase of train.steps / seq_len / batch_size."""
    text = str(train.phases or "").strip()
    if not text:
        return [Phase(int(train.steps), int(train.seq_len), int(train.batch_size))]
    phases, end = [], 0
    for item in text.split(","):
        steps, seq_len, batch_size, options = _parse_phase_item(item.strip(), text)
        if options.get("warmup_steps") and not phases:
            raise ConfigError(f"train.phases={text!r}: the first phase warms up over train.warmup_steps; "
                              "warmup= is for later phases")
        end += steps
        phases.append(Phase(end, seq_len, batch_size, **options))
    return phases


def _parse_phase_item(item: str, text: str) -> tuple[int, int, int, dict]:
    parts = [p.strip() for p in item.split(":")]
    shape, settings = parts[:3], parts[3:]
    if len(shape) != 3 or not all(p.isdigit() and int(p) > 0 for p in shape):
        raise ConfigError(f"train.phases={text!r}: {item!r} is not steps:seq_len:batch_size of positive "
                          f"integers; expected comma-separated {PHASE_SYNTAX}")
    options = {}
    for setting in settings:
        key, _, value = setting.partition("=")
        if key not in PHASE_OPTIONS:
            raise ConfigError(f"train.phases={text!r}: unknown phase option {key!r} in {item!r}; "
                              f"choose from {', '.join(PHASE_OPTIONS)} (steps:seq_len:batch_size[:key=value])")
        field, kind = PHASE_OPTIONS[key]
        try:
            options[field] = kind(value)
        except ValueError:
            options[field] = -1
        if not (options[field] > 0 and math.isfinite(options[field])):
            raise ConfigError(f"train.phases={text!r}: {key}={value!r} in {item!r} must be a positive "
                              f"{kind.__name__} (steps:seq_len:batch_size[:key=value])")
    return int(shape[0]), int(shape[1]), int(shape[2]), options


def phase_schedule_factors(phases: list[Phase], learning_rate: float) -> list[tuple[int, int, float, int]]:
    """optim.scale_by_phase's (start, end, scale, warmup) in optimizer steps for the phases
    that set their own learning rate or warmup."""
    factors, start = [], 0
    for phase in phases:
        if phase.learning_rate is not None or phase.warmup_steps:
            scale = 1.0 if phase.learning_rate is None else phase.learning_rate / learning_rate
            factors.append((start, phase.end, scale, phase.warmup_steps))
        start = phase.end
    return factors


def phase_config(config, phase, phases: list) -> ml_collections.ConfigDict:
    """The config `phase` (one of `phases`, train.phases parsed) trains with: its steps, batch
    shape and masked slots, with the learning-rate schedule over all phases."""
    import ml_collections

    phase_cfg = ml_collections.ConfigDict(config.to_dict())
    phase_cfg.train.update(steps=phase.end, seq_len=phase.seq_len, batch_size=phase.batch_size,
                           decay_steps=config.train.decay_steps or phases[-1].end)
    if phase.max_predictions:
        phase_cfg.data.max_predictions_per_seq = phase.max_predictions
    return phase_cfg


def build_model_config(model_section, *, vocab_size: int, pad_token_id: int = 0) -> ModelConfig:
    """ModelConfig from the `model` config section: the size preset, then every
    field that is set (None placeholders keep the preset's value). The vocabulary
    and padding id come from the data's tokenizer."""
    from roformer.model import ModelConfig   # jax: when a model is built, not when a config is read

    fields = {k: v for k, v in model_section.to_dict().items() if k != "size" and v is not None}
    return ModelConfig.from_preset(model_section.size, vocab_size=vocab_size, pad_token_id=pad_token_id,
                                   **fields)


def check_attention_setting(model_section) -> None:
    """Refuse an attention_impl the model of this `model` config section cannot run on this
    device (attention.check_attention_impl) from the config alone, so before any data is
    tokenized or file written; the vocabulary, which the data decides, does not enter it."""
    from roformer.model import ModelConfig
    from roformer.model.attention import check_attention_impl

    check_attention_impl(build_model_config(model_section, vocab_size=ModelConfig.vocab_size))


# A comparison's arms by name (roformer.ablation, roformer.study): the model keys each sets on
# the shared pretraining config. A position scheme's registry name (learned, rope, ...) sets
# model.position; rope_linear is RoPE with linear attention (RoFormer eq. 19); the names of the
# per-scheme config files (configs/absolute.py, ...) name the same arms.
ARM_MODEL_KEYS = {"rope_linear": {"position": "rope", "attention": "linear"},
                  # the published sinusoidal forms as arms of their own (docs/baselines.md)
                  "sinusoidal_vaswani": {"position": "sinusoidal", "sinusoidal_scaling": "vaswani"},
                  "sinusoidal_cramming": {"position": "sinusoidal", "sinusoidal_scaling": "cramming"}}
ARM_ALIASES = {"absolute": "learned", "rotary": "rope", "relative": "shaw", "rotary_linear": "rope_linear"}


def arm_model_keys(arm: str) -> dict:
    """The model keys the comparison arm `arm` sets (ConfigError naming the arms when unknown)."""
    from roformer.model.positions import POSITION_SCHEMES   # jax: when an arm is looked up

    name = ARM_ALIASES.get(arm, arm)
    if name in ARM_MODEL_KEYS:
        return dict(ARM_MODEL_KEYS[name])
    if name in POSITION_SCHEMES:
        return {"position": name}
    known = sorted(POSITION_SCHEMES) + sorted(ARM_MODEL_KEYS) + sorted(ARM_ALIASES)
    raise ConfigError(f"unknown scheme {arm!r}; choose from {', '.join(known)}")


def arm_pretrain_config(pretrain, arm: str, *, steps: int, seed: int = 0):
    """The pretraining config of the comparison arm `arm`: a copy of the shared `pretrain`
    section with the arm's model keys, the shared step budget and the seed. The learned table,
    when unset, is sized to the pretraining length, so "beyond the table" is exactly "beyond
    what was trained" in a length-extrapolation evaluation."""
    import ml_collections

    cfg = ml_collections.ConfigDict(pretrain.to_dict())
    cfg.model.update(arm_model_keys(arm))
    cfg.train.steps = int(steps)
    cfg.train.seed = int(seed)
    if cfg.model.get("max_position_embeddings") is None:
        cfg.model.max_position_embeddings = cfg.train.seq_len
    return cfg
