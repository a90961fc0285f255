"""train.profile_steps (roformer.train.profiling): a window of a real run's steps traced into
tensorboard/plugins/profile, where TensorBoard's profile plugin reads it; a malformed window
refused in one line; a setting that only watches the run, so no fingerprint moves with it."""
import pytest

from helpers import MICRO_MODEL, tiny_run_config
from roformer.errors import ConfigError
from roformer.train import read_metrics, train_and_evaluate
from roformer.train.config import TrainConfig
from roformer.train.profiling import StepProfiler, parse_profile_steps

OVERRIDES = {
    **MICRO_MODEL,
    "train.steps": 4, "train.batch_size": 4, "train.seq_len": 32, "train.warmup_steps": 1,
    "train.log_every": 2, "train.eval_every": 1000, "train.eval_batches": 1, "train.eval_attention_stats": False,
    "train.checkpoint_every": 1000, "train.progress_bar": False, "train.async_checkpoints": False,
    "mesh.num_devices": 1,
}


def test_a_window_of_a_real_run_is_traced_where_tensorboard_reads_it(tmp_path):
    workdir = tmp_path / "run"
    train_and_evaluate(tiny_run_config(tmp_path / "cache", OVERRIDES, **{"train.profile_steps": "2:3"}), workdir)
    traces = list((workdir / "tensorboard" / "plugins" / "profile").glob("*/*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0
    assert [r["step"] for r in read_metrics(workdir) if "loss" in r] == [2, 4]   # the run went on after it


@pytest.mark.parametrize("text", ["2", "3:2", "0:1", "a:b", "1:2:3", "-1:2", 5])
def test_a_malformed_window_is_refused_in_one_line(text):
    with pytest.raises(ConfigError, match=r"train.profile_steps=.* 'first:last' step numbers") as error:
        TrainConfig(profile_steps=text)
    assert "\n" not in str(error.value)


def test_the_window_starts_at_its_first_step_the_run_reaches_and_stops_after_its_last(tmp_path, monkeypatch):
    import jax

    calls = []
    monkeypatch.setattr(jax.profiler, "start_trace", lambda logdir: calls.append(("start", logdir)))
    monkeypatch.setattr(jax.profiler, "stop_trace", lambda: calls.append(("stop",)))
    assert parse_profile_steps("") is None and parse_profile_steps(" 100:105 ") == (100, 105)
    with StepProfiler("3:5", tmp_path, enabled=True) as profiler:   # a run resumed at step 3 ...
        for step in range(4, 9):
            profiler.before(step)
            calls.append(step)
            profiler.after(step, None)
    assert calls == [("start", str(tmp_path)), 4, 5, ("stop",), 6, 7, 8]
    calls.clear()
    with StepProfiler("1:5", tmp_path, enabled=True) as profiler:   # ... and one stopped inside the window
        profiler.before(1)
    assert calls == [("start", str(tmp_path)), ("stop",)]
    calls.clear()
    with StepProfiler("1:5", tmp_path, enabled=False) as profiler:   # processes other than 0
        profiler.before(1)
        profiler.after(5, None)
    assert calls == []
