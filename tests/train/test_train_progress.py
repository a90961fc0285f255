"""What a training run shows while it runs (roformer.train.progress): a bar on a terminal,
plain lines with the rate and time left elsewhere, a notice around a step's first call
(its compilation), and the summary as one short line."""
import io
import logging

import pytest
from tqdm.auto import tqdm

from roformer.train import progress

pytestmark = pytest.mark.fast   # the fast lane (docs/testing.md)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_bar_only_on_a_terminal():
    assert isinstance(progress.progress_bar(total=10, desc="pretrain", stream=Terminal()), tqdm)
    assert isinstance(progress.progress_bar(total=10, desc="pretrain", stream=io.StringIO()), progress.PlainProgress)
    off = progress.progress_bar(total=10, desc="pretrain", enabled=False, stream=Terminal())
    assert isinstance(off, tqdm) and off.disable


def test_plain_lines_every_period_with_rate_time_left_and_postfix(caplog):
    clock = Clock()
    bar = progress.PlainProgress(total=1000, initial=100, desc="pretrain", every_s=30.0, clock=clock)
    with caplog.at_level(logging.INFO, logger="roformer.train"):
        for _ in range(100):         # 100 steps in 25 s: no line yet
            clock.now += 0.25
            bar.update(1)
        assert caplog.messages == []
        bar.set_postfix(loss="5.123", acc="0.210")
        for _ in range(60):          # at 30 s: one line
            clock.now += 0.25
            bar.update(1)
        bar.close()
        bar.close()                  # once
    assert caplog.messages == [
        "pretrain: step 220 of 1,000 (22%), 4 steps/s, 3m15s left, loss 5.123, acc 0.210",
        "pretrain: step 260 of 1,000 (26%), 4 steps/s, 3m05s left, loss 5.123, acc 0.210"]
    assert all("\r" not in m for m in caplog.messages)


def test_a_steps_first_call_is_announced_with_its_time(caplog):
    calls = []

    def step(x):
        calls.append(x)
        return x + 1

    step.lower = "the function's own attribute"
    wrapped = progress.announce_compile(step, "the train step")
    with caplog.at_level(logging.INFO, logger="roformer.train"):
        assert [wrapped(1), wrapped(2), wrapped(3)] == [2, 3, 4]
    assert calls == [1, 2, 3] and wrapped.lower == "the function's own attribute"
    assert caplog.messages[0] == "compiling the train step ..."
    assert caplog.messages[1].startswith("compiled the train step in ") and len(caplog.messages) == 2
    assert progress.announce_compile(step, "x", enabled=False) is step


@pytest.mark.parametrize("seconds, text", [(4.4, "4s"), (125, "2m05s"), (7620, "2h07m")])
def test_duration(seconds, text):
    assert progress.duration(seconds) == text


def test_the_summary_is_one_short_line():
    summary = {"workdir": "runs/tiny", "final_step": 250, "start_step": 0, "preempted": False,
               "first_loss": 8.31, "final_loss": 5.2049, "eval_loss": 5.3114, "eval_mlm_accuracy": 0.2312,
               "eval_perplexity": 202.6, "eval_order_gap": 0.4123, "tokens_per_sec": 20061.3, "mfu": None,
               "wall_time_s": 131.2, "num_devices": 1, "num_processes": 1, "data": {"files": ["a"] * 100}}
    line = progress.summary_line(summary)
    assert line == ("summary: 250 steps; train loss 8.310 -> 5.205; held-out loss 5.311, accuracy 23.1%, "
                    "order gap +0.412; 20,061 tokens/s; 2m11s (all of it in runs/tiny/summary.json)")
    resumed = progress.summary_line({"final_step": 80, "start_step": 50, "preempted": True})
    assert resumed == "summary: steps 50-80 (stopped: SIGTERM or Ctrl-C)"   # written before runs said which
    ctrl_c = progress.summary_line({"final_step": 80, "start_step": 50, "preempted": True, "stop_signal": "SIGINT"})
    assert ctrl_c == "summary: steps 50-80 (stopped: SIGINT)"


def test_the_rate_leaves_out_the_first_step_and_its_compilation(caplog):
    clock = Clock()
    bar = progress.PlainProgress(total=100, desc="pretrain", every_s=1000.0, clock=clock)
    clock.now = 60.0          # the first step: compiling
    bar.update(1)
    for _ in range(10):       # then one step a second
        clock.now += 1.0
        bar.update(1)
    with caplog.at_level(logging.INFO, logger="roformer.train"):
        bar.close()
    assert caplog.messages == ["pretrain: step 11 of 100 (11%), 1 steps/s, 1m29s left"]


def test_a_ctrl_c_stop_is_labelled_sigint():
    from roformer.pretrain import next_steps
    from roformer.train.progress import summary_line

    summary = {"final_step": 7, "start_step": 0, "preempted": True, "stop_signal": "SIGINT"}
    assert summary_line(summary) == "summary: 7 steps (stopped: SIGINT)"
    assert next_steps(summary, "runs/x").startswith("stopped at step 7 (SIGINT); run the same command again")
