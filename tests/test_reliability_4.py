"""The fourth pass of fault and bad-input probes: locks that never hang, silent cases that
now refuse or warn, one line instead of a traceback, and the small ones (the signal a stop
names, a batch that cannot fit, a negative device count, a build's stale lock).

Each test fails on the code before the pass; the tiny pretraining run is test_refusals'."""
import json
import logging
import os
import shutil
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest

from helpers.refusals import make_config, refused_leaves_it_alone, snapshot
from roformer import cli, convert, workdir_lock as lock_module
from roformer.data import cache_lock
from roformer.errors import ConfigError, UserError
from roformer.train import train_and_evaluate
from roformer.workdir_lock import workdir_lock

UNWRITABLE = Path("/sys/kernel")   # a directory even root cannot create files in
needs_unwritable = pytest.mark.skipif(not UNWRITABLE.is_dir() or os.access(UNWRITABLE, os.W_OK) and os.getuid() != 0,
                                      reason="needs Linux's sysfs, where no process may create a file")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("data_cache")


@pytest.fixture(scope="module")
def finished(tmp_path_factory, cache):
    """test_refusals' tiny finished run: 4 steps, a checkpoint at step 4."""
    workdir = tmp_path_factory.mktemp("finished") / "run"
    train_and_evaluate(make_config(cache), workdir)
    return workdir


@pytest.fixture
def run(finished, tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(finished, workdir)
    return workdir


def finishes(fn, seconds: float) -> bool:
    """Whether fn() returns within `seconds` (it runs in a daemon thread: a hang is left behind)."""
    done = threading.Event()
    threading.Thread(target=lambda: (fn(), done.set()), daemon=True).start()
    return done.wait(seconds)


def take_and_release(workdir: Path) -> None:
    with workdir_lock(workdir):
        pass


# ------------------------------------------------------------------ 5. locks that never hang

def test_an_empty_lock_with_a_future_mtime_is_taken_over(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(lock_module, "UNREADABLE_GRACE_S", 0.3)
    lock = tmp_path / "workdir.lock"
    lock.touch()
    future = lock.stat().st_mtime + 365 * 24 * 3600
    os.utime(lock, (future, future))
    with caplog.at_level(logging.INFO, logger="roformer"):
        assert finishes(lambda: take_and_release(tmp_path), 20), "waited on an empty lock dated in the future"
    assert "waiting up to" in caplog.text and "taking over an empty or unreadable lock file" in caplog.text
    assert not lock.exists()


def test_a_dangling_symlink_lock_is_removed(tmp_path, caplog):
    lock = tmp_path / "workdir.lock"
    lock.symlink_to(tmp_path / "nowhere" / "lock")
    with caplog.at_level(logging.WARNING, logger="roformer"):
        assert finishes(lambda: take_and_release(tmp_path), 20), "waited on a symbolic link to nothing"
    assert "a symbolic link to nothing" in caplog.text
    assert not lock.is_symlink()


def test_the_cache_lock_takes_a_dangling_symlink(tmp_path):
    target = tmp_path / "shards" / "entry"
    target.parent.mkdir()
    (target.parent / ".entry.lock").symlink_to(tmp_path / "nowhere" / "lock")

    def build():
        with cache_lock.build_lock(target):
            target.mkdir()
    assert finishes(build, 20)
    assert target.is_dir() and not (target.parent / ".entry.lock").is_symlink()


# ------------------------------------------------------------------ 6. silent cases refuse or warn

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


def test_a_resume_that_changes_the_tokenizer_settings_is_refused(run, cache):
    """The run keeps the tokenizer it trained: a new data.vocab_size or data.lowercase would
    change nothing but config.json, which would then lie."""
    refused_leaves_it_alone(run, make_config(cache, **{"data.vocab_size": 600, "train.steps": 8}), ConfigError,
                            r"data.vocab_size=600 \(the run's is 500\)")
    refused_leaves_it_alone(run, make_config(cache, **{"data.lowercase": False, "train.steps": 8}), ConfigError,
                            r"data.lowercase=False \(the run's is True\)")


def test_a_checkpoint_without_data_state_says_the_order_starts_again(run, cache, caplog):
    step = run / "checkpoints" / "4"
    (step / "checksums.json").unlink()   # a checkpoint of a version that saved none
    (step / "data" / "metadata").write_text("{}")
    with caplog.at_level(logging.WARNING):
        train_and_evaluate(make_config(cache, **{"train.steps": 6}), run)
    warnings = [r.getMessage() for r in caplog.records if "data-iterator state" in r.getMessage()]
    assert len(warnings) == 1 and "starts again at the corpus's first row" in warnings[0]


def test_token_ids_beyond_the_vocabulary_make_a_cache_entry_unusable(finished, cache, tmp_path):
    from roformer.data.shards import open_shards

    entry = next((cache / "shards").iterdir())
    damaged = tmp_path / entry.name
    damaged.mkdir()
    for path in entry.iterdir():
        (damaged / path.name).write_bytes(path.read_bytes())
    manifest = json.loads((damaged / "manifest.json").read_text())
    assert open_shards(damaged, {})[0] is not None
    meta = manifest["shards"][0]["files"]["tokens"]
    tokens = np.load(damaged / meta["file"])
    tokens[3] = manifest["vocab_size"] + 7   # what a damaged or crafted entry holds
    np.save(damaged / meta["file"], tokens)
    meta["bytes"] = (damaged / meta["file"]).stat().st_size
    meta["crc32"] = zlib.crc32((damaged / meta["file"]).read_bytes())
    (damaged / "manifest.json").write_text(json.dumps(manifest))
    corpus, problem = open_shards(damaged, {})
    assert corpus is None and f"beyond the vocabulary of {manifest['vocab_size']}" in problem


# ------------------------------------------------------------------ 7. one line, not a traceback

def one_line_error(capsys, fn) -> str:
    """The `error: ...` line the command lines print for what `fn` raises (exit status 2)."""
    with pytest.raises(SystemExit) as stopped, cli.user_errors():
        fn()
    err = capsys.readouterr().err.strip()
    assert stopped.value.code == cli.EXIT_USER_ERROR and err.startswith("error: ") and "\n" not in err, err
    return err


def test_damaged_metrics_lines_are_skipped_with_one_warning(tmp_path, caplog):
    from roformer.train.metrics import _drop_rows_after, read_metrics

    good = [json.dumps({"step": s, "loss": 5.0 - s / 10}).encode() for s in (1, 2, 3, 4)]
    flipped = bytearray(good[1])
    flipped[5] |= 0x80   # one high bit
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b"\n".join([good[0], bytes(flipped), b"\x00\xff\xfe binary", good[2],
                                 b'{"step": "3x", "loss": 1}', good[3]]) + b"\n")
    with caplog.at_level(logging.WARNING):
        rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 3, 4]
    assert "skipped 3 damaged line(s) (line 2, ...)" in caplog.text
    _drop_rows_after(path, 3)   # a resume at step 3 rewrites it readable
    assert path.read_text().splitlines() == [json.dumps(json.loads(g)) for g in good[:1] + good[2:3]]


def test_metrics_jsonl_a_directory_is_refused_before_anything_is_written(run, cache):
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").mkdir()
    refused_leaves_it_alone(run, make_config(cache, **{"train.steps": 8}), ConfigError,
                            "metrics.jsonl is a directory, not the run's metrics log")


@needs_unwritable
def test_a_cache_that_cannot_be_written_is_one_line(capsys):
    err = one_line_error(capsys, lambda: cache_lock.build_lock(UNWRITABLE / "shards-entry").__enter__())
    assert "must be built but the cache /sys/kernel cannot be written" in err


@needs_unwritable
def test_evaluate_refuses_an_unwritable_result_before_computing(finished, monkeypatch, capsys):
    from roformer import evaluate
    from roformer.train import checkpoint_eval

    monkeypatch.setattr(checkpoint_eval, "evaluate_checkpoint", lambda *a, **k: pytest.fail("computed first"))
    with pytest.raises(SystemExit) as stopped:
        evaluate.main(["--workdir", str(finished), "--out", str(UNWRITABLE / "eval.json")])
    err = capsys.readouterr().err.strip()
    assert stopped.value.code == 2 and err.startswith("error: cannot write the held-out metrics eval.json into")


def test_a_name_too_long_for_the_file_system_is_one_line(cache, tmp_path, capsys):
    err = one_line_error(capsys, lambda: train_and_evaluate(make_config(cache), tmp_path / ("a" * 300)))
    assert "is too long for the file system" in err


def test_a_seed_beyond_32_bits_and_too_many_masked_slots_are_refused(cache):
    from roformer.data import DataConfig, make_pretrain_data
    from roformer.train.config import TrainConfig

    with pytest.raises(ConfigError, match=r"train.seed=1180591620717411303424 is not allowed: an integer in "
                                          r"\[0, 4294967295\]"):
        TrainConfig(seed=2**70)
    data = DataConfig(cache_dir=str(cache), vocab_size=500, max_predictions_per_seq=100_000)
    with pytest.raises(ConfigError, match=r"data.max_predictions_per_seq=100000 is more than the 32 positions"):
        make_pretrain_data(data, seq_len=32, batch_size=8, seed=0, show_progress=False)


def test_to_hf_onto_a_file_is_one_line(finished, tmp_path, capsys):
    target = tmp_path / "model"
    target.write_text("a file")
    err = one_line_error(capsys, lambda: convert.main(["to-hf", str(finished), str(target)]))
    assert "is a file, not a directory" in err and target.read_text() == "a file"


def test_an_export_stopped_midway_is_refused_by_from_hf(finished, tmp_path, monkeypatch, capsys):
    def stopped(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(convert, "save_hf_tokenizer", stopped)
    with pytest.raises(SystemExit):
        convert.main(["to-hf", str(finished), str(tmp_path / "hf")])
    assert (tmp_path / "hf" / "model.safetensors").is_file() and (tmp_path / "hf" / "config.json").is_file()
    capsys.readouterr()
    err = one_line_error(capsys, lambda: convert.main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "ours")]))
    assert "is an export that did not finish" in err


def test_glue_max_seq_len_beyond_any_example_is_refused():
    from roformer.configs import glue as glue_config
    from roformer.glue.settings import check_config

    config = glue_config.get_config()
    config.max_seq_len = 10**9
    with pytest.raises(ConfigError, match=r"config.max_seq_len=1000000000 is not allowed: an integer in \[8, 65536\]"):
        check_config(config)


def test_a_damaged_saved_model_is_one_line(tmp_path):
    from flax import nnx

    from roformer.model import ModelConfig, RoFormerForSequenceClassification

    model = RoFormerForSequenceClassification(ModelConfig(vocab_size=50, hidden_size=16, num_layers=1, num_heads=2,
                                                          intermediate_size=32, max_position_embeddings=32),
                                              2, rngs=nnx.Rngs(0))
    saved = convert.save_converted(model, tmp_path / "seed0")
    meta = (saved / convert.OUR_CONFIG_FILE).read_text()
    convert.load_converted(saved)

    def refused(match: str) -> None:
        with pytest.raises(ConfigError, match=match):
            convert.load_converted(saved)

    (saved / convert.OUR_CONFIG_FILE).write_text("")   # a save killed mid-way, before the atomic writes
    refused("model_config.json cannot be read .*the model there is damaged")
    (saved / convert.OUR_CONFIG_FILE).write_text(json.dumps({**json.loads(meta), "head": "regression"}))
    refused("model_config.json cannot be read")
    wrong = json.loads(meta)
    wrong["model"]["hidden_size"] = 24
    (saved / convert.OUR_CONFIG_FILE).write_text(json.dumps(wrong))
    refused("parameters in .* cannot be read as the model model_config.json describes")
    (saved / convert.OUR_CONFIG_FILE).write_text(meta)
    (saved / "params" / "_METADATA").unlink()
    refused("parameters in .* cannot be read")
    rng = np.random.default_rng(0)
    for path in (saved / "params").rglob("*"):
        if path.is_file():
            path.write_bytes(rng.bytes(path.stat().st_size or 64))
    refused("parameters in .* cannot be read")


# ------------------------------------------------------------------ 8. the small ones

def test_a_ctrl_c_stop_is_labelled_sigint():
    from roformer.pretrain import next_steps
    from roformer.train.progress import summary_line

    summary = {"final_step": 7, "start_step": 0, "preempted": True, "stop_signal": "SIGINT"}
    assert summary_line(summary) == "summary: 7 steps (stopped: SIGINT)"
    assert next_steps(summary, "runs/x").startswith("stopped at step 7 (SIGINT); run the same command again")


def test_a_negative_device_count_is_refused():
    from roformer.train.sharding import make_mesh

    with pytest.raises(ConfigError, match=r"^mesh.num_devices=-3 is not allowed: an integer >= 0$"):
        make_mesh({"num_devices": -3, "data": -1, "fsdp": 1, "tensor": 1})


def test_a_batch_that_cannot_fit_is_refused_with_an_estimate(cache, tmp_path, monkeypatch):
    from roformer.train import memory   # before any training: the code without the estimate would try it

    monkeypatch.setattr(memory, "available_host_bytes", lambda: 8 * memory.GIB)
    workdir = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"^train.batch_size=10000000 at train.seq_len=32 cannot fit: one step needs "
                                          r"at least [\d,.]+ GiB of host memory \(the batch [\d.]+ GiB, activations "
                                          r"[\d,.]+ GiB, parameters and optimizer state [\d.]+ GiB\), [\d,]+x the 8.0 "
                                          r"GiB available; lower train.batch_size, or raise train.grad_accum"):
        train_and_evaluate(make_config(cache, **{"train.batch_size": 10**7}), workdir)
    assert snapshot(workdir) == {}
    memory.check_step_memory(make_model_config(), batch_size=8, seq_len=32, num_predictions=6, grad_accum=1,
                             num_devices=1)   # the tests' own batch fits
    with pytest.raises(ConfigError, match=r"train.batch_size=100000 at train.seq_len=32 for 4 seeds cannot fit"):
        memory.check_step_memory(make_model_config(), batch_size=100_000, seq_len=32, num_predictions=6, grad_accum=1,
                                 num_devices=1, seeds=4)   # vmapped seeds: each its own batch and state


def make_model_config():
    from roformer.model import ModelConfig
    return ModelConfig(vocab_size=500, hidden_size=32, intermediate_size=64, num_heads=2, num_layers=2)


def test_a_shard_build_stopped_by_sigterm_leaves_a_lock_the_next_build_takes_over(tmp_path, caplog):
    """SIGTERM's default action ends a build before it can remove its name beside the lock; the
    kernel released the flock with the process, and the next build takes over, saying so."""
    target = tmp_path / "shards" / "entry"
    target.parent.mkdir()
    (target.parent / ".entry.builder").write_text("host elsewhere pid 4194304\n")
    with caplog.at_level(logging.INFO, logger="roformer.data.cache_lock"):
        assert finishes(lambda: cache_lock.build_lock(target).__enter__(), 20)
    assert "taking over the lock left by a build that was stopped (host elsewhere pid 4194304)" in caplog.text


def test_user_error_types_are_what_the_command_lines_print():
    assert issubclass(cache_lock.CacheUnwritable, UserError)
    assert cli.is_user_error(OSError(36, "File name too long", "x" * 300))
