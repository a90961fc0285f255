"""roformer.train.metrics: the throughput timer, and the metrics writer's JSONL and TensorBoard
files."""
import json
import logging
import re
import tomllib
from pathlib import Path

import jax
import numpy as np
import pytest

from roformer.train import read_metrics
from roformer.train.metrics import MetricsWriter, ThroughputTimer

pytestmark = pytest.mark.fast   # the fast lane (docs/testing.md)



def test_throughput_timer_leaves_out_the_compiling_step_and_paused_time():
    now = [0.0]
    timer = ThroughputTimer(tokens_per_step=100, peak_flops=1e3, num_devices=2, flops_per_step=60.0,
                            clock=lambda: now[0])
    assert timer.read() == {}                    # nothing timed yet
    now[0] = 5.0
    timer.step({})                               # the compiling first step only starts the clock (t=5)
    now[0] = 10.0
    timer.step({})
    timer.step({})
    with timer.paused():                         # an evaluation: 4 s left out
        now[0] = 14.0
    now[0] = 17.0
    assert timer.read() == pytest.approx({"tokens_per_sec": 2 * 100 / 8, "mfu": 60 * 2 / 8 / (1e3 * 2)})
    now[0] = 19.0
    timer.step({})
    assert timer.read() == pytest.approx({"tokens_per_sec": 50.0, "mfu": 60 / 2 / 2e3})
    assert timer.medians() == pytest.approx({"tokens_per_sec": (25 + 50) / 2, "mfu": (7.5e-3 + 1.5e-2) / 2})
    assert ThroughputTimer(tokens_per_step=1, flops_per_step=1, peak_flops=1, num_devices=1).medians() == \
        {"tokens_per_sec": None, "mfu": None}


def test_a_pause_waits_for_the_steps_still_running_before_its_clock_starts(monkeypatch):
    """An evaluation between two logged rows first waits for the train steps the device is
    still running: that wait is training time, not the pause's (it was counted as pause, so
    tokens/s came out high whenever eval_every was not a multiple of log_every)."""

    now = [0.0]
    timer = ThroughputTimer(tokens_per_step=100, peak_flops=None, num_devices=1, flops_per_step=1.0,
                            clock=lambda: now[0])
    timer.step({})                               # compiled; the clock starts at 0
    timer.step({})
    timer.step({})                               # dispatched at once; the device runs them ...
    monkeypatch.setattr(jax, "block_until_ready", lambda x: now.__setitem__(0, now[0] + 6.0) or x)
    with timer.paused(ready=object()):           # ... for 6 s, then the evaluation takes 4
        now[0] += 4.0
    assert timer.read()["tokens_per_sec"] == pytest.approx(2 * 100 / 6)


def test_a_timer_restarted_for_a_new_program_leaves_out_its_compiling_step():
    now = [0.0]
    timer = ThroughputTimer(tokens_per_step=100, peak_flops=None, num_devices=1, flops_per_step=1.0,
                            clock=lambda: now[0])
    timer.step({})
    now[0] = 1.0
    timer.step({})
    timer.restart()                              # the next step compiles another program ...
    now[0] = 31.0
    timer.step({})                               # ... for 30 s: it only starts the clock
    now[0] = 32.0
    timer.step({})
    timer.step({})
    assert timer.read()["tokens_per_sec"] == pytest.approx(2 * 100 / 1.0)


def test_metrics_writer_jsonl_and_tensorboard(tmp_path):
    writer = MetricsWriter(tmp_path, enabled=True)
    writer.write(1, {"loss": np.float32(2.5), "mfu": 0.1})
    writer.write(1, {"eval_loss": float("nan")})
    writer.close()
    assert read_metrics(tmp_path) == [{"step": 1, "loss": 2.5, "mfu": 0.1}, {"step": 1, "eval_loss": "nan"}]
    assert list((tmp_path / "tensorboard").glob("events*"))
    silent = MetricsWriter(tmp_path / "other", enabled=False)   # processes > 0
    silent.write(1, {"loss": 1.0})
    assert not (tmp_path / "other").exists()


def test_tensorboard_is_a_dependency_and_reads_the_event_files(tmp_path):
    """The README's `tensorboard --logdir` needs the tensorboard package (tensorboardX only
    writes the events), so the project depends on it; and it reads what MetricsWriter writes."""
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    names = {re.match(r"[A-Za-z0-9_.-]+", dep).group().lower() for dep in pyproject["project"]["dependencies"]}
    assert "tensorboard" in names
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    writer = MetricsWriter(tmp_path, enabled=True)
    writer.write(3, {"loss": 2.5})
    writer.close()
    events = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard")).Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(3, 2.5)]


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
