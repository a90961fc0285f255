"""What an ablation runs: the plan, computed once from the config (`build_plan`).

Every scheme of one seed gets the same `config.pretrain` (data, data order, masking,
initialisation of the shared parameters, optimiser, budget); only the scheme's model keys
(roformer.train.config.arm_model_keys: model.position, and attention for rope_linear) are
applied on top. A run is a `PlannedRun`: (scheme, seed) for the
comparison, (extension method, seed) for the context extension, with its configs, workdir
and the fingerprints of its stages. The plan comes first: validation
(roformer.ablation.validation), the runner, the stages, the progress lines and the report's
rows all read the one `Plan`; none goes back to the raw config for a derived value. Nothing
here trains.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import math
from pathlib import Path
from typing import Any

import ml_collections

from roformer import config_files
from roformer.ablation.settings import setting_problems
from roformer.config_files import CONFIG_DIR, split_list
from roformer.data.config import without_neutral_settings
from roformer.errors import ConfigError
from roformer.train.config import arm_pretrain_config

SCHEME_STAGES = ("pretrain", "extrapolation", "glue")   # config.stages when a config names none
EXTENSION_STAGES = ("extension", "extension_eval")      # a context-extension run's
# Context-extension methods: the model keys each sets for a run at `factor` x the length.
EXTENSION_METHODS = ("none", "linear", "ntk", "yarn", "base")


# --------------------------------------------------------------------------- configs


def load_config_file(name: str, arg: str | None = None) -> ml_collections.ConfigDict:
    """`get_config(arg)` of configs/<name>.py, run afresh (a file may read the environment
    when it runs: configs/ablation.py's shared data)."""
    path = CONFIG_DIR / f"{name}.py"
    if not path.exists():
        raise ConfigError(f"no config file {path}")
    spec = importlib.util.spec_from_file_location(f"roformer.configs.{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg)


def position_schemes() -> dict:
    # roformer.model imports jax: only when a scheme name is looked up, not at start-up.
    from roformer.model.positions import POSITION_SCHEMES

    return POSITION_SCHEMES


def pretrain_steps(config: ml_collections.ConfigDict) -> int:
    """The shared budget in optimizer steps (budget_tokens wins when > 0)."""
    train = config.pretrain.train
    if config.budget_tokens > 0:
        return math.ceil(config.budget_tokens / (train.batch_size * train.seq_len))
    return int(train.steps)


def parse_scheme_values(value: str, key: str, kind: type) -> dict[str, Any]:
    """'rope=5,learned=3' -> {'rope': 5, 'learned': 3} (`key` names the setting in errors)."""
    out = {}
    for item in split_list(value):
        scheme, sep, text = item.partition("=")
        try:
            if not sep:
                raise ValueError
            out[scheme.strip()] = kind(text)
        except ValueError:
            raise ConfigError(f"config.{key}: item {item!r} is not scheme={kind.__name__}") from None
    return out


def extension_model_keys(method: str, ext: ml_collections.ConfigDict, seq_len: int) -> dict[str, Any]:
    if method == "none":        # plain extrapolation: positions simply go further
        return {}
    if method == "base":        # a larger rotary base (ABF, Xiong et al. 2023), no scaling
        return {"rope_base": float(ext.base)}
    return {"rope_scaling": method, "rope_scaling_factor": float(ext.factor),
            "rope_original_max_len": int(seq_len)}


def extension_config(scheme_cfg: ml_collections.ConfigDict, ext: ml_collections.ConfigDict, method: str,
                     init_from: Path) -> ml_collections.ConfigDict:
    """The extension run: the scheme's pretraining config (of the seed it extends) at factor x
    the length (same tokens per step), warm-started from its pretrained model, with the
    method's RoPE settings."""
    cfg = ml_collections.ConfigDict(scheme_cfg.to_dict())
    seq_len = cfg.train.seq_len
    cfg.train.seq_len = seq_len * int(ext.factor)
    cfg.train.batch_size = cfg.train.batch_size // int(ext.factor)
    cfg.train.steps = int(ext.steps)
    cfg.train.learning_rate = float(ext.learning_rate)
    cfg.train.warmup_steps = int(ext.warmup_steps)
    cfg.train.decay_steps = 0
    cfg.train.eval_every = int(ext.eval_every)
    # The measurement is extension_eval on the extrapolation windows; the loop's own packed
    # held-out evaluation is kept small.
    cfg.train.eval_batches = max(1, cfg.train.eval_batches // int(ext.factor))
    cfg.train.eval_shuffled = False
    cfg.train.checkpoint_every = int(ext.eval_every)
    cfg.train.keep_checkpoints = int(ext.steps) // int(ext.eval_every) + 2   # every one is evaluated
    cfg.train.init_from = str(init_from)
    cfg.train.init_step = -1
    for key, value in extension_model_keys(method, ext, seq_len).items():
        cfg.model[key] = value
    return cfg


# --------------------------------------------------------------------------- the plan


@dataclasses.dataclass(frozen=True)
class StageKind:
    """A stage a run can have, by name in `STAGES` (config.stages names a scheme run's, as
    big_vision's config.evals names its evaluators); its runner is
    roformer.ablation.stages.STAGE_RUNNERS[name]."""
    run_kind: str          # the runs it belongs to: "scheme" or "extension"
    section: str | None    # an evaluation's: the config section its fingerprint adds to the training's


STAGES = {
    "pretrain": StageKind("scheme", None),
    "extrapolation": StageKind("scheme", "extrapolation"),
    "glue": StageKind("scheme", "glue"),
    "extension": StageKind("extension", None),
    "extension_eval": StageKind("extension", "extrapolation"),
}


@dataclasses.dataclass(frozen=True)
class StageSpec:
    name: str
    fingerprint: str   # the record in ablation_state.json is current when it holds this one


@dataclasses.dataclass(frozen=True, eq=False)
class PlannedRun:
    """One run of the ablation, with everything its stages, its progress and its report row need."""
    name: str          # <scheme>/seed<k> or extension/<method>/seed<k>: its key in the state
    kind: str          # "scheme" or "extension"
    key: str           # the scheme or the extension method
    seed: int
    workdir: Path      # where its training writes (metrics, checkpoints)
    train_config: ml_collections.ConfigDict      # what its first stage trains
    pretrain_config: ml_collections.ConfigDict   # the scheme's (an extension run's: the extended scheme's)
    stages: tuple[StageSpec, ...]
    glue_config: ml_collections.ConfigDict | None = None   # a scheme run's GLUE section, fine-tuning its model
    glue_workdir: Path | None = None

    @property
    def fingerprint(self) -> str:
        """Its training's (the first stage's)."""
        return self.stages[0].fingerprint


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """Every run of an ablation and the settings they share, derived once (`build_plan`)."""
    config: ml_collections.ConfigDict   # as given: the sections the stages hand on (glue, extension)
    workdir: Path
    schemes: tuple[str, ...]
    seeds: dict[str, int]               # pretraining seeds per scheme
    steps: int                          # the shared pretraining budget in steps
    stage_names: tuple[str, ...]        # a scheme run's stages, in order (config.stages, less glue without a task)
    glue_tasks: tuple[str, ...]         # () when no run fine-tunes
    factors: tuple[int, ...]            # extrapolation lengths, multiples of the pretraining length
    scalings: tuple[str, ...]           # eval-only rope scalings of the extrapolation table
    scheme_configs: dict[str, ml_collections.ConfigDict]   # scheme -> its pretraining config (seed 0)
    extension_methods: tuple[str, ...]  # () when the context extension is off
    extension_seeds: int
    scheme_runs: tuple[PlannedRun, ...]      # every scheme of seed 0 first: an interrupted ablation compares them
    extension_runs: tuple[PlannedRun, ...]   # once every seed is pretrained
    problems: tuple[str, ...] = ()      # settings that could not be read (validate reports them); no runs then

    @property
    def runs(self) -> tuple[PlannedRun, ...]:
        """Every run, in the order they go."""
        return self.scheme_runs + self.extension_runs

    def run(self, name: str) -> PlannedRun:
        return next(r for r in self.runs if r.name == name)

    def use_vocabulary(self, vocab: str) -> None:
        """Every run's configs read `vocab` (the vocabulary pinned in the workdir); the
        fingerprints stay those of the config as written, so moving the workdir resumes it."""
        for run in self.runs:
            run.train_config.data.vocab = run.pretrain_config.data.vocab = vocab


def pretrain_workdir(workdir: Path, scheme: str, seed: int) -> Path:
    """A scheme's pretraining run of `seed` in the ablation's workdir."""
    return workdir / "pretrain" / scheme / f"seed{seed}"


def extension_workdir(workdir: Path, method: str, seed: int) -> Path:
    """A context-extension run of `seed` under `method` in the ablation's workdir."""
    return workdir / "extension" / method / f"seed{seed}"


def build_plan(config: ml_collections.ConfigDict, workdir: str | Path, vocab: str | None = None) -> Plan:
    """The plan of `config` in `workdir`, the first thing an ablation computes: validation
    (roformer.ablation.validation.validate) and every later stage read it. A setting of the
    wrong type or range (roformer.ablation.settings) is refused here in one ConfigError, as
    nothing can be derived from it; a list item or a name that cannot be read is named in the
    plan's `problems` and no run is planned, so validation reports it with every other problem
    in one error. With `vocab` (the pinned vocabulary) every run's configs read it."""
    workdir = Path(workdir)
    given_stages = tuple(split_list(config.get("stages", SCHEME_STAGES)))
    glue_tasks = tuple(split_list(config.glue.task)) if "glue" in given_stages else ()
    refused = setting_problems(config, glue=bool(glue_tasks))
    if refused:   # what follows computes with these values
        raise ConfigError("ablation config: " + "; ".join(refused))
    problems: list[str] = []
    schemes = tuple(split_list(config.schemes))
    steps = pretrain_steps(config)
    seeds = _read_seeds(config, schemes, problems)
    scheme_cfgs = _read_scheme_configs(config, schemes, steps, problems)
    stage_names = _read_stages(given_stages, glue_tasks, problems)
    factors = _read_factors(config, problems)
    methods, ext_seeds = _read_extension(config, schemes, problems)
    plan = Plan(config, workdir, schemes, seeds, steps, stage_names, glue_tasks, factors,
                tuple(split_list(config.extrapolation.scalings)), scheme_cfgs, methods, ext_seeds, (), (),
                tuple(problems))
    if problems:
        return plan
    plan = dataclasses.replace(plan, scheme_runs=_scheme_runs(plan), extension_runs=_extension_runs(plan))
    if vocab:
        plan.use_vocabulary(vocab)
    return plan


def _read_seeds(config: ml_collections.ConfigDict, schemes: tuple[str, ...], problems: list[str]) -> dict[str, int]:
    """Per scheme, how many pretraining seeds (0, 1, ...) it runs: config.scheme_seeds, else config.seeds."""
    if not isinstance(config.seeds, int) or isinstance(config.seeds, bool) or config.seeds < 1:
        problems.append(f"config.seeds={config.seeds!r}: give the number of pretraining seeds (>= 1)")
    given = _read_scheme_values(config, "scheme_seeds", int, schemes, problems)
    return {scheme: given.get(scheme, config.seeds) for scheme in schemes}


def _read_scheme_values(config: ml_collections.ConfigDict, key: str, kind: type, schemes: tuple[str, ...],
                        problems: list[str]) -> dict[str, Any]:
    """config.<key>'s per-scheme exceptions ('rope=5,learned=3'): each a listed scheme's, > 0."""
    try:
        values = parse_scheme_values(config.get(key, ""), key, kind)
    except ValueError as error:
        problems.append(str(error))
        return {}
    unknown = sorted(set(values) - set(schemes))
    if unknown:
        problems.append(f"config.{key} names {unknown}, not in config.schemes {list(schemes)}")
    if any(v <= 0 for v in values.values()):
        problems.append(f"config.{key}={config.get(key)!r}: every value must be > 0")
    return values


def _read_scheme_configs(config: ml_collections.ConfigDict, schemes: tuple[str, ...], steps: int,
                         problems: list[str]) -> dict[str, ml_collections.ConfigDict]:
    """Each scheme's pretraining config (seed 0): config.pretrain with the scheme's model keys
    (roformer.train.config.arm_pretrain_config), the shared step budget and its learning rate
    (config.scheme_learning_rates). The one place a scheme's config is derived."""
    rates = _read_scheme_values(config, "scheme_learning_rates", float, schemes, problems)
    configs = {}
    for scheme in schemes:
        try:
            configs[scheme] = arm_pretrain_config(config.pretrain, scheme, steps=steps)
        except ValueError as error:
            problems.append(str(error))
            continue
        if scheme in rates:
            configs[scheme].train.learning_rate = rates[scheme]
    return configs


def _read_stages(given: tuple[str, ...], glue_tasks: tuple[str, ...], problems: list[str]) -> tuple[str, ...]:
    """A scheme run's stages: pretraining first (the others use its model), each once; GLUE
    left out when it has no task."""
    known = [name for name, kind in STAGES.items() if kind.run_kind == "scheme"]
    if not given or given[0] != "pretrain" or len(set(given)) != len(given) or set(given) - set(known):
        problems.append(f"config.stages={given!r}: pretrain, then any of {', '.join(known[1:])}, each once")
    return tuple(name for name in given if name in known and (name != "glue" or glue_tasks))


def _read_factors(config: ml_collections.ConfigDict, problems: list[str]) -> tuple[int, ...]:
    factors = split_list(config.extrapolation.factors)
    if not factors or not all(f.isdigit() and int(f) >= 1 for f in factors) or "1" not in factors:
        problems.append(f"extrapolation.factors={config.extrapolation.factors!r}: list of whole "
                        "multiples of the pretraining length, including 1")
        return ()
    return tuple(int(f) for f in factors)


def _read_extension(config: ml_collections.ConfigDict, schemes: tuple[str, ...],
                    problems: list[str]) -> tuple[tuple[str, ...], int]:
    """The context extension's methods and seeds ((), 0 when it is off), and the settings its
    runs are computed from: the scheme it extends, the factor, the steps."""
    ext = config.extension
    if not ext.enabled:
        return (), 0
    if ext.scheme not in schemes:
        problems.append(f"extension.scheme={ext.scheme!r} is not one of config.schemes {list(schemes)}")
    if ext.factor < 2 or config.pretrain.train.batch_size % ext.factor:
        problems.append(f"extension.factor={ext.factor}: must be >= 2 and divide pretrain.train.batch_size="
                        f"{config.pretrain.train.batch_size} (the extension keeps the tokens per step)")
    if ext.steps < 1 or ext.eval_every < 1 or ext.steps % ext.eval_every:
        problems.append(f"extension.steps={ext.steps} must be a positive multiple of "
                        f"extension.eval_every={ext.eval_every}")
    return tuple(split_list(ext.methods)), int(ext.seeds) or int(config.seeds)


def _fingerprinted_sections(plan: Plan) -> dict[str, Any]:
    """What an evaluation's fingerprint covers: its section, lists in the comma form existing
    workdirs recorded, so a list written either way resumes them."""
    config = plan.config
    return {"glue": config.glue, "extrapolation": {
        **config.extrapolation.to_dict(), "factors": ",".join(map(str, plan.factors)),
        "scalings": ",".join(plan.scalings)}}


def _stage_specs(plan: Plan, names: tuple[str, ...], trained: str) -> tuple[StageSpec, ...]:
    """The stages `names` of a run whose training has the fingerprint `trained`."""
    sections = _fingerprinted_sections(plan)
    return tuple(StageSpec(name, trained if STAGES[name].section is None
                           else fingerprint(trained, sections[STAGES[name].section])) for name in names)


def _scheme_runs(plan: Plan) -> tuple[PlannedRun, ...]:
    runs = []
    for seed in range(max(plan.seeds.values(), default=0)):   # every scheme of seed 0 first
        for scheme in (s for s in plan.schemes if seed < plan.seeds[s]):
            cfg, run_dir = _seeded(plan.scheme_configs[scheme], seed), pretrain_workdir(plan.workdir, scheme, seed)
            glue = None
            if "glue" in plan.stage_names:
                glue = ml_collections.ConfigDict(plan.config.glue.to_dict())
                glue.init = str(run_dir)
            runs.append(PlannedRun(f"{scheme}/seed{seed}", "scheme", scheme, seed, run_dir, cfg, cfg,
                                   _stage_specs(plan, plan.stage_names, fingerprint(cfg)), glue_config=glue,
                                   glue_workdir=plan.workdir / "glue" / scheme / f"seed{seed}" if glue else None))
    return tuple(runs)


def _extension_runs(plan: Plan) -> tuple[PlannedRun, ...]:
    ext, runs = plan.config.extension, []
    for seed in range(plan.extension_seeds):
        source = _seeded(plan.scheme_configs[ext.scheme], seed)
        for method in plan.extension_methods:
            cfg = extension_config(source, ext, method, pretrain_workdir(plan.workdir, ext.scheme, seed))
            runs.append(PlannedRun(f"extension/{method}/seed{seed}", "extension", method, seed,
                                   extension_workdir(plan.workdir, method, seed), cfg, source,
                                   _stage_specs(plan, EXTENSION_STAGES, fingerprint(fingerprint(source), cfg))))
    return tuple(runs)


def _seeded(cfg: ml_collections.ConfigDict, seed: int) -> ml_collections.ConfigDict:
    """A copy of a scheme's pretraining config for pretraining seed `seed`."""
    out = ml_collections.ConfigDict(cfg.to_dict())
    out.train.seed = int(seed)
    return out


# --------------------------------------------------------------------------- fingerprints


# Train settings that watch a run rather than decide what it computes: changing them never
# reruns a finished stage (a guard that fires stops the run, which is then not done anyway).
WATCH_ONLY_TRAIN_KEYS = ("progress_bar", "eval_attention_stats", "profile_steps")
WATCH_ONLY_TRAIN_PREFIXES = ("divergence_",)
# Likewise for the GLUE section: what it shows, which models it keeps, where compiled
# programs are cached, how training batches are padded (the same batches in the same order),
# the micro-batches a step's gradients are accumulated over (the same step, in less memory;
# global and per task), how often the fine-tuning state is saved (a resumed run's result is an
# uninterrupted one's) and the attention kernel (the same math): auto picks what the device
# runs fastest.
WATCH_ONLY_GLUE_KEYS = ("progress_bar", "compilation_cache_dir", "save_models", "train_padding", "eval_padding",
                        "grad_accum", "checkpoint_every")
KERNEL_ONLY_MODEL_KEYS = ("attention_impl",)
# Model settings that trade memory for compute with the same math (gradient checkpointing):
# left out of every fingerprint, so a run with another value reruns nothing.
MEMORY_ONLY_MODEL_KEYS = ("remat",)


def _fingerprinted(part: Any) -> Any:
    if not isinstance(part, ml_collections.ConfigDict):
        return part
    data = part.to_dict()
    if "per_task" in data:   # a GLUE section (configs/glue.py)
        data = {k: v for k, v in data.items() if k not in WATCH_ONLY_GLUE_KEYS}
        data["per_task"] = {task: {k: v for k, v in keys.items() if k not in WATCH_ONLY_GLUE_KEYS}
                            for task, keys in data["per_task"].items()}
        data["model"] = {k: v for k, v in data["model"].items() if k not in KERNEL_ONLY_MODEL_KEYS}
    if "packing" in data and "source" in data:   # a data section
        data = without_neutral_settings(data)
    if isinstance(data.get("data"), dict):
        data["data"] = without_neutral_settings(data["data"])
    train = data.get("train")
    if isinstance(train, dict):
        data["train"] = {k: v for k, v in train.items()
                         if k not in WATCH_ONLY_TRAIN_KEYS and not k.startswith(WATCH_ONLY_TRAIN_PREFIXES)}
    return data


def _without_memory_only(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_memory_only(v) for k, v in value.items() if k not in MEMORY_ONLY_MODEL_KEYS}
    if isinstance(value, (list, tuple)):
        return [_without_memory_only(v) for v in value]
    return value


def fingerprint(*parts: Any) -> str:
    """Stable hash of JSON-able parts and config sections (less what only watches a run): a
    stage reruns when its inputs change."""
    return config_files.fingerprint(*[_without_memory_only(_fingerprinted(p)) for p in parts])
