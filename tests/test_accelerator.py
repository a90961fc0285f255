"""The accelerator setting (`accel=gpu|tpu` in a config argument, roformer/accelerator.py):
what it selects in every pretraining config file and in the GLUE config, that a GPU then
runs attention as the fused kernel wherever the scheme allows it, and that an unknown value
is refused in one line."""
import importlib

import pytest

from roformer.errors import ConfigError
from roformer.model.attention import attention_summary
from roformer.train.config import build_model_config

pytestmark = pytest.mark.fast   # the fast lane (docs/testing.md)

PRETRAINING_CONFIGS = ("absolute", "alibi", "bert_staged", "none", "relative", "rotary", "rotary_linear",
                       "sinusoidal", "t5", "tiny")
# What a GPU runs while training each scheme under accel=gpu: the fused kernel, except where
# the scheme's attention is not one a kernel takes.
NOT_FUSED = {"relative": "Shaw relative keys and values", "rotary_linear": "linear attention"}


def get_config(name: str, arg: str | None = None):
    return importlib.import_module(f"roformer.configs.{name}").get_config(arg)


@pytest.mark.parametrize("name", PRETRAINING_CONFIGS)
def test_accel_gpu_selects_bf16_no_attention_dropout_and_the_fused_kernel(name):
    model = build_model_config(get_config(name, "size=mini,accel=gpu").model, vocab_size=64)
    assert (model.dtype, model.attention_dropout, model.attention_impl) == ("bfloat16", 0.0, "auto")
    summary = attention_summary(model, training=True, platform="gpu")
    assert ("cudnn fused kernel" in summary) == (name not in NOT_FUSED), summary
    if name in NOT_FUSED:
        assert NOT_FUSED[name] in summary
    assert build_model_config(get_config(name, "size=mini,accel=tpu").model, vocab_size=64).dtype == "bfloat16"


def test_without_the_setting_a_gpu_runs_the_slow_path_and_the_start_up_line_says_why():
    model = build_model_config(get_config("rotary", "size=mini").model, vocab_size=64)
    assert "set model.attention_dropout=0" in attention_summary(model, training=True, platform="gpu")
    assert "cudnn" not in attention_summary(model, training=False, platform="gpu")   # float32
    cpu = build_model_config(get_config("rotary", "size=mini,accel=cpu").model, vocab_size=64)
    assert (cpu.dtype, cpu.attention_dropout) == (model.dtype, model.attention_dropout)


@pytest.mark.parametrize("arg", ["accel=gpu", "smoke,accel=gpu"])
def test_the_glue_config_takes_the_same_setting(arg):
    section = get_config("glue", arg).model
    assert (section.dtype, section.attention_dropout, section.attention_impl) == ("bfloat16", 0.0, "auto")
    assert get_config("glue").model.dtype == "float32"


@pytest.mark.parametrize("name", ["rotary", "glue"])
def test_an_unknown_accelerator_is_refused_in_one_line(name):
    with pytest.raises(ConfigError, match=r"^unknown accel='h100'; choose one of \['cpu', 'gpu', 'tpu'\]$"):
        get_config(name, "accel=h100")
