"""One run writer for pretraining and GLUE (roformer.train.metrics.MetricsWriter): TensorBoard
tags under `train/` and `eval/` (metrics.jsonl keys unchanged), no `step` chart, the resolved
config as text and hparams; GLUE's rows go through it too, W&B included."""
import json
import sys
import types

import pytest

from roformer.train.metrics import MetricsWriter, read_metrics

pytestmark = pytest.mark.fast   # the fast lane (docs/testing.md)

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def events(logdir):
    return event_accumulator.EventAccumulator(str(logdir), size_guidance={"tensors": 0}).Reload()


def scalars(logdir) -> dict:
    loaded = events(logdir)
    return {tag: [(e.step, e.value) for e in loaded.Scalars(tag)] for tag in loaded.Tags()["scalars"]}


def config_text(logdir) -> dict:
    loaded = events(logdir)
    text = loaded.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    return json.loads("\n".join(line[4:] for line in text.splitlines()))   # a markdown code block


def test_pretraining_tags_are_train_and_eval_and_the_config_is_recorded(tmp_path):
    config = {"train": {"steps": 4, "learning_rate": 1e-3, "phases": ""}, "model": {"position": "rope", "size": None}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    writer = MetricsWriter(tmp_path, enabled=True)
    writer.write(2, {"loss": 2.5, "step": 2, "phase": 0})
    writer.write(2, {"eval_loss": 3.0}, section="eval")
    writer.close()
    assert scalars(tmp_path / "tensorboard") == {"train/loss": [(2, 2.5)], "train/phase": [(2, 0.0)],
                                                 "eval/eval_loss": [(2, 3.0)]}   # no step chart
    assert read_metrics(tmp_path) == [{"step": 2, "loss": 2.5, "phase": 0}, {"step": 2, "eval_loss": 3.0}]
    assert config_text(tmp_path / "tensorboard") == config
    assert "_hparams_/session_start_info" in events(tmp_path / "tensorboard").PluginTagToContent("hparams")
    with pytest.raises(ValueError, match="section 'test'"):
        MetricsWriter(tmp_path / "other", enabled=False).write(1, {}, section="test")


class FakeWandb(types.ModuleType):
    """wandb's init/log/finish, recorded (the real package is optional and talks to a server)."""

    def __init__(self):
        super().__init__("wandb")
        self.runs = []

    def init(self, **kwargs):
        run = types.SimpleNamespace(kwargs=kwargs, logged=[], finished=False)
        run.log = lambda row, step: run.logged.append((step, row))
        run.finish = lambda: setattr(run, "finished", True)
        self.runs.append(run)
        return run


def test_glue_logs_through_the_run_writer_tensorboard_and_wandb(tmp_path, monkeypatch):
    from roformer.glue.run import RunLog

    wandb = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.setenv("ROFORMER_WANDB_PROJECT", "glue-test")
    run_config = {"config": {"task": "mrpc", "learning_rate": 2e-5}}
    log = RunLog(tmp_path, run_config)
    for seed in (0, 1):
        for step in (1, 2):
            log.write("mrpc", seed, step, {"step": step, "loss": 1.0 / step, "learning_rate": 0.5})
        log.write("mrpc", seed, 2, {"validation_accuracy": 0.5 + seed, "validation_f1": 0.25}, section="eval")
    log.close()
    rows = read_metrics(tmp_path)   # the keys readers know: task, seed, step, the scalars unprefixed
    assert rows[0] == {"task": "mrpc", "seed": 0, "step": 1, "loss": 1.0, "learning_rate": 0.5}
    assert rows[2] == {"task": "mrpc", "seed": 0, "step": 2, "validation_accuracy": 0.5, "validation_f1": 0.25}
    assert len(rows) == 6
    charts = scalars(tmp_path / "tensorboard" / "mrpc_seed1")
    assert charts == {"train/loss": [(1, 1.0), (2, 0.5)], "train/learning_rate": [(1, 0.5), (2, 0.5)],
                      "eval/validation_accuracy": [(2, 1.5)], "eval/validation_f1": [(2, 0.25)]}
    assert config_text(tmp_path / "tensorboard" / "mrpc_seed0") == run_config
    assert [r.kwargs["name"] for r in wandb.runs] == [f"{tmp_path.name}/mrpc_seed0", f"{tmp_path.name}/mrpc_seed1"]
    assert all(r.kwargs["project"] == "glue-test" and r.kwargs["group"] == tmp_path.name and r.finished
               for r in wandb.runs)
    assert wandb.runs[1].logged == [(1, {"train/loss": 1.0, "train/learning_rate": 0.5}),
                                    (2, {"train/loss": 0.5, "train/learning_rate": 0.5}),
                                    (2, {"eval/validation_accuracy": 1.5, "eval/validation_f1": 0.25})]
