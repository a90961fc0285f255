"""What a pretraining run refuses, and nothing written before a refusal: every check that
can refuse a run (a setting, resume compatibility of the model, the corpus, its masking and
its tokenizer, the workdir lock, a batch or step that cannot fit, a name too long) runs
before any file of the workdir is created or replaced; each resume test compares the
workdir byte for byte before and after the refused command."""
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import one_line_error
from helpers.refusals import make_config, refused_leaves_it_alone, snapshot
from roformer.errors import ConfigError
from roformer.train import train_and_evaluate
from roformer.workdir_lock import WorkdirBusy

REPO = Path(__file__).resolve().parents[1]


def test_a_refused_setting_writes_nothing(tiny_run_copy, tiny_cache, tmp_path):
    refused_leaves_it_alone(tiny_run_copy, make_config(tiny_cache, **{"train.steps": 0}), ConfigError,
                            "train.steps=0 is not allowed")
    refused_leaves_it_alone(tiny_run_copy, make_config(tiny_cache, **{"train.keep_checkpoints": -1, "train.steps": 8}),
                            ConfigError, "train.keep_checkpoints=-1 is not allowed")
    fresh = tmp_path / "fresh" / "run"
    with pytest.raises(ConfigError, match="train.checkpoint_every=0"):
        train_and_evaluate(make_config(tiny_cache, **{"train.checkpoint_every": 0}), fresh)
    assert not (tmp_path / "fresh").exists()


def test_a_refused_resume_of_another_model_writes_nothing(tiny_run_copy, tiny_cache):
    refused_leaves_it_alone(tiny_run_copy, make_config(tiny_cache, **{"model.hidden_size": 64, "train.steps": 8}),
                            ConfigError, "hidden_size: checkpoint=32 config=64")


def test_a_refused_resume_of_another_corpus_or_masking_writes_nothing(tiny_run_copy, tiny_cache, tmp_path):
    """The probes' case: resuming with another corpus (its own trained tokenizer) or another
    mask rate is refused, and the run's tokenizer and config.json still describe its checkpoints."""
    refused_leaves_it_alone(tiny_run_copy, make_config(tiny_cache, **{"data.mask_rate": 0.3, "train.steps": 8}),
                            ConfigError, "data iterator state has")
    text = tmp_path / "other.txt"
    text.write_text("\n\n".join(f"another corpus, document {i}, with words of its own: " + " ".join(
        f"word{(i * 7 + j) % 300}" for j in range(40)) for i in range(200)) + "\n")
    other = make_config(tiny_cache, **{"train.steps": 8})
    other.data.source, other.data.files = "files", str(text)
    # a tokenizer of another size is refused as another model, one of the same size by the corpus check
    refused_leaves_it_alone(tiny_run_copy, other, ConfigError, "data iterator state has|vocab_size: checkpoint=")


def test_a_workdir_in_use_is_refused_before_anything_is_written(tiny_run_copy, tiny_cache):
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom roformer.workdir_lock import workdir_lock\n"
                               "with workdir_lock(sys.argv[1]):\n    print('locked', flush=True)\n    time.sleep(60)\n",
                               str(tiny_run_copy)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        refused_leaves_it_alone(tiny_run_copy, make_config(tiny_cache, **{"train.steps": 8}), WorkdirBusy,
                                "in use by another run")
    finally:
        holder.kill()
        holder.wait()


def test_a_kernel_the_model_cannot_run_is_refused_before_the_data_is_prepared(tmp_path):
    """attention_impl=cudnn with float32 compute (and, on a CPU, no GPU at all): refused in
    one line before the corpus is tokenized into the data cache or a workdir is made, by one
    run and by vmapped seeds alike."""
    from roformer.train.seeds import train_seeds_and_evaluate

    cache, cudnn = tmp_path / "cache", {"model.attention_impl": "cudnn"}
    with pytest.raises(ConfigError, match=r"^model.attention_impl='cudnn' cannot be used: [^\n]*$"):
        train_and_evaluate(make_config(cache, **cudnn), tmp_path / "run")
    seeds = [make_config(cache, **cudnn, **{"train.seed": seed}) for seed in (0, 1)]
    with pytest.raises(ConfigError, match=r"^model.attention_impl='cudnn' cannot be used: [^\n]*$"):
        train_seeds_and_evaluate(seeds, [tmp_path / "seed0", tmp_path / "seed1"])
    assert list(tmp_path.iterdir()) == []


def test_a_step_the_device_cannot_hold_is_refused_before_the_state_is_made(tiny_cache, tmp_path, monkeypatch):
    """On a device that reports its memory, the compiled train step that exceeds it is refused in
    one line, before the state is initialised and before the run's files are written."""
    from roformer.train import compiled

    monkeypatch.setattr(compiled, "device_memory_limit", lambda: 2**20)
    workdir = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"^does not fit: the train step needs [^\n]* per device on this cpu, "
                                          r"which has 1.0 MiB [^\n]*train.batch_size[^\n]*$"):
        train_and_evaluate(make_config(tiny_cache), workdir)
    assert [p.name for p in workdir.rglob("*") if p.is_file() and not p.name.startswith(".")] == []


def test_a_resume_that_changes_the_tokenizer_settings_is_refused(tiny_run_copy, tiny_cache):
    """The run keeps the tokenizer it trained: a new data.vocab_size or data.lowercase would
    change nothing but config.json, which would then lie."""
    refused_leaves_it_alone(tiny_run_copy, make_config(tiny_cache, **{"data.vocab_size": 600, "train.steps": 8}),
                            ConfigError, r"data.vocab_size=600 \(the run's is 500\)")
    refused_leaves_it_alone(tiny_run_copy, make_config(tiny_cache, **{"data.lowercase": False, "train.steps": 8}),
                            ConfigError, r"data.lowercase=False \(the run's is True\)")


def test_a_checkpoint_without_data_state_says_the_order_starts_again(tiny_run_copy, tiny_cache, caplog):
    step = tiny_run_copy / "checkpoints" / "4"
    (step / "checksums.json").unlink()   # a checkpoint of a version that saved none
    (step / "data" / "metadata").write_text("{}")
    with caplog.at_level(logging.WARNING):
        train_and_evaluate(make_config(tiny_cache, **{"train.steps": 6}), tiny_run_copy)
    warnings = [r.getMessage() for r in caplog.records if "data-iterator state" in r.getMessage()]
    assert len(warnings) == 1 and "starts again at the corpus's first row" in warnings[0]


def test_metrics_jsonl_a_directory_is_refused_before_anything_is_written(tiny_run_copy, tiny_cache):
    (tiny_run_copy / "metrics.jsonl").unlink()
    (tiny_run_copy / "metrics.jsonl").mkdir()
    refused_leaves_it_alone(tiny_run_copy, make_config(tiny_cache, **{"train.steps": 8}), ConfigError,
                            "metrics.jsonl is a directory, not the run's metrics log")


def test_a_name_too_long_for_the_file_system_is_one_line(tiny_cache, tmp_path, capsys):
    err = one_line_error(capsys, lambda: train_and_evaluate(make_config(tiny_cache), tmp_path / ("a" * 300)))
    assert "is too long for the file system" in err


def test_a_seed_beyond_32_bits_and_too_many_masked_slots_are_refused(tiny_cache):
    from roformer.data import DataConfig, make_pretrain_data
    from roformer.train.config import TrainConfig

    with pytest.raises(ConfigError, match=r"train.seed=1180591620717411303424 is not allowed: an integer in "
                                          r"\[0, 4294967295\]"):
        TrainConfig(seed=2**70)
    data = DataConfig(cache_dir=str(tiny_cache), vocab_size=500, max_predictions_per_seq=100_000)
    with pytest.raises(ConfigError, match=r"data.max_predictions_per_seq=100000 is more than the 32 positions"):
        make_pretrain_data(data, seq_len=32, batch_size=8, seed=0, show_progress=False)


def test_a_batch_that_cannot_fit_is_refused_with_an_estimate(tiny_cache, tmp_path, monkeypatch):
    from roformer.train import memory   # before any training: the code without the estimate would try it

    monkeypatch.setattr(memory, "available_host_bytes", lambda: 8 * memory.GIB)
    workdir = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"^train.batch_size=10000000 at train.seq_len=32 cannot fit: one step needs "
                                          r"at least [\d,.]+ GiB of host memory \(the batch [\d.]+ GiB, activations "
                                          r"[\d,.]+ GiB, parameters and optimizer state [\d.]+ GiB\), [\d,]+x the 8.0 "
                                          r"GiB available; lower train.batch_size, or raise train.grad_accum"):
        train_and_evaluate(make_config(tiny_cache, **{"train.batch_size": 10**7}), workdir)
    assert snapshot(workdir) == {}
    memory.check_step_memory(make_model_config(), batch_size=8, seq_len=32, num_predictions=6, grad_accum=1,
                             num_devices=1)   # the tests' own batch fits
    with pytest.raises(ConfigError, match=r"train.batch_size=100000 at train.seq_len=32 for 4 seeds cannot fit"):
        memory.check_step_memory(make_model_config(), batch_size=100_000, seq_len=32, num_predictions=6, grad_accum=1,
                                 num_devices=1, seeds=4)   # vmapped seeds: each its own batch and state


def make_model_config():
    from roformer.model import ModelConfig
    return ModelConfig(vocab_size=500, hidden_size=32, intermediate_size=64, num_heads=2, num_layers=2)
