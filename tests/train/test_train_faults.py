"""Checkpoint/resume and fault handling of the pretraining loop.

Exact resume after SIGTERM (save + exit 0) and SIGKILL, the divergence guard (non-finite
and finite), checkpoint retention, a full disk, fallback from a corrupt newest
checkpoint, and refusal of a changed model config.
"""
import errno
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from helpers import MICRO_MODEL, patient, tiny_run_config
from roformer.train import read_metrics, train_and_evaluate
from roformer.train.checkpoint import Checkpointer
from roformer.train.guard import CheckpointSaveFailed, TrainingDiverged

REPO = Path(__file__).resolve().parents[2]
STEPS = 24

# A 2-layer, 32-wide model on seq 32: every run here shares these settings.
OVERRIDES = {
    **MICRO_MODEL,
    "model.hidden_dropout": 0.1,                     # dropout on: resume must replay its keys
    "train.steps": STEPS, "train.batch_size": 8, "train.seq_len": 32, "train.warmup_steps": 2,
    "train.log_every": 1, "train.eval_every": 1000, "train.eval_batches": 1,
    "train.checkpoint_every": 4, "train.keep_checkpoints": 2, "train.progress_bar": False,
    "mesh.num_devices": 1,                           # one device compiles fastest
}


def make_config(cache: Path, **extra):
    return tiny_run_config(cache, OVERRIDES, **extra)


def cli(workdir: Path, cache: Path, **extra) -> list[str]:
    flags = [f"--config.{k}={v}" for k, v in {**OVERRIDES, "data.cache_dir": cache, **extra}.items()]
    return [sys.executable, "-m", "roformer.pretrain", "--config=configs/tiny.py",
            f"--workdir={workdir}", *flags]


def latest_params(workdir: Path) -> dict:
    directory = workdir / "checkpoints"
    with ocp.CheckpointManager(directory, item_names=("state",)) as manager:
        step = manager.latest_step()
        state = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]
    return step, state["params"]


def logged_step(workdir: Path) -> int:
    try:
        rows = read_metrics(workdir)
    except (FileNotFoundError, json.JSONDecodeError):
        return 0
    return max((r["step"] for r in rows if "loss" in r), default=0)


def run_until(command, workdir: Path, step: int, sig: int, timeout: float = 240) -> subprocess.Popen:
    """Start the CLI, send `sig` once metrics.jsonl shows `step`, wait for exit."""
    # the second run compiles the same programs as the first: share a persistent cache
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(workdir.parent / "jax_cache"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    timeout = patient(timeout)
    deadline = time.time() + timeout
    while logged_step(workdir) < step:
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            pytest.fail(f"run ended or timed out before step {step}:\n{proc.communicate()[0][-3000:]}")
        time.sleep(0.02)
    proc.send_signal(sig)
    proc.output = proc.communicate(timeout=timeout)[0]
    return proc


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("data_cache")


@pytest.mark.slow
def test_resume_after_sigterm_and_sigkill_matches_uninterrupted_run(tmp_path, cache):
    reference = tmp_path / "reference"
    summary = train_and_evaluate(make_config(cache), reference)   # also builds the data cache
    assert summary["final_step"] == STEPS and summary["final_loss"] < summary["first_loss"]

    # Evaluating every step changes nothing in the parameters but slows the run,
    # so the signals land mid-run.
    slow = {"train.eval_every": 1, "train.eval_batches": 4}
    interrupted = tmp_path / "interrupted"
    term = run_until(cli(interrupted, cache, **slow), interrupted, 5, signal.SIGTERM)
    assert term.returncode == 0, term.output[-3000:]
    summary = json.loads((interrupted / "summary.json").read_text())
    assert summary["preempted"] and summary["final_step"] < STEPS
    assert f"stopped at step {summary['final_step']} (SIGTERM); run the same command again" in term.output
    assert latest_params(interrupted)[0] == summary["final_step"]   # saved at the stop step

    kill = run_until(cli(interrupted, cache, **slow), interrupted, summary["final_step"] + 6, signal.SIGKILL)
    assert kill.returncode == -signal.SIGKILL
    assert logged_step(interrupted) < STEPS

    resumed = train_and_evaluate(make_config(cache), interrupted)
    assert 0 < resumed["start_step"] < STEPS and resumed["final_step"] == STEPS
    (ref_step, ref), (step, got) = latest_params(reference), latest_params(interrupted)
    assert ref_step == step == STEPS
    diffs = [np.max(np.abs(np.asarray(a) - np.asarray(b)))
             for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(got))]
    assert max(diffs) <= 1e-6

    config = json.loads((interrupted / "config.json").read_text())
    assert config["train"]["steps"] == STEPS and config["resolved_model"]["hidden_size"] == 32
    assert any(p.name.startswith("events") for p in (interrupted / "tensorboard").iterdir())


@pytest.mark.slow
def test_nan_guard_corrupt_fallback_and_config_mismatch(tmp_path, cache, caplog, monkeypatch):
    workdir = tmp_path / "run"
    with pytest.raises(FloatingPointError, match="at step 10"):
        train_and_evaluate(make_config(cache, **{"train.debug_nan_step": 10, "train.steps": 12}), workdir)
    assert latest_params(workdir)[0] == 8          # the last good checkpoint stays the newest

    state_dir = workdir / "checkpoints" / "8" / "state"
    for path in state_dir.rglob("*"):             # simulate a save killed half-way
        if path.is_file() and path.name != "_METADATA":
            path.write_bytes(b"")
    with caplog.at_level(logging.WARNING, logger="roformer.train"):
        summary = train_and_evaluate(make_config(cache, **{"train.steps": 6}), workdir)
    assert "step 8" in caplog.text and "unreadable" in caplog.text
    assert summary["start_step"] == 4 and summary["final_step"] == 6
    assert (workdir / "corrupt_checkpoints" / "8").is_dir()

    closed = []
    real_close = Checkpointer.close
    monkeypatch.setattr(Checkpointer, "close", lambda self: (closed.append(self), real_close(self)))
    with pytest.raises(ValueError, match="hidden_size: checkpoint=32 config=64") as error:
        train_and_evaluate(make_config(cache, **{"model.hidden_size": 64}), workdir)
    assert "intermediate_size" not in str(error.value)
    assert [c.directory for c in closed] == [(workdir / "checkpoints").resolve()]  # the refused run released orbax
    closed[0].close()                                           # and closing again is harmless


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, cache):
    """A run that trained to its last step (4, checkpointed there), copied per test."""
    workdir = tmp_path_factory.mktemp("finished") / "run"
    train_and_evaluate(make_config(cache, **{"train.steps": 4}), workdir)
    return workdir


def test_rerun_of_a_finished_run_leaves_it_intact(finished_run, cache, tmp_path, caplog):
    workdir = tmp_path / "run"
    shutil.copytree(finished_run, workdir)
    files = {name: (workdir / name).read_bytes() for name in ("summary.json", "metrics.jsonl", "config.json")}
    for steps in (4, 2):   # at or below the checkpointed step
        with caplog.at_level(logging.INFO, logger="roformer.train"):
            summary = train_and_evaluate(make_config(cache, **{"train.steps": steps}), workdir)
        assert "already complete at step 4" in caplog.text
        assert " device: " in caplog.text and "; attention: softmax, " in caplog.text   # the start-up line
        assert summary == json.loads(files["summary.json"])
        assert summary["final_loss"] is not None and summary["tokens_per_sec"] is not None
        assert {name: (workdir / name).read_bytes() for name in files} == files


def test_no_readable_checkpoint_starts_over_saying_so(finished_run, cache, tmp_path):
    """Every checkpoint corrupt: one warning per checkpoint moved aside, one line saying the
    run starts from step 0, none of orbax's echo of the failed reads, and at the end one
    line that says where the outputs are and what to run next."""
    workdir = tmp_path / "run"
    shutil.copytree(finished_run, workdir)
    for path in (workdir / "checkpoints").rglob("state/*"):   # a save killed half-way
        if path.is_file() and path.name != "_METADATA":
            path.write_bytes(b"")
    proc = subprocess.run(cli(workdir, cache, **{"train.steps": 6}), cwd=REPO, capture_output=True, text=True,
                          timeout=patient(600))
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [line for line in proc.stderr.splitlines() if "readable" in line]
    assert len(warnings) == 2, proc.stderr[-3000:]
    assert "checkpoint at step 4" in warnings[0] and "unreadable" in warnings[0]
    assert "trying" not in warnings[0] and "falling back" not in warnings[0]
    assert warnings[1].endswith(f"no readable checkpoint in {workdir}/checkpoints; starting from step 0 "
                                f"(the unreadable ones are in {workdir}/corrupt_checkpoints)")
    for noise in ("Traceback", "Event loop is closed", "never retrieved"):
        assert noise not in proc.stderr, proc.stderr[-3000:]
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["start_step"] == 0 and summary["final_step"] == 6
    assert [r["step"] for r in read_metrics(workdir) if "loss" in r] == [1, 2, 3, 4, 5, 6]   # one timeline
    last = proc.stdout.splitlines()[-1]   # the line after the summary line
    assert last.startswith(f"done: metrics in {workdir}/metrics.jsonl, TensorBoard in {workdir}/tensorboard, "
                           f"checkpoints in {workdir}/checkpoints. Next, GLUE: python -m roformer.glue "
                           f"--config=configs/glue.py:smoke --config.init={workdir} --workdir={workdir}_glue")


def test_resume_logs_each_step_once(finished_run, cache, tmp_path, caplog):
    """Extending a finished run resumes it; rows an interrupted attempt logged past the
    checkpoint it resumes from (and a torn last line) are dropped, not duplicated; orbax
    does not warn about the checkpoint items that a partial restore leaves unread."""
    workdir = tmp_path / "run"
    shutil.copytree(finished_run, workdir)
    with open(workdir / "metrics.jsonl", "a") as f:   # steps 5-6 of an attempt killed before saving
        f.write(json.dumps({"step": 5, "loss": 99.0}) + "\n" + json.dumps({"step": 6, "loss": 99.0}) + "\n")
        f.write('{"step": 6, "eval_lo')
    with caplog.at_level(logging.WARNING):
        summary = train_and_evaluate(make_config(cache, **{"train.steps": 6}), workdir)
    assert not [r.getMessage() for r in caplog.records if "could not be restored" in r.getMessage()]
    assert summary["start_step"] == 4 and summary["final_step"] == 6 and summary["final_loss"] is not None
    rows = read_metrics(workdir)
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in rows if "eval_loss" in r] == [4, 6]
    assert all(r.get("loss") != 99.0 for r in rows)
    assert json.loads((workdir / "summary.json").read_text())["final_step"] == 6


def test_rbg_dropout_keys_resume_exactly(finished_run, cache, tmp_path):
    """train.dropout_rng_impl=rbg: a run stopped at its step-4 checkpoint and extended to 6
    (one 6-step schedule throughout) ends with the parameters of a straight 6-step run, and
    its dropout masks are not threefry's."""
    rbg = {"train.dropout_rng_impl": "rbg", "train.decay_steps": 6}
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train_and_evaluate(make_config(cache, **rbg, **{"train.steps": 6}), straight)
    train_and_evaluate(make_config(cache, **rbg, **{"train.steps": 4}), resumed)
    summary = train_and_evaluate(make_config(cache, **rbg, **{"train.steps": 6}), resumed)
    assert summary["start_step"] == 4 and summary["final_step"] == 6
    (ref_step, ref), (step, got) = latest_params(straight), latest_params(resumed)
    assert ref_step == step == 6
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(got)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    first_loss = lambda workdir: next(r["loss"] for r in read_metrics(workdir) if "loss" in r)  # noqa: E731
    assert first_loss(straight) != first_loss(finished_run)   # same parameters, other masks


def test_nan_before_the_first_checkpoint_says_so_on_one_line(tmp_path, cache):
    with pytest.raises(TrainingDiverged) as error:
        train_and_evaluate(make_config(cache, **{"train.debug_nan_step": 3, "train.steps": 4}), tmp_path / "run")
    assert str(error.value) == ("training diverged at step 3: non-finite training loss nan; stopping. "
                                "No checkpoint was saved before it; a new run starts from step 0")


@pytest.mark.slow
def test_finite_divergence_stops_on_one_line_and_keeps_the_last_good_checkpoint(tmp_path, cache, caplog):
    """A finished 8-step run resumed with a learning rate 1e6 times larger: the loss stays
    finite but explodes. The resume says the learning rate changed, the guard stops it on
    one `error:` line naming the step and the last good checkpoint (8), later checkpoints
    are moved aside so the same workdir resumes from 8, and the resumed run's summary
    keeps the run's first loss and compares its settings with the checkpoint's (not with
    those of the diverged attempt)."""
    workdir = tmp_path / "run"
    train_and_evaluate(make_config(cache, **{"train.steps": 8}), workdir)
    first_loss = next(r["loss"] for r in read_metrics(workdir) if "loss" in r)
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax_cache")}
    proc = subprocess.run(cli(workdir, cache, **{"train.steps": 16, "train.learning_rate": 1000.0,
                                                  "train.checkpoint_every": 1}),
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=patient(600))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "resuming from step 8 with changed optimizer settings: train.learning_rate 0.001 -> 1000.0" in proc.stderr
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith("error: training diverged at step "), error
    assert f"The last good checkpoint is step 8 in {workdir}/checkpoints" in error
    assert "train.divergence_factor=0 turns this check off" in error
    stopped = int(error.split("at step ")[1].split(":")[0])
    assert 10 <= stopped <= 13   # three logged steps after the first exploded one
    assert latest_params(workdir)[0] == 8
    assert all(int(p.name) > 8 for p in (workdir / "diverged_checkpoints").iterdir())

    with caplog.at_level(logging.WARNING, logger="roformer.train"):
        summary = train_and_evaluate(make_config(cache, **{"train.steps": 10}), workdir)
    changed = [r.getMessage() for r in caplog.records if "changed optimizer settings" in r.getMessage()]
    assert changed == ["resuming from step 8 with changed optimizer settings: learning-rate schedule length "
                       "8 -> 10 steps (train.decay_steps keeps it)"]
    assert summary["start_step"] == 8 and summary["final_step"] == 10
    assert summary["first_loss"] == first_loss    # the run's, not the resumed attempt's


def test_retention_keeps_the_best_checkpoint_by_held_out_loss(tmp_path):
    """keep_checkpoints=2 keeps the two newest checkpoints and the one with the lowest held-out
    loss, however old; checkpoints saved without an evaluation never count as the best."""
    checkpointer = Checkpointer(tmp_path / "checkpoints", max_to_keep=2)
    state = {"w": jax.numpy.ones(4)}
    for step, loss in [(1, None), (2, 1.0), (3, None), (4, 3.0), (5, 1e9), (6, None), (7, None)]:
        checkpointer.save(step, state, {}, {}, metrics=None if loss is None else {"eval_loss": loss},
                          optimizer={"learning_rate": step / 10})
        checkpointer.wait()
    assert checkpointer.best_step() == 2
    assert checkpointer.saved_optimizer(7) == {"learning_rate": 0.7}   # what a resume compares with
    checkpointer.close()
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir()) == [2, 6, 7]


@pytest.mark.parametrize("nearly_full", [False, True])
def test_full_disk_stops_at_the_failing_save_on_one_line(tmp_path, cache, monkeypatch, caplog, nearly_full):
    """The array writes of the step-8 checkpoint fail with ENOSPC: the run stops with one
    CheckpointSaveFailed naming step 8, at that save (nearly full disk: the save is waited
    for) or as soon as the background write has failed; orbax's own tracebacks are not
    echoed, step 4 stays and no partial step-8 directory is left."""
    from orbax.checkpoint._src.serialization import serialization

    real_write = serialization.async_serialize_from_host

    async def full_disk(rslices, tensorstore_spec, **kwargs):
        if "/8.orbax-checkpoint-tmp" in json.dumps(tensorstore_spec, default=str):
            raise OSError(errno.ENOSPC, "No space left on device")
        return await real_write(rslices, tensorstore_spec, **kwargs)

    monkeypatch.setattr(serialization, "async_serialize_from_host", full_disk)
    if nearly_full:
        real_usage = shutil.disk_usage
        monkeypatch.setattr(shutil, "disk_usage", lambda path: real_usage(path)._replace(free=100_000))
    workdir = tmp_path / "run"
    with caplog.at_level(logging.INFO), pytest.raises(CheckpointSaveFailed) as error:
        train_and_evaluate(make_config(cache, **{"train.steps": 16, "train.keep_checkpoints": 5}), workdir)
    message = str(error.value)
    assert message.startswith(f"could not save the checkpoint at step 8 in {workdir}/checkpoints: "
                              "no space left on device (it needs about "), message
    assert message.endswith("The last good checkpoint is step 4; free some space and run the same command "
                            "again to resume from it")
    assert "\n" not in message and isinstance(error.value, OSError)
    stopped = max(r["step"] for r in read_metrics(workdir) if "loss" in r)
    # nearly full: at the failing save; else at the first log row that finds it failed, at the
    # latest when the next save (step 12) waits for it
    assert (stopped == 8) if nearly_full else (8 <= stopped <= 12), stopped
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["4"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR and "orbax" in r.pathname]


def test_a_full_disk_mid_save_ends_on_the_projects_line_alone_and_leaves_no_partial_save(
        tmp_path, cache, monkeypatch, caplog):
    """The final save (step 8) meets a full disk: its first array write fails at once, the
    others end later (what orbax's writer threads do on a real full disk: they report their
    own errors, and write into the save's temporary directory, after the save has failed),
    and closing the metrics meets the full disk too. The run ends on the project's one line,
    not on the metrics' error; orbax's and asyncio's echoes of the abandoned writes are not
    shown; no 8.orbax-checkpoint-tmp is left. A temporary directory left by a run killed
    mid-save is removed when the next run opens the checkpoints."""
    import asyncio

    from orbax.checkpoint._src.serialization import serialization

    from roformer.train import metrics as metrics_lib

    real_write, writes = serialization.async_serialize_from_host, []
    workdir = tmp_path / "run"

    async def full_disk(rslices, tensorstore_spec, **kwargs):
        if "/8.orbax-checkpoint-tmp" in json.dumps(tensorstore_spec, default=str):
            writes.append(tensorstore_spec)
            if len(writes) > 1:   # a write still going when the first failed
                await asyncio.sleep(0.3)
                late = workdir / "checkpoints" / "8.orbax-checkpoint-tmp" / "state.orbax-checkpoint-tmp"
                late.mkdir(parents=True, exist_ok=True)
                (late / f"late{len(writes)}").write_bytes(b"x")
            raise OSError(errno.ENOSPC, "No space left on device")
        return await real_write(rslices, tensorstore_spec, **kwargs)

    real_close = metrics_lib.MetricsWriter.close

    def close_on_a_full_disk(self):
        real_close(self)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(serialization, "async_serialize_from_host", full_disk)
    monkeypatch.setattr(metrics_lib.MetricsWriter, "close", close_on_a_full_disk)
    real_usage = shutil.disk_usage   # nearly full: the save is waited for, its failure met at once
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real_usage(path)._replace(free=100_000))
    with caplog.at_level(logging.INFO), pytest.raises(CheckpointSaveFailed) as error:
        train_and_evaluate(make_config(cache, **{"train.steps": 8, "train.keep_checkpoints": 5}), workdir)
    time.sleep(1.0)   # the abandoned writes have ended
    import gc
    gc.collect()      # asyncio reports a never-retrieved error when its future is collected
    assert str(error.value).startswith(f"could not save the checkpoint at step 8 in {workdir}/checkpoints: "
                                       "no space left on device"), str(error.value)
    assert len(writes) > 1
    echoes = [r for r in caplog.records if r.levelno >= logging.ERROR
              and ("orbax" in r.pathname or "never retrieved" in r.getMessage())]
    assert not echoes, [r.getMessage()[:300] for r in echoes]
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["4"]
    monkeypatch.undo()
    left = workdir / "checkpoints" / "12.orbax-checkpoint-tmp" / "state"   # a run killed mid-save
    left.mkdir(parents=True)
    summary = train_and_evaluate(make_config(cache, **{"train.steps": 8, "train.keep_checkpoints": 5}), workdir)
    assert summary["start_step"] == 4 and summary["final_step"] == 8
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["4", "8"]


def test_a_run_on_a_trained_vocabulary_resumes_after_its_corpus_files_are_touched(tmp_path, monkeypatch):
    """With data.vocab empty the tokenizer is trained on the corpus and cached under a key of
    the files' paths and times: a copied or touched corpus gets a new cache entry, and training
    is not deterministic, so a resume that trained again would hold another tokenizer and be
    refused. The resume takes the run's own tokenizer (workdir/tokenizer.json) instead."""
    import random

    rng = random.Random(1)
    words = [f"w{i}" for i in range(300)]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(20, 80)))
                                  for _ in range(120)) + "\n")
    workdir, cache = tmp_path / "run", tmp_path / "cache"
    data = {"data.source": "files", "data.files": str(corpus), "data.vocab": "", "data.vocab_size": 400,
            "data.heldout_fraction": 0.1}
    first = train_and_evaluate(make_config(cache, **data, **{"train.steps": 4}), workdir)
    assert first["final_step"] == 4
    os.utime(corpus, ns=(1, 1))   # the same bytes, another time
    resumed = train_and_evaluate(make_config(cache, **data, **{"train.steps": 6}), workdir)
    assert resumed["start_step"] == 4 and resumed["final_step"] == 6
    # The devices it ran on (mesh.num_devices=1 of the 8 this process has), which MFU divides by.
    assert resumed["num_devices"] == 1 < jax.device_count()
    # Processes that trained their own tokenizers (each in a cache of its own) are refused.
    from roformer.errors import ConfigError
    from roformer.train import bookkeeping
    from roformer.train.config import TrainConfig

    config = make_config(cache, **data)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(bookkeeping, "allgather_json", lambda value: [value, "another"])
    with pytest.raises(ConfigError, match="the 2 processes hold 2 different tokenizers"):
        bookkeeping.run_data(config.data, TrainConfig.from_section(config.train), workdir=workdir)
