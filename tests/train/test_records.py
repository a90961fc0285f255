"""Records that cannot lie: a GLUE rerun replaces what its killed attempt logged, and MFU on
a CPU (whose peak nothing here times alongside the steps) is not reported, nor ever above 1."""
import json

import pytest

from roformer.train import flops
from roformer.train.metrics import ThroughputTimer, read_metrics

pytestmark = pytest.mark.fast   # the fast lane (docs/testing.md)


def test_a_glue_rerun_replaces_its_killed_attempts_rows_and_events(tmp_path):
    """GLUE trains every task from scratch in every run: the rows and TensorBoard runs a killed
    attempt logged for a task go when the rerun logs that task's first row (other tasks' rows stay)."""
    from roformer.glue.run import RunLog

    def attempt(loss: float, steps: int, close: bool = True) -> RunLog:
        log = RunLog(tmp_path, {"config": {"task": "wnli"}})
        for seed in (0, 1):
            for step in range(1, steps + 1):
                log.write("wnli", seed, step, {"loss": loss})
        if close:
            log.close()
        return log

    other = {"task": "mrpc", "seed": 0, "step": 1, "loss": 0.5}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(other) + "\n")
    attempt(99.0, 4, close=False)   # killed: 8 rows, a torn line, open event files
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"task": "wnli", "se')
    attempt(1.0, 3)
    rows = read_metrics(tmp_path)
    assert rows[0] == other and len(rows) == 1 + 2 * 3
    assert all(row["loss"] == 1.0 for row in rows[1:])
    for seed in (0, 1):
        assert len(list((tmp_path / "tensorboard" / f"wnli_seed{seed}").iterdir())) == 1


class Cpu:
    device_kind = "cpu"
    platform = "cpu"


def test_mfu_is_not_reported_against_an_untimed_cpu_peak_and_never_above_one():
    # A CPU has no table peak: a matmul timed once at start-up is no measure of the steps'
    # share of a machine whose load changes, so MFU is left out unless a peak is given.
    assert flops.device_peak_flops(Cpu(), "float32") is None
    assert flops.device_peak_flops(Cpu(), "float32", configured=2e11) == 2e11
    clock = iter([0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0]).__next__
    timer = ThroughputTimer(tokens_per_step=10, flops_per_step=1e9, peak_flops=None, num_devices=1, clock=clock)
    timer.step({})
    timer.step({})
    assert timer.read() == pytest.approx({"tokens_per_sec": 10.0})
    # A given peak that the steps beat is wrong: such a reading is dropped, not reported above 1.
    timer = ThroughputTimer(tokens_per_step=10, flops_per_step=1e9, peak_flops=1e8, num_devices=1, clock=clock)
    timer.step({})
    timer.step({})
    row = timer.read()
    assert "mfu" not in row and row["tokens_per_sec"] > 0
    assert timer.medians()["mfu"] is None
