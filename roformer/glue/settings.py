"""What each setting of a GLUE config (configs/glue.py) allows, checked before a run reads
or writes anything (roformer.settings says how a rule reads)."""
from __future__ import annotations

from roformer.settings import check, check_all

# GLUE's longest examples are a few hundred tokens; a row of this many is a typo, and would be
# allocated for every padded batch before the first step.
MAX_SEQ_LEN = 65_536
# The fine-tuning protocol: global keys, each also settable per task (config.per_task.<task>.<key>).
PROTOCOL_RULES = {
    "learning_rate": "float > 0", "batch_size": "int >= 1", "num_epochs": "float >= 0", "max_steps": "int >= 0",
    "warmup_fraction": "float in [0, 1]", "weight_decay": "float >= 0", "max_seq_len": f"int in [8, {MAX_SEQ_LEN}]",
    "max_train_examples": "int >= 0", "decay": "choice linear cosine", "b1": "float in [0, 1)",
    "b2": "float in [0, 1)", "eps": "float > 0", "clip_norm": "float >= 0",
    "grad_accum": "int >= 1",
}
RUN_RULES = {
    "init_step": "int >= -1", "seeds": "int >= 1", "max_eval_examples": "int >= 0", "eval_batch_size": "int >= 1",
    "predict_test": "bool", "log_every": "int >= 1", "checkpoint_every": "int >= 0", "lowercase": "bool", "progress_bar": "bool",
    "save_models": "choice median all none", "train_padding": "choice auto step call packed",
    "eval_padding": "choice auto bucket full",
}
MODEL_RULES = {"vocab_size": "int >= 0", "hidden_dropout": "float in [0, 1)", "attention_dropout": "float in [0, 1)"}


def check_config(config, prefix: str = "config.") -> None:
    """Refuse the first setting of `config` its rule does not allow, in one line naming it
    (`prefix` + its key: the ablation's GLUE section is `glue.`)."""
    check_all(prefix, config, RUN_RULES)
    check_all(f"{prefix}model.", config.model, MODEL_RULES)
    check_all(prefix, config, PROTOCOL_RULES)
    for task, overrides in (config.get("per_task") or {}).items():
        for key, value in overrides.items():
            if value is not None and key in PROTOCOL_RULES:
                check(f"{prefix}per_task.{task}.{key}", value, PROTOCOL_RULES[key])
