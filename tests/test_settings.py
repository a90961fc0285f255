"""Every numeric setting is checked where it is defined (roformer.settings): 0, a negative
value and a non-number, for every numeric key of TrainConfig, DataConfig, ModelConfig and
the GLUE config, are each refused in one line naming the key, the value and what is allowed,
except where the key's own documentation gives 0 a meaning (listed here by hand)."""
import dataclasses

import pytest

from roformer.configs import glue as glue_config
from roformer.data.config import DataConfig
from roformer.errors import ConfigError
from roformer.model import ModelConfig
from roformer.train.config import TrainConfig

pytestmark = pytest.mark.fast   # the fast lane (docs/testing.md)

BAD = (-5, "x", True)   # a negative, a non-number, a bool (not a number either)

# Keys whose 0 means something (their comment in the dataclass or config file says what).
TRAIN_ZERO = {"warmup_steps", "decay_steps", "weight_decay", "b1", "b2", "clip_norm", "seed", "init_step",
              "peak_flops_per_device", "debug_nan_step", "divergence_factor"}
DATA_ZERO = {"max_predictions_per_seq", "heldout_fraction", "num_workers"}
MODEL_ZERO = {"hidden_dropout", "attention_dropout", "pad_token_id"}
GLUE_ZERO = {"init_step", "num_epochs", "max_steps", "warmup_fraction", "weight_decay", "max_train_examples",
             "max_eval_examples", "b1", "b2", "clip_norm", "model.vocab_size", "model.hidden_dropout",
             "model.attention_dropout", "checkpoint_every"}


def numeric_fields(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.type in ("int", "float", "int | None", "float | None")]


def assert_refused(make, key: str, value) -> None:
    with pytest.raises(ConfigError) as error:
        make()
    message = str(error.value)
    assert message.startswith(f"{key}={value!r} is not allowed: "), message
    assert "\n" not in message


CASES = ([(TrainConfig, "train", name, TRAIN_ZERO) for name in numeric_fields(TrainConfig)]
         + [(DataConfig, "data", name, DATA_ZERO) for name in numeric_fields(DataConfig)]
         + [(ModelConfig, "model", name, MODEL_ZERO) for name in numeric_fields(ModelConfig)])


@pytest.mark.parametrize("cls, section, name, zero_ok", CASES, ids=[f"{c[1]}.{c[2]}" for c in CASES])
def test_every_numeric_setting_refuses_bad_values_in_one_line(cls, section, name, zero_ok):
    for value in BAD:
        assert_refused(lambda value=value: cls(**{name: value}), f"{section}.{name}", value)
    if name in zero_ok:
        cls(**{name: 0})
    else:
        assert_refused(lambda: cls(**{name: 0}), f"{section}.{name}", 0)


def glue_numeric_keys() -> list[str]:
    config = glue_config.get_config()
    keys = [k for k, v in config.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    keys += [f"model.{k}" for k, v in config.model.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    keys += [f"per_task.cola.{k}" for k in glue_config.PER_TASK_KEYS]
    return keys


@pytest.mark.parametrize("key", glue_numeric_keys())
def test_every_numeric_glue_setting_refuses_bad_values_in_one_line(key):
    def make(value):
        config = glue_config.get_config()
        *sections, name = key.split(".")
        node = config
        for section in sections:
            node = node[section]
        with node.ignore_type():
            node[name] = value
        return lambda: check_config(config), node[name]

    from roformer.glue.settings import check_config   # a float key holds -5 as -5.0

    for value in BAD[:2]:   # a ConfigDict float key turns True into 1.0 itself
        assert_refused(*make(value)[:1], f"config.{key}", make(value)[1])
    base = key.removeprefix("per_task.cola.")
    if base in GLUE_ZERO:
        make(0)[0]()
    else:
        assert_refused(make(0)[0], f"config.{key}", make(0)[1])


def test_the_issue_cases_name_key_value_and_what_is_allowed():
    assert_refused(lambda: TrainConfig(checkpoint_every=0), "train.checkpoint_every", 0)
    for key in ("log_every", "eval_every", "grad_accum", "eval_batches", "steps"):
        assert_refused(lambda key=key: TrainConfig(**{key: 0}), f"train.{key}", 0)
    assert_refused(lambda: TrainConfig(steps=-1), "train.steps", -1)
    assert_refused(lambda: TrainConfig(keep_checkpoints=-1), "train.keep_checkpoints", -1)
    assert_refused(lambda: TrainConfig(learning_rate=-1.0), "train.learning_rate", -1.0)
    assert_refused(lambda: TrainConfig(warmup_steps=-3), "train.warmup_steps", -3)
    assert_refused(lambda: ModelConfig(num_layers=0), "model.num_layers", 0)
    assert_refused(lambda: ModelConfig(hidden_dropout=1.5), "model.hidden_dropout", 1.5)
    with pytest.raises(ConfigError, match=r"^train.divergence_factor=0.5 is not allowed: 0 \(no guard\) or a "):
        TrainConfig(divergence_factor=0.5)
    with pytest.raises(ConfigError, match=r"^train.keep_checkpoints=-1 is not allowed: an integer >= 1$"):
        TrainConfig(keep_checkpoints=-1)


@pytest.mark.parametrize("rule, good, bad, words", [
    ("int >= 1", [1, 7], [0, -1, 1.5, "1", None, True, float("nan")], "an integer >= 1"),
    ("float > 0", [1e-9, 3, 2.5], [0, -1e-9, "x", float("nan")], "a number > 0"),
    ("float in [0, 1)", [0, 0.5], [1, -0.1, 1.5], "a number in [0, 1)"),
    ("float in (0, 1]", [1, 0.5], [0, 1.01], "a number in (0, 1]"),
    ("int >= 1 or None", [None, 2], [0, "x"], "an integer >= 1 (or None)"),
    ("choice '' copy", ["", "copy"], ["cop", None, 0], "one of '', 'copy'"),
    ("bool", [True, False], [0, 1, "true"], "True or False"),
])
def test_rules_read_as_they_are_written(rule, good, bad, words):
    from roformer.settings import allowed, is_allowed

    assert all(is_allowed(v, rule) for v in good) and not any(is_allowed(v, rule) for v in bad)
    assert allowed(rule) == words


ABLATION_ZERO = {"budget_tokens", "progress_every_s", "extension.seeds", "extension.warmup_steps"}


def ablation_numeric_keys() -> list[str]:
    from roformer.ablation import plan

    config = plan.load_config_file("ablation", "smoke")
    keys = [k for k, v in config.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    for section in ("extrapolation", "extension"):
        keys += [f"{section}.{k}" for k, v in config[section].items()
                 if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return keys


@pytest.mark.parametrize("key", ablation_numeric_keys())
def test_every_numeric_ablation_setting_refuses_bad_values_in_one_line(key):
    from roformer.ablation import plan, validation

    def validate(value):
        config = plan.load_config_file("ablation", "smoke")   # extension on: its keys are checked
        *sections, name = key.split(".")
        node = config[sections[0]] if sections else config
        with node.ignore_type():
            node[name] = value
        # the key and value; what is allowed follows (in the plan's own words for the keys it checks)
        shown = f"{'config.' if not sections else ''}{key}={node[name]!r}"
        return lambda: validation.validate(plan.build_plan(config, "/ablation")), shown

    for value in [*BAD[:2], *([] if key in ABLATION_ZERO else [0])]:
        run, shown = validate(value)
        with pytest.raises(ConfigError) as error:
            run()
        assert shown in str(error.value) and "\n" not in str(error.value)


def test_the_ablation_checks_its_pretraining_and_glue_sections_too():
    from roformer.ablation import plan, validation

    config = plan.load_config_file("ablation", "smoke")
    config.pretrain.train.checkpoint_every = 0
    config.pretrain.model.hidden_dropout = 1.5
    config.glue.learning_rate = -1.0
    with pytest.raises(ConfigError) as error:
        validation.validate(plan.build_plan(config, "/ablation"))
    for refused in ("pretrain.train.checkpoint_every=0 is not allowed", "glue.learning_rate=-1.0 is not allowed",
                    "pretrain.model.hidden_dropout=1.5 is not allowed"):
        assert refused in str(error.value)


def test_inf_and_nan_are_refused_by_every_float_rule():
    from roformer.data.config import RULES as DATA_RULES
    from roformer.glue import settings as glue_settings
    from roformer.model.encoder import RULES as MODEL_RULES
    from roformer.settings import refusal
    from roformer.train.config import RULES as TRAIN_RULES, TrainConfig

    tables = {"train.": TRAIN_RULES, "data.": DATA_RULES, "model.": MODEL_RULES,
              "config.": {**glue_settings.PROTOCOL_RULES, **glue_settings.RUN_RULES}}
    floats = [(prefix + key, rule) for prefix, rules in tables.items() for key, rule in rules.items()
              if rule.startswith("float")]
    assert len(floats) >= 15
    for key, rule in floats:
        for value in (float("inf"), float("-inf"), float("nan")):
            assert refusal(key, value, rule), f"{key}={value} passes {rule!r}"
    with pytest.raises(ConfigError, match=r"^train.eps=inf is not allowed: a number > 0$"):
        TrainConfig(eps=float("inf"))
    from roformer.configs import glue as glue_config
    config = glue_config.get_config()
    config.num_epochs = float("inf")
    with pytest.raises(ConfigError, match="config.num_epochs=inf is not allowed"):
        glue_settings.check_config(config)


def test_a_negative_device_count_is_refused():
    from roformer.train.sharding import make_mesh

    with pytest.raises(ConfigError, match=r"^mesh.num_devices=-3 is not allowed: an integer >= 0$"):
        make_mesh({"num_devices": -3, "data": -1, "fsdp": 1, "tensor": 1})


def test_glue_max_seq_len_beyond_any_example_is_refused():
    from roformer.configs import glue as glue_config
    from roformer.glue.settings import check_config

    config = glue_config.get_config()
    config.max_seq_len = 10**9
    with pytest.raises(ConfigError, match=r"config.max_seq_len=1000000000 is not allowed: an integer in \[8, 65536\]"):
        check_config(config)
