"""An ablation's plan checked before anything trains: `validate` names every problem in one
ConfigError: the settings the plan could not read (roformer.ablation.plan.build_plan) and
whether its parts agree with each other and with this machine."""
from __future__ import annotations

from typing import Any

from roformer.ablation import parallel
from roformer.ablation.plan import EXTENSION_METHODS, Plan, position_schemes
from roformer.errors import ConfigError
from roformer.glue.tasks import parse_task_list
from roformer.host_memory import cpu_only
from roformer.train.config import check_attention_setting


def validate(plan: Plan) -> None:
    """Every setting the runs depend on, checked before anything trains (one error naming
    all problems)."""
    config = plan.config
    problems = list(plan.problems) + _scheme_problems(plan)
    problems += _parallel_problems(config.parallel)
    problems += _vmap_problems(plan)
    if config.progress_every_s < 0:
        problems.append(f"config.progress_every_s={config.progress_every_s!r}: give the seconds between "
                        "progress lines (0: none)")
    if config.reference not in plan.schemes:
        problems.append(f"config.reference={config.reference!r} is not one of config.schemes {list(plan.schemes)}")
    problems += _evaluation_problems(plan)
    if config.extension.enabled:
        problems += _extension_problems(plan)
    if problems:
        raise ConfigError("ablation config: " + "; ".join(problems))


def _scheme_problems(plan: Plan) -> list[str]:
    """The schemes, and the attention kernel of each scheme's model."""
    schemes, problems = plan.schemes, []
    if not schemes:
        problems.append("config.schemes is empty; list at least one scheme")
    if len(set(schemes)) != len(schemes):
        problems.append(f"config.schemes lists a scheme twice: {plan.config.schemes!r}")
    for scheme, cfg in plan.scheme_configs.items():
        try:   # an attention kernel the scheme's model cannot run on this device
            check_attention_setting(cfg.model)
        except ConfigError as error:
            problems.append(f"scheme {scheme!r}: {error}")
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


def _vmap_problems(plan: Plan) -> list[str]:
    seeds = plan.config.get("vmap_seeds", 1)
    if not isinstance(seeds, int) or isinstance(seeds, bool) or seeds < 1:
        return [f"config.vmap_seeds={seeds!r}: give how many seeds of a scheme train in one vmapped step (>= 1)"]
    if seeds == 1 or not plan.scheme_configs:
        return []
    # The vmapped group's own check (jax and the train loop: only when validating, as _evaluation_problems).
    from roformer.train.seeds import seed_group_problems

    train = next(iter(plan.scheme_configs.values())).train   # the train section every scheme shares
    return [f"config.vmap_seeds={seeds}: {problem}" for problem in seed_group_problems(train)]


def _evaluation_problems(plan: Plan) -> list[str]:
    """The extrapolation's scalings and the GLUE tasks."""
    # roformer.ablation.extrapolation imports jax and the model: only for validation, not at start-up.
    from roformer.ablation.extrapolation import SCALINGS

    problems = []
    unknown = sorted(set(plan.scalings) - set(SCALINGS))
    if unknown:
        problems.append(f"extrapolation.scalings: unknown {unknown}; choose from {', '.join(SCALINGS)}")
    try:
        parse_task_list(",".join(plan.glue_tasks)) if plan.glue_tasks else None
    except ValueError as error:
        problems.append(f"glue.task: {error}")
    return problems


def _extension_problems(plan: Plan) -> list[str]:
    """The context extension's methods, the scheme it extends and the seeds (checked only
    when it runs; the settings its runs are computed from: plan.build_plan)."""
    config, ext, problems = plan.config, plan.config.extension, []
    unknown = sorted(set(plan.extension_methods) - set(EXTENSION_METHODS))
    if not plan.extension_methods or unknown:
        problems.append(f"extension.methods={ext.methods!r}: choose from {', '.join(EXTENSION_METHODS)}")
    if ext.scheme in plan.scheme_configs:
        position = plan.scheme_configs[ext.scheme].model.position
        if not position_schemes()[position].rope_scaling:
            problems.append(f"extension.scheme={ext.scheme!r} (position {position!r}) has no rotary "
                            "scaling to extend with; use a rotary scheme")
    if plan.factors and ext.factor not in plan.factors:
        problems.append(f"extension.factor={ext.factor} must be one of extrapolation.factors "
                        f"{config.extrapolation.factors!r} (its step-0 loss is that column)")
    if not isinstance(ext.seeds, int) or not 0 <= ext.seeds <= config.seeds:
        problems.append(f"extension.seeds={ext.seeds!r}: how many of the {config.seeds} pretraining seeds "
                        "to extend (0 = all)")
    return problems
