"""What each numeric setting of an ablation config (configs/ablation.py) allows, and the
pretraining and GLUE sections' own rules, as problems `plan.build_plan` refuses before it
derives anything from them."""
from __future__ import annotations

import numbers

import ml_collections

from roformer.settings import problems

# The keys the plan and its validation do not range-check themselves; those they do (seeds,
# parallel, vmap_seeds, the extension's factor, seeds, steps and eval_every, with messages of their own)
# are only checked here to be numbers where they compare them, so no comparison meets text.
RULES = {"order_threshold": "float > 0", "budget_tokens": "int >= 0", "progress_every_s": "float >= 0"}
EXTRAPOLATION_RULES = {"num_docs": "int >= 1", "batch_size": "int >= 1"}
EXTENSION_RULES = {"seeds": "int", "factor": "int", "base": "float > 0", "steps": "int", "eval_every": "int",
                   "learning_rate": "float > 0", "warmup_steps": "int >= 0"}


def setting_problems(config: ml_collections.ConfigDict, glue: bool) -> list[str]:
    """Every setting of `config` its rule refuses, each in one line naming it (the GLUE
    section's when `glue`: a scheme run fine-tunes)."""
    # imported here, as validation.py's other checks import theirs: only validation needs them
    from roformer.data.config import DataConfig
    from roformer.glue.settings import check_config
    from roformer.model.encoder import RULES as MODEL_RULES
    from roformer.train.config import TrainConfig

    found = problems("config.", config, {k: v for k, v in RULES.items() if k in config})
    if not isinstance(config.seeds, numbers.Real):   # the extension's check compares it
        found.append(f"config.seeds={config.seeds!r} is not allowed: give the number of pretraining seeds (>= 1)")
    found += problems("extrapolation.", config.extrapolation, EXTRAPOLATION_RULES)
    if config.extension.enabled:
        found += problems("extension.", config.extension, EXTENSION_RULES)
    for build, section in ((TrainConfig.from_section, config.pretrain.train),
                           (DataConfig.from_mapping, config.pretrain.data)):
        try:
            build(section)
        except ValueError as error:
            found.append(f"pretrain.{error}" if str(error).startswith(("train.", "data.")) else str(error))
    model = {k: v for k, v in config.pretrain.model.items() if k in MODEL_RULES and v is not None}   # set ones
    found += problems("pretrain.model.", model, {k: MODEL_RULES[k] for k in model})
    if glue:
        try:
            check_config(config.glue, prefix="glue.")
        except ValueError as error:
            found.append(str(error))
    return found
