"""Reading a run's results back (roformer.ablation.collect): metrics.jsonl into final
metrics, the held-out curve and throughput."""
import jax

from roformer import machine
from roformer.ablation import collect
from roformer.machine import cpu_identity, describe_cpu
from roformer.train.metrics import read_metrics


def test_metrics_readers_take_the_last_row_of_a_resumed_step():
    rows = [{"step": 10, "loss": 5.0, "mlm_accuracy": 0.1, "tokens_per_sec": 50.0},
            {"step": 20, "loss": 4.0, "mlm_accuracy": 0.2, "tokens_per_sec": 100.0},
            {"step": 20, "eval_loss": 4.6, "eval_mlm_accuracy": 0.1, "eval_order_gap": 0.1},
            {"step": 20, "eval_loss": 4.5, "eval_mlm_accuracy": 0.15, "eval_shuffled_loss": 4.7,
             "eval_order_gap": 0.2},                                                          # resumed run re-logs 20
            {"step": 20, "loss": 3.9, "mlm_accuracy": 0.21, "tokens_per_sec": 110.0}]
    summary = collect.pretrain_summary(rows)
    assert summary["train_loss"] == 3.9 and summary["eval_loss"] == 4.5 and summary["steps"] == 20
    assert summary["eval_shuffled_loss"] == 4.7 and summary["eval_order_gap"] == 0.2
    assert summary["tokens_per_sec"] == 105.0   # first (compiling) interval left out
    assert collect.loss_curves(rows) == {"train": [(10, 5.0), (20, 3.9)], "eval": [(20, 4.5)]}
    assert collect.eval_curve(rows, tokens_per_step=100) == [
        {"step": 20, "tokens": 2000, "eval_loss": 4.5, "eval_mlm_accuracy": 0.15, "eval_order_gap": 0.2}]


def test_read_metrics_ignores_a_torn_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    assert read_metrics(path) == [{"step": 1, "loss": 2.0}]
    assert read_metrics(tmp_path / "missing.jsonl") == []


def test_the_reports_machine_line_names_the_processor():
    line = collect._machine()
    assert line.startswith(f"{jax.device_count()} x ") and f"{machine.cores_available()} CPU cores" in line
    identity = cpu_identity()
    if identity:   # Linux: model, family and vector extensions, which set a CPU run's speed
        assert f"({describe_cpu(identity)})" in line
