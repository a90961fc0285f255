"""GLUE's compile-only check (roformer.glue_launch_check): the real train and predict programs
compiled for one device of a target, with no GLUE data read and no checkpoint weights loaded,
and the one-line refusal of programs that device cannot hold. The target here is this host's
CPU devices standing in for a TPU's (a test with libtpu compiles for a real topology)."""
import dataclasses

import jax
import pytest

from roformer import deviceless, launch_check
from roformer.configs import glue as glue_config
from roformer.errors import ConfigError
from roformer import glue_launch_check as compile_only
from roformer.glue import readers, run
from roformer.checkpoint_source import CheckpointSource

needs_libtpu = pytest.mark.skipif(not launch_check.libtpu_available(),
                                  reason="compiling for a TPU needs libtpu (the [tpu] extra)")


def micro_glue_config(tasks="sst2,mnli,stsb"):
    config = glue_config.get_config()
    config.task = tasks
    config.model.update(size="tiny", vocab_size=128)
    config.update(batch_size=8, eval_batch_size=8, max_seq_len=32)
    return config


def untouchable(what):
    def touched(*args, **kwargs):
        raise AssertionError(f"{what} was touched")
    return touched


@pytest.fixture
def cpu_target(monkeypatch):
    """A target of this host's first four CPU devices with 1 GiB each; no data, no weights."""
    monkeypatch.setattr(launch_check, "target_devices", lambda target: jax.devices()[:4])
    monkeypatch.setattr(launch_check, "device_memory_bytes", lambda target, devices: 2**30)
    for module in (readers, run):
        monkeypatch.setattr(module, "read_split", untouchable("the GLUE data"))
    monkeypatch.setattr(CheckpointSource, "load", untouchable("the checkpoint's weights"))
    return launch_check.Target("cpu:4", "cpu", "cpu")


def test_glue_programs_compile_for_a_target_without_data_and_report_one_devices_memory(cpu_target):
    report = compile_only.compile_glue(micro_glue_config(), cpu_target)
    (group, (train, predict)), = report.programs   # one batch shape and optimizer setting for the three tasks
    assert group.tasks == ["sst2", "mnli", "stsb"] and group.task == "mnli"   # the most labels
    assert group.padding == "step" and group.program.lengths == (16, 32)   # cpu's padding, every length
    assert train.memory["temp_size_in_bytes"] > 0 and predict.peak_bytes < train.peak_bytes
    assert report.param_bytes > 0 and report.opt_bytes >= 2 * report.param_bytes   # AdamW's two moments
    assert not train.collectives   # one device exchanges nothing
    text = compile_only.format_report(report)
    assert "GLUE fine-tunes on one device, 1 of its 4" in text and "fits:" in text
    assert "collectives of the train program (mnli): none" in text
    compile_only.check_fits(report)
    with pytest.raises(ConfigError, match=r"^does not fit: the GLUE train program needs [^\n]* per device on cpu:4 "
                                          r"\(cpu\)[^\n]*lower batch_size or max_seq_len[^\n]*$"):
        compile_only.check_fits(dataclasses.replace(report, device_bytes=report.peak_bytes // 2))


def test_glue_compile_only_refuses_a_config_without_a_vocabulary_size_in_one_line(cpu_target):
    config = micro_glue_config("sst2")
    config.model.vocab_size = 0
    with pytest.raises(ConfigError, match=r"^--compile_only with config.init=none needs the vocabulary's size"):
        compile_only.compile_glue(config, cpu_target)


@needs_libtpu
@pytest.mark.slow
def test_glue_programs_compile_for_a_tpu_device():
    report = compile_only.compile_glue(micro_glue_config("sst2"), launch_check.parse_target("v5e:2x2"))
    assert report.device_bytes == 16 * 2**30 and report.devices == 4
    compile_only.check_fits(report)


@pytest.mark.skipif(not deviceless.plugin_available(), reason="compiling for a GPU needs the CUDA plugin")
@pytest.mark.slow
def test_glue_programs_compile_for_a_gpu_in_its_padded_form():
    report = compile_only.compile_glue(micro_glue_config("sst2"), launch_check.parse_target("h100:1"))
    (group, _), = report.programs
    assert group.padding == "call" and group.program.lengths == (32,)   # a GPU's: one length, no branch
    compile_only.check_fits(report)
