"""What an ablation runs: the per-run configs, their validation and their fingerprints.

Every scheme of one seed gets the same `config.pretrain` (data, data order, masking,
initialisation of the shared parameters, optimiser, budget); only the model keys of the
scheme's config file are applied on top. A run is a `Job`: (scheme, seed) for the
comparison, (extension method, seed) for the context extension. Nothing here trains.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import math
from pathlib import Path
from typing import Any, NamedTuple

import ml_collections

from roformer import config_files
from roformer.ablation import parallel
from roformer.config_files import CONFIG_DIR
from roformer.errors import ConfigError
from roformer.glue.tasks import parse_task_list
from roformer.host_memory import cpu_only

# Ablation arms that are not a position scheme of their own: a config file's variant.
VARIANT_CONFIG_FILES = {"rope_linear": "rotary_linear"}
RUN_STAGES = ("pretrain", "extrapolation", "glue")
EXTENSION_STAGES = ("extension", "extension_eval")
# Context-extension methods: the model keys each sets for a run at `factor` x the length.
EXTENSION_METHODS = ("none", "linear", "ntk", "yarn", "base")


# --------------------------------------------------------------------------- configs


def split_list(value: str) -> list[str]:
    return [item.strip() for item in str(value).split(",") if item.strip()]


def load_config_file(name: str, arg: str | None = None) -> ml_collections.ConfigDict:
    """`get_config(arg)` of configs/<name>.py (files such as configs/ablation.py import
    `configs.base`: roformer.config_files.make_importable)."""
    path = CONFIG_DIR / f"{name}.py"
    if not path.exists():
        raise ConfigError(f"no config file {path}")
    config_files.make_importable()
    spec = importlib.util.spec_from_file_location(f"configs.{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg)


def _position_schemes() -> dict:
    # roformer.model imports jax: only when a scheme name is looked up, not at start-up.
    from roformer.model.positions import POSITION_SCHEMES

    return POSITION_SCHEMES


def scheme_config_file(scheme: str) -> str:
    """The pretraining config file of an ablation arm: a position scheme's registry name
    (learned, rope, ...), a variant (rope_linear) or a config file name (absolute, ...)."""
    schemes = _position_schemes()
    if scheme in schemes:
        return schemes[scheme].config_file
    if scheme in VARIANT_CONFIG_FILES:
        return VARIANT_CONFIG_FILES[scheme]
    path = CONFIG_DIR / f"{scheme}.py"
    if path.exists() and scheme not in ("base", "ablation", "glue"):
        return scheme
    known = sorted(schemes) + sorted(VARIANT_CONFIG_FILES)
    raise ConfigError(f"unknown scheme {scheme!r}; choose from {', '.join(known)} "
                      f"or a pretraining config file in {CONFIG_DIR}")


def scheme_model_keys(scheme: str) -> dict[str, Any]:
    """The model keys a scheme's config file sets differently from configs/base.py."""
    base_model = load_config_file("base").model.to_dict()
    scheme_model = load_config_file(scheme_config_file(scheme)).model.to_dict()
    return {k: v for k, v in scheme_model.items() if k != "size" and base_model.get(k) != v}


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


def scheme_seeds(config: ml_collections.ConfigDict, scheme: str) -> int:
    """How many pretraining seeds (0, 1, ...) `scheme` runs: config.scheme_seeds, else config.seeds."""
    return parse_scheme_values(config.get("scheme_seeds", ""), "scheme_seeds", int).get(scheme, config.seeds)


def planned_runs(config: ml_collections.ConfigDict) -> list[tuple[str, int]]:
    """(scheme, seed) of every pretraining run, every scheme of seed 0 first: an interrupted
    ablation already compares all schemes."""
    schemes = split_list(config.schemes)
    most = max([scheme_seeds(config, s) for s in schemes], default=0)
    return [(scheme, seed) for seed in range(most) for scheme in schemes if seed < scheme_seeds(config, scheme)]


def scheme_pretrain_config(config: ml_collections.ConfigDict, scheme: str, seed: int = 0
                           ) -> ml_collections.ConfigDict:
    """config.pretrain with the scheme's model keys and learning rate (config.scheme_learning_rates),
    the shared step budget and the seed."""
    cfg = ml_collections.ConfigDict(config.pretrain.to_dict())
    for key, value in scheme_model_keys(scheme).items():
        cfg.model[key] = value
    rates = parse_scheme_values(config.get("scheme_learning_rates", ""), "scheme_learning_rates", float)
    if scheme in rates:
        cfg.train.learning_rate = rates[scheme]
    cfg.train.steps = pretrain_steps(config)
    cfg.train.seed = int(seed)
    if cfg.model.get("max_position_embeddings") is None:
        # Size the learned table to the pretraining length, so "beyond the table"
        # is exactly "beyond what was trained" in the extrapolation evaluation.
        cfg.model.max_position_embeddings = cfg.train.seq_len
    return cfg


def extension_model_keys(method: str, ext: ml_collections.ConfigDict, seq_len: int) -> dict[str, Any]:
    if method == "none":        # plain extrapolation: positions simply go further
        return {}
    if method == "base":        # a larger rotary base (Llama 3 style), no scaling
        return {"rope_base": float(ext.base)}
    return {"rope_scaling": method, "rope_scaling_factor": float(ext.factor),
            "rope_original_max_len": int(seq_len)}


def extension_pretrain_config(config: ml_collections.ConfigDict, method: str, seed: int,
                              init_from: Path) -> ml_collections.ConfigDict:
    """The extension run: the scheme's pretraining config at factor x the length (same tokens
    per step), warm-started from its pretrained model, with the method's RoPE settings."""
    ext = config.extension
    cfg = scheme_pretrain_config(config, ext.scheme, seed)
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


def extension_seeds(config: ml_collections.ConfigDict) -> int:
    """How many pretraining seeds (0, 1, ...) the context extension continues from."""
    return int(config.extension.seeds) or int(config.seeds)


def scheme_glue_config(config: ml_collections.ConfigDict, pretrain_workdir: Path) -> ml_collections.ConfigDict:
    cfg = ml_collections.ConfigDict(config.glue.to_dict())
    cfg.init = str(pretrain_workdir)
    return cfg


# --------------------------------------------------------------------------- runs


class Job(NamedTuple):
    """One run of the ablation: its name in the state, and what builds its stages."""
    run: str          # <scheme>/seed<k> or extension/<method>/seed<k>
    kind: str         # "scheme" or "extension"
    key: str          # the scheme or the extension method
    seed: int


def pretrain_workdir(workdir: Path, scheme: str, seed: int) -> Path:
    """A scheme's pretraining run of `seed` in the ablation's workdir."""
    return workdir / "pretrain" / scheme / f"seed{seed}"


def extension_workdir(workdir: Path, method: str, seed: int) -> Path:
    """A context-extension run of `seed` under `method` in the ablation's workdir."""
    return workdir / "extension" / method / f"seed{seed}"


def training_workdir(workdir: Path, job: Job) -> Path:
    """The workdir (metrics, checkpoints) the job's training writes."""
    make = pretrain_workdir if job.kind == "scheme" else extension_workdir
    return make(workdir, job.key, job.seed)


def scheme_jobs(config: ml_collections.ConfigDict) -> list[Job]:
    return [Job(f"{scheme}/seed{seed}", "scheme", scheme, seed) for scheme, seed in planned_runs(config)]


def extension_jobs(config: ml_collections.ConfigDict) -> list[Job]:
    return [Job(f"extension/{method}/seed{seed}", "extension", method, seed)
            for seed in range(extension_seeds(config)) for method in split_list(config.extension.methods)]


# --------------------------------------------------------------------------- validation


def validate(config: ml_collections.ConfigDict) -> None:
    """Every setting the runs depend on, checked before anything trains (one error naming
    all problems)."""
    from roformer.ablation.settings import setting_problems

    problems = setting_problems(config)
    if problems:   # the checks below compare these values
        raise ConfigError("ablation config: " + "; ".join(problems))
    schemes = split_list(config.schemes)
    problems = _scheme_problems(config, schemes)
    problems += _parallel_problems(config.parallel)
    problems += _vmap_problems(config)
    if config.progress_every_s < 0:
        problems.append(f"config.progress_every_s={config.progress_every_s!r}: give the seconds between "
                        "progress lines (0: none)")
    if config.reference not in schemes:
        problems.append(f"config.reference={config.reference!r} is not one of config.schemes {schemes}")
    problems += _evaluation_problems(config)
    if config.extension.enabled:
        problems += _extension_problems(config, schemes)
    if problems:
        raise ConfigError("ablation config: " + "; ".join(problems))


def _scheme_problems(config: ml_collections.ConfigDict, schemes: list[str]) -> list[str]:
    """The schemes, the seeds and the per-scheme exceptions."""
    problems = []
    if not schemes:
        problems.append("config.schemes is empty; list at least one scheme")
    if len(set(schemes)) != len(schemes):
        problems.append(f"config.schemes lists a scheme twice: {config.schemes!r}")
    for scheme in schemes:
        try:
            scheme_pretrain_config(config, scheme)
        except ValueError as error:
            problems.append(str(error))
    if not isinstance(config.seeds, int) or isinstance(config.seeds, bool) or config.seeds < 1:
        problems.append(f"config.seeds={config.seeds!r}: give the number of pretraining seeds (>= 1)")
    for key, kind in (("scheme_seeds", int), ("scheme_learning_rates", float)):
        try:
            values = parse_scheme_values(config.get(key, ""), key, kind)
        except ValueError as error:
            problems.append(str(error))
            continue
        if sorted(set(values) - set(schemes)):
            problems.append(f"config.{key} names {sorted(set(values) - set(schemes))}, not in config.schemes "
                            f"{schemes}")
        if any(v <= 0 for v in values.values()):
            problems.append(f"config.{key}={config.get(key)!r}: every value must be > 0")
    return problems


def _parallel_problems(parallel_runs: Any) -> list[str]:
    if not isinstance(parallel_runs, int) or isinstance(parallel_runs, bool) or parallel_runs < 1:
        return [f"config.parallel={parallel_runs!r}: give how many runs train at once (>= 1)"]
    if parallel_runs == 1:
        return []
    if not cpu_only():
        return [f"config.parallel={parallel_runs}: runs side by side share a CPU host's cores; with an "
                "accelerator, run one at a time (or set JAX_PLATFORMS=cpu)"]
    try:
        parallel.core_slots(parallel_runs)
    except ValueError as error:
        return [f"config.parallel={parallel_runs}: {error}"]
    return []


def _vmap_problems(config: ml_collections.ConfigDict) -> list[str]:
    seeds = config.get("vmap_seeds", 1)
    if not isinstance(seeds, int) or isinstance(seeds, bool) or seeds < 1:
        return [f"config.vmap_seeds={seeds!r}: give how many seeds of a scheme train in one vmapped step (>= 1)"]
    if seeds == 1:
        return []
    # The vmapped group's own check (jax and the train loop: only when validating, as _evaluation_problems).
    from roformer.train.seeds import seed_group_problems

    return [f"config.vmap_seeds={seeds}: {problem}" for problem in seed_group_problems(config.pretrain.train)]


def _evaluation_problems(config: ml_collections.ConfigDict) -> list[str]:
    """The extrapolation lengths and scalings, and the GLUE tasks."""
    # roformer.ablation.extrapolation imports jax and the model: only for validation, not at start-up.
    from roformer.ablation.extrapolation import SCALINGS

    problems = []
    factors = split_list(config.extrapolation.factors)
    if not factors or not all(f.isdigit() and int(f) >= 1 for f in factors) or "1" not in factors:
        problems.append(f"extrapolation.factors={config.extrapolation.factors!r}: comma list of whole "
                        "multiples of the pretraining length, including 1")
    unknown = sorted(set(split_list(config.extrapolation.scalings)) - set(SCALINGS))
    if unknown:
        problems.append(f"extrapolation.scalings: unknown {unknown}; choose from {', '.join(SCALINGS)}")
    try:
        parse_task_list(config.glue.task) if split_list(config.glue.task) else None
    except ValueError as error:
        problems.append(f"glue.task: {error}")
    return problems


def _extension_problems(config: ml_collections.ConfigDict, schemes: list[str]) -> list[str]:
    """The context extension's settings (checked only when it runs)."""
    ext = config.extension
    problems = []
    methods = split_list(ext.methods)
    unknown = sorted(set(methods) - set(EXTENSION_METHODS))
    if not methods or unknown:
        problems.append(f"extension.methods={ext.methods!r}: choose from {', '.join(EXTENSION_METHODS)}")
    if ext.scheme not in schemes:
        problems.append(f"extension.scheme={ext.scheme!r} is not one of config.schemes {schemes}")
    else:
        position = scheme_pretrain_config(config, ext.scheme).model.position
        if not _position_schemes()[position].rope_scaling:
            problems.append(f"extension.scheme={ext.scheme!r} (position {position!r}) has no rotary "
                            "scaling to extend with; use a rotary scheme")
    if ext.factor < 2 or config.pretrain.train.batch_size % ext.factor:
        problems.append(f"extension.factor={ext.factor}: must be >= 2 and divide pretrain.train.batch_size="
                        f"{config.pretrain.train.batch_size} (the extension keeps the tokens per step)")
    if str(ext.factor) not in split_list(config.extrapolation.factors):
        problems.append(f"extension.factor={ext.factor} must be one of extrapolation.factors "
                        f"{config.extrapolation.factors!r} (its step-0 loss is that column)")
    if not isinstance(ext.seeds, int) or not 0 <= ext.seeds <= config.seeds:
        problems.append(f"extension.seeds={ext.seeds!r}: how many of the {config.seeds} pretraining seeds "
                        "to extend (0 = all)")
    if ext.steps < 1 or ext.eval_every < 1 or ext.steps % ext.eval_every:
        problems.append(f"extension.steps={ext.steps} must be a positive multiple of "
                        f"extension.eval_every={ext.eval_every}")
    return problems


# --------------------------------------------------------------------------- fingerprints


# Train settings that watch a run rather than decide what it computes: changing them never
# reruns a finished stage (a guard that fires stops the run, which is then not done anyway).
WATCH_ONLY_TRAIN_KEYS = ("progress_bar", "eval_attention_stats")
WATCH_ONLY_TRAIN_PREFIXES = ("divergence_",)
# Likewise for the GLUE section: what it shows, which models it keeps, where compiled
# programs are cached, and the attention kernel (the same math: auto picks what the device
# runs fastest).
WATCH_ONLY_GLUE_KEYS = ("progress_bar", "compilation_cache_dir", "save_models")
KERNEL_ONLY_MODEL_KEYS = ("attention_impl",)


def _fingerprinted(part: Any) -> Any:
    if not isinstance(part, ml_collections.ConfigDict):
        return part
    data = part.to_dict()
    if "per_task" in data:   # a GLUE section (configs/glue.py)
        data = {k: v for k, v in data.items() if k not in WATCH_ONLY_GLUE_KEYS}
        data["model"] = {k: v for k, v in data["model"].items() if k not in KERNEL_ONLY_MODEL_KEYS}
    train = data.get("train")
    if isinstance(train, dict):
        data["train"] = {k: v for k, v in train.items()
                         if k not in WATCH_ONLY_TRAIN_KEYS and not k.startswith(WATCH_ONLY_TRAIN_PREFIXES)}
    return data


def fingerprint(*parts: Any) -> str:
    """Stable hash of JSON-able parts: a stage reruns when its inputs change."""
    text = json.dumps([_fingerprinted(p) for p in parts], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
