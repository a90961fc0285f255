"""One metrics writer, several backends (roformer.train.metrics): every row reaches each
backend; W&B, where asked for, keeps its run id in the workdir so a resumed run continues
its W&B run (tested offline where wandb is installed)."""
import sys

import numpy as np
import pytest

from roformer.errors import ConfigError
from roformer.train import metrics
from roformer.train.metrics import MetricsWriter

pytestmark = pytest.mark.fast   # the fast lane (docs/testing.md)


class Recorder:
    def __init__(self):
        self.rows, self.closed = [], False

    def write(self, step, row, section):
        self.rows.append((step, dict(row), section))

    def close(self):
        self.closed = True


def test_every_row_reaches_every_backend(tmp_path):
    made = []

    def backends(workdir, *, resume_step=None):
        made.append((workdir, resume_step))
        return [Recorder(), Recorder()]

    writer = MetricsWriter(tmp_path, enabled=True, resume_step=7, backends=backends)
    writer.write(8, {"loss": np.float32(2.5)})
    writer.write(8, {"eval_loss": float("nan")}, section="eval")
    writer.close()
    assert made == [(tmp_path, 7)]
    for backend in writer._backends:
        assert backend.rows == [(8, {"loss": 2.5}, "train"), (8, {"eval_loss": "nan"}, "eval")] and backend.closed
    MetricsWriter(tmp_path, enabled=False, backends=lambda *a, **k: pytest.fail("made on process > 0"))


def test_the_default_backends_are_jsonl_and_tensorboard_and_wandb_only_when_asked(tmp_path, monkeypatch):
    monkeypatch.delenv(metrics.WANDB_PROJECT_ENV, raising=False)
    backends = metrics.default_backends(tmp_path)
    assert [type(b) for b in backends] == [metrics.JsonlBackend, metrics.TensorBoardBackend]
    for backend in backends:
        backend.close()
    monkeypatch.setenv(metrics.WANDB_PROJECT_ENV, "roformer-test")
    monkeypatch.setitem(sys.modules, "wandb", None)   # not installed
    with pytest.raises(ConfigError, match=r"ROFORMER_WANDB_PROJECT=roformer-test: .* needs the wandb package"):
        metrics.WandbBackend(tmp_path, "roformer-test")


def test_wandb_offline_run_continues_after_a_resume(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv(metrics.WANDB_PROJECT_ENV, "roformer-test")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "config.json").write_text('{"train": {"steps": 4}}')
    for start, steps in ((None, (1, 2)), (2, (3, 4))):   # a run, then its resumption
        writer = MetricsWriter(tmp_path, enabled=True, resume_step=start)
        for step in steps:
            writer.write(step, {"loss": 5.0 - step})
        writer.close()
    run_id = (tmp_path / metrics.WandbBackend.RUN_ID_FILE).read_text().strip()
    runs = sorted(p.name for p in (tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(name.endswith(f"-{run_id}") for name in runs), runs
    assert [r["step"] for r in metrics.read_metrics(tmp_path)] == [1, 2, 3, 4]
