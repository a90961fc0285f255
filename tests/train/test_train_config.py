"""roformer.train.config and the config files: every scheme's file builds its model, config
arguments and overrides, the sections' defaults."""
import importlib

import pytest

from roformer.configs import SCHEME_FILES
from roformer.model import ModelConfig
from roformer.train import build_model_config
from roformer.train.config import TrainConfig, arm_model_keys

pytestmark = pytest.mark.fast   # the fast lane (docs/testing.md)

# config file -> the position it selects: every arm's own file
SCHEMES = {file: arm_model_keys(arm)["position"] for arm, file in SCHEME_FILES.items()}


def load_config(name: str, arg: str | None = None):
    return importlib.import_module(f"roformer.configs.{name}").get_config(arg)


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_scheme_configs_build_their_model(name):
    config = load_config(name, "size=mini")
    model_cfg = build_model_config(config.model, vocab_size=1000)
    assert model_cfg.position == SCHEMES[name] and model_cfg.hidden_size == 256
    assert model_cfg.attention == ("linear" if name == "rotary_linear" else "softmax")


def test_config_arguments_and_overrides():
    assert load_config("rotary").model.size == "base"
    tiny = load_config("tiny")
    assert tiny.model.size == "tiny" and tiny.data.source == "embedded"
    assert load_config("tiny", "source=files").model.size == "tiny"
    config = load_config("rotary", "size=base,source=files")
    assert (config.model.size, config.data.source) == ("base", "files")
    config.model.hidden_size = 384                   # an explicit field beats the preset
    assert build_model_config(config.model, vocab_size=10).hidden_size == 384
    with pytest.raises(ValueError, match="unknown config argument"):
        load_config("rotary", "sise=base")


def test_config_sections_are_the_dataclass_defaults_and_a_retired_key_names_its_replacement():
    config = load_config("base")
    assert TrainConfig.from_section(config.train) == TrainConfig()
    assert build_model_config(config.model, vocab_size=1000) == ModelConfig(vocab_size=1000)
    assert config.train.dtype is None            # kept as an unset placeholder, so the CLI reaches the refusal
    config.train.dtype = "bfloat16"
    with pytest.raises(ValueError, match=r"^train.dtype is now model.dtype: set --config.model.dtype instead$"):
        TrainConfig.from_section(config.train)
    with pytest.raises(ValueError, match=r"unknown train settings \['stpes'\]"):
        TrainConfig.from_section({"stpes": 10})
