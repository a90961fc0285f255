"""An ablation config checked before anything trains: `validate` names every problem in
one ConfigError (the numeric settings' rules: roformer.ablation.settings)."""
from __future__ import annotations

from typing import Any

import ml_collections

from roformer.ablation import parallel
from roformer.ablation.settings import setting_problems
from roformer.ablation.plan import (EXTENSION_METHODS, STAGES, glue_tasks, parse_scheme_values, position_schemes,
                                    scheme_pretrain_config, split_list)
from roformer.errors import ConfigError
from roformer.glue.tasks import parse_task_list
from roformer.host_memory import cpu_only
from roformer.train.config import check_attention_setting


def validate(config: ml_collections.ConfigDict) -> None:
    """Every setting the runs depend on, checked before anything trains (one error naming
    all problems)."""
    problems = setting_problems(config, glue=bool(glue_tasks(config)))
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
    problems += _stage_problems(config)
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
            model = scheme_pretrain_config(config, scheme).model
        except ValueError as error:
            problems.append(str(error))
            continue
        try:   # an attention kernel the scheme's model cannot run on this device
            check_attention_setting(model)
        except ConfigError as error:
            problems.append(f"scheme {scheme!r}: {error}")
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
        problems.append(f"extrapolation.factors={config.extrapolation.factors!r}: list of whole "
                        "multiples of the pretraining length, including 1")
    unknown = sorted(set(split_list(config.extrapolation.scalings)) - set(SCALINGS))
    if unknown:
        problems.append(f"extrapolation.scalings: unknown {unknown}; choose from {', '.join(SCALINGS)}")
    try:
        parse_task_list(config.glue.task) if glue_tasks(config) else None
    except ValueError as error:
        problems.append(f"glue.task: {error}")
    return problems


def _stage_problems(config: ml_collections.ConfigDict) -> list[str]:
    """config.stages: a scheme run's stages, pretraining first (the others use its model)."""
    names = split_list(config.get("stages", "pretrain"))
    known = [name for name, kind in STAGES.items() if kind.run_kind == "scheme"]
    if not names or names[0] != "pretrain" or len(set(names)) != len(names) or set(names) - set(known):
        return [f"config.stages={config.get('stages')!r}: pretrain, then any of {', '.join(known[1:])}, each once"]
    return []


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
        if not position_schemes()[position].rope_scaling:
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
