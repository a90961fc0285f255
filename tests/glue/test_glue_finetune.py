"""GLUE fine-tuning as an accelerator runs it: the unit-rate AdamW equals optax.adamw on the
same schedule, every program is compiled before training, a model that cannot predict fails
before it trains, prediction on a cuDNN model takes a layout the kernel accepts, and a task
that fails keeps the other tasks' results."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from roformer.configs import glue as glue_config
from roformer.glue import finetune as finetune_lib
from roformer.glue import run as glue_run
from roformer.train.optim import decay_mask

from helpers import LEGACY_FUSION_EMITTERS, cudnn_layout_errors
from helpers.glue import tiny_config


def test_unit_rate_adamw_times_the_schedule_is_optax_adamw():
    params = {"kernel": jnp.arange(6.0).reshape(2, 3) / 7, "bias": jnp.ones(3)}
    schedule = optax.linear_schedule(1e-2, 1e-3, 5)
    reference = optax.chain(optax.clip_by_global_norm(0.5),
                            optax.adamw(schedule, b1=0.9, b2=0.98, eps=1e-6, weight_decay=0.1, mask=decay_mask))
    ours = finetune_lib.unit_rate_adamw(0.9, 0.98, 1e-6, 0.1, 0.5)
    p_ref, s_ref, p_ours, s_ours = params, reference.init(params), params, ours.init(params)
    for step in range(4):
        grads = jax.tree.map(lambda p, step=step: jnp.sin(p * (step + 1)), p_ref)
        updates, s_ref = reference.update(grads, s_ref, p_ref)
        p_ref = optax.apply_updates(p_ref, updates)
        updates, s_ours = ours.update(grads, s_ours, p_ours)
        p_ours = optax.apply_updates(p_ours, jax.tree.map(lambda u, step=step: schedule(step) * u, updates))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), p_ref, p_ours)


@pytest.fixture(scope="module")
def vocab(shared_data):
    return str(shared_data / "vocab" / "bert-base-uncased-vocab.txt")


def test_every_program_is_compiled_before_the_first_step_and_predicting_is_tried_first(
        shared_data, vocab, tmp_path, monkeypatch):
    events = []
    prepare, finetune, predict = finetune_lib.Programs.prepare, glue_run.finetune, glue_run.predict

    def recorded_prepare(self, train_shapes, predict_shapes, **kw):
        seconds = prepare(self, train_shapes, predict_shapes, **kw)
        events.append(("compile", seconds > 0))
        return seconds

    monkeypatch.setattr(finetune_lib.Programs, "prepare", recorded_prepare)
    monkeypatch.setattr(glue_run, "finetune", lambda *a, **kw: events.append(("train",)) or finetune(*a, **kw))
    monkeypatch.setattr(glue_run, "predict", lambda *a, **kw: events.append(("predict",)) or predict(*a, **kw))
    results = glue_run.run_glue(tiny_config(shared_data, vocab, "mrpc"), tmp_path / "glue")
    # compile everything, predict one tiny batch, then train with nothing left to compile
    assert events[:3] == [("compile", True), ("predict",), ("train",)]
    assert ("compile", True) not in events[3:]
    task = results["tasks"]["mrpc"]
    assert 0 < task["compile_seconds"] < task["wall_seconds"]
    assert task["seeds"]["0"]["train_steps_per_sec"] > 0


def test_a_model_that_cannot_predict_fails_before_training(shared_data, vocab, tmp_path, monkeypatch):
    def cannot_predict(self, batch_size, length):
        raise ValueError("the kernel refuses this layout")

    monkeypatch.setattr(finetune_lib.Programs, "lower_predict", cannot_predict)
    monkeypatch.setattr(glue_run, "finetune", lambda *a, **kw: pytest.fail("trained before predicting"))
    with pytest.raises(RuntimeError, match="mrpc: ValueError: the kernel refuses this layout"):
        glue_run.run_glue(tiny_config(shared_data, vocab, "mrpc"), tmp_path / "glue")


@pytest.mark.parametrize("train_padding", ["step", "call", "packed"])
def test_glue_on_a_cudnn_model_hands_the_kernel_layouts_it_takes(shared_data, vocab, tmp_path, monkeypatch,
                                                                 train_padding):
    """GLUE (training, with each padding, and prediction) with attention_impl=cudnn, the
    cuDNN calls checked against its layout rules and run by XLA's kernel (no GPU here)."""
    original, calls = jax.nn.dot_product_attention, []

    def checked(q, k, v, bias=None, mask=None, *, implementation=None, key_value_seq_lengths=None, **kw):
        if implementation == "cudnn":
            calls.append(cudnn_layout_errors(q, k, v, bias, mask, key_value_seq_lengths))
        return original(q, k, v, bias=bias, mask=mask, key_value_seq_lengths=key_value_seq_lengths,
                        implementation="xla", **kw)

    monkeypatch.setattr(jax.nn, "dot_product_attention", checked)
    monkeypatch.setattr(glue_run, "check_attention_impl", lambda config: None)   # cuDNN on CPU
    config = tiny_config(shared_data, vocab, "mrpc")
    config.model.update(dtype="bfloat16", attention_impl="cudnn", attention_dropout=0.0)
    config.train_padding = train_padding
    glue_run.run_glue(config, tmp_path / "glue")
    assert calls and all(errors == [] for errors in calls), [e for e in calls if e][:3]


def test_a_failing_task_keeps_the_other_tasks_results(shared_data, vocab, tmp_path, monkeypatch):
    metrics = glue_run.task_metrics

    def stsb_breaks(task, labels, preds):
        if task.name == "stsb":
            raise FloatingPointError("loss is nan at step 3")
        return metrics(task, labels, preds)

    monkeypatch.setattr(glue_run, "task_metrics", stsb_breaks)
    with pytest.raises(RuntimeError, match="stsb: FloatingPointError") as failed:
        glue_run.run_glue(tiny_config(shared_data, vocab, "stsb,mrpc"), tmp_path / "glue")
    assert "glue_results.json" in str(failed.value)
    on_disk = json.loads((tmp_path / "glue" / "glue_results.json").read_text())
    assert set(on_disk["tasks"]) == {"mrpc"} and set(on_disk["failed"]) == {"stsb"}


def test_the_rates_taken_at_once_are_the_schedule_of_each_step():
    protocol = finetune_lib.Protocol.from_config(glue_config.get_config(), "cola")
    schedule = protocol.schedule(50)
    at_once = np.asarray(schedule(np.arange(50)))
    np.testing.assert_allclose(at_once, [float(schedule(step)) for step in range(50)], rtol=1e-6, atol=1e-12)
    assert at_once[0] == 0 and at_once.max() == pytest.approx(protocol.learning_rate)


def test_the_persistent_compilation_cache_is_off_on_cpu_unless_a_directory_is_given(tmp_path, monkeypatch):
    from roformer.accelerator import enable_compilation_cache

    assert enable_compilation_cache("") is None
    if jax.default_backend() == "cpu":
        assert enable_compilation_cache("auto") is None
    set_to = []
    monkeypatch.setattr(jax.config, "update", lambda name, value: set_to.append((name, value)))
    assert enable_compilation_cache(str(tmp_path)) == str(tmp_path)
    assert set_to == [("jax_compilation_cache_dir", str(tmp_path)), ("jax_persistent_cache_min_compile_time_secs", 0.0)]


def test_the_median_seed_is_saved_reloads_to_its_scores_and_loads_in_transformers(shared_data, vocab, tmp_path):
    from roformer.convert import load_converted

    config = tiny_config(shared_data, vocab, "mrpc")
    config.seeds = 3
    results = glue_run.run_glue(config, tmp_path / "glue")
    saved = results["tasks"]["mrpc"]["saved_models"]
    chosen = saved["median_seed"]
    models = tmp_path / "glue" / "models" / "mrpc"
    assert sorted(p.name for p in models.iterdir()) == ["hf", f"seed{chosen}"]   # the median only
    # reloaded, the saved model predicts the dev scores the run reported for that seed
    model_config, model = load_converted(models / f"seed{chosen}")
    classifier = finetune_lib.Classifier.split(model)
    from roformer.glue.features import featurize
    from roformer.glue.readers import read_split
    from roformer.glue.tasks import TASKS
    from roformer.data.tokenizer import load_tokenizer
    from roformer.glue.metrics import task_metrics

    task = TASKS["mrpc"]
    tokenizer = load_tokenizer(str(models / f"seed{chosen}" / "tokenizer.json"))
    dev = featurize(read_split(task, "validation", source="local", data_dir=config.data_dir, hf_path="",
                               hf_cache_dir=None, tfds_data_dir=None)[:16], tokenizer, 32)
    programs = finetune_lib.Programs(classifier, finetune_lib.Protocol.from_config(config, "mrpc").update_settings, False)
    preds = finetune_lib.predict(classifier, programs, dev, batch_size=16,
                                  lengths=finetune_lib.predict_lengths("bucket", 32), pad_id=tokenizer.pad_id)
    assert task_metrics(task, dev.labels, preds) == pytest.approx(results["tasks"]["mrpc"]["seeds"][str(chosen)]["validation"])
    assert (models / "hf" / "config.json").is_file() and (models / "hf" / "tokenizer_config.json").is_file()
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(models / "hf").eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(models / "hf")
    ids = hf_tokenizer(["a short sentence ."], return_tensors="pt")
    with torch.no_grad():
        hf_logits = hf(**ids).logits.numpy()
    ours = np.asarray(model(jnp.asarray(ids["input_ids"].numpy()),
                            token_type_ids=jnp.asarray(ids["token_type_ids"].numpy())))
    np.testing.assert_allclose(ours, hf_logits, atol=1e-4)


def _random_features(n: int, seed: int = 0):
    """Mostly short examples, a few long ones: batches of 8 pad to 16, 32 or 64 tokens."""
    from roformer.glue.features import Features

    rng = np.random.default_rng(seed)
    lengths = rng.choice([4, 10, 14, 30, 60], size=n, p=[0.5, 0.3, 0.12, 0.05, 0.03])
    ids = [rng.integers(5, 100, k).astype(np.int32) for k in lengths]
    return Features(ids, [(np.arange(len(x)) > len(x) // 2).astype(np.int32) for x in ids],
                    rng.integers(0, 2, n).astype(np.int32), np.arange(n))


def test_the_train_program_holds_one_optimizer_update_however_many_lengths_it_runs():
    """Only the gradients are a branch per padded length: the update after them is one copy,
    so a program of three lengths has as many of Adam's square roots (one per parameter,
    and the global norm's) as a program of one."""
    from roformer.model import ModelConfig

    model_config = ModelConfig(vocab_size=100, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    classifier = finetune_lib.Classifier.split(finetune_lib.create_model(model_config, 2, 0))
    programs = finetune_lib.Programs(classifier, (0.9, 0.98, 1e-6, 0.01, 1.0), False)

    def square_roots(lengths):
        return programs.lower_train(finetune_lib.TrainProgram(8, lengths, 4)).as_text().count("stablehlo.sqrt")

    one = square_roots((16,))
    assert one == len(jax.tree.leaves(classifier.params)) + 1
    assert square_roots((16, 32, 64)) == one


def test_several_steps_per_call_make_the_same_updates_as_one_step_per_call():
    """The batches, rates, dropout keys and order of the one-program-per-step loop (a batch
    assembled per step, one program per padded length): every logged loss and the final
    params equal bit for bit, for a call of 1 step, of 3 (the last call padded with no-op
    steps) and of more steps than the run has. (To float32 rounding where the suite compiles
    with XLA:CPU's older fusion emitters, tests/conftest.py, which round a step inside a loop
    differently from the same step alone.)"""
    from roformer.glue.features import planned_train_batches
    from roformer.model import ModelConfig

    features = _random_features(30)    # a short last batch
    config = glue_config.get_config()
    config.update(batch_size=8, max_seq_len=64, num_epochs=2.0, learning_rate=1e-3)
    protocol = finetune_lib.Protocol.from_config(config, "sst2")
    model_config = ModelConfig(vocab_size=100, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    classifier = finetune_lib.Classifier.split(finetune_lib.create_model(model_config, 2, 0))
    programs = finetune_lib.Programs(classifier, protocol.update_settings, False)

    total = protocol.total_steps(len(features))
    rates = np.asarray(protocol.schedule(total)(np.arange(total)), np.float32)
    step = jax.jit(programs.single_step())
    params, opt_state = classifier.params, programs.tx.init(classifier.params)
    plan = planned_train_batches(features, 8, 64, 3, total)
    assert len({length for length, _ in plan}) > 1 and len(plan[-1][1]) < 8
    reference = []
    for i, (length, rows) in enumerate(plan):
        batch = {k: v for k, v in features.batch(rows, 8, length, 0).items() if k in finetune_lib.TRAIN_INPUTS}
        params, opt_state, loss = step(params, opt_state, classifier.rest, batch, rates[i], jax.random.key(3), np.int32(i))
        reference.append(float(loss))

    for steps_per_call in (1, 3, total + 5):
        logged = []
        trained, info = finetune_lib.finetune(classifier, programs, features, protocol, seed=3, pad_id=0,
                                              log_every=1, log_fn=logged.append, progress=False,
                                              steps_per_call=steps_per_call)
        assert [row["step"] for row in logged] == list(range(1, total + 1))
        if LEGACY_FUSION_EMITTERS:
            np.testing.assert_allclose([row["loss"] for row in logged], reference, rtol=1e-6)
            assert info["final_loss"] == pytest.approx(reference[-1], rel=1e-6)
            for ours, theirs in zip(jax.tree.leaves(trained.params), jax.tree.leaves(params)):
                np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=1e-5, atol=1e-7)
            continue
        assert [row["loss"] for row in logged] == reference, steps_per_call
        assert info["final_loss"] == reference[-1]
        for ours, theirs in zip(jax.tree.leaves(trained.params), jax.tree.leaves(params)):
            np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))


def _small_run(dropout: float = 0.1, position: str = "rope"):
    """Features, a protocol, a classifier and its programs small enough for a few-second run."""
    from roformer.model import ModelConfig

    config = glue_config.get_config()
    config.update(batch_size=8, max_seq_len=64, num_epochs=2.0, learning_rate=1e-3)
    protocol = finetune_lib.Protocol.from_config(config, "sst2")
    model_config = ModelConfig(vocab_size=100, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64,
                               hidden_dropout=dropout, attention_dropout=dropout, position=position)
    classifier = finetune_lib.Classifier.split(finetune_lib.create_model(model_config, 2, 0))
    return _random_features(30), protocol, classifier, finetune_lib.Programs(classifier, protocol.update_settings, False)


def test_auto_packs_a_task_whose_examples_leave_rows_half_empty_and_pads_one_that_fills_them():
    """auto packs where packed rows compute at most PACKING_PAYS of the padded form's tokens;
    elsewhere it pads, per call on a GPU and per step on other backends."""
    from roformer.errors import ConfigError
    from roformer.glue.features import Features

    _, protocol, _, _ = _small_run()
    short = _random_features(400)      # 100 steps: a call's padding steps weigh little
    chosen, why = finetune_lib.task_padding("auto", short, protocol, "cpu")
    assert chosen == "packed" and "auto" in why
    rng = np.random.default_rng(0)
    full_ids = [rng.integers(5, 100, 60).astype(np.int32) for _ in range(400)]     # 60 of a row of 64
    full = Features(full_ids, [np.zeros(60, np.int32)] * 400, np.zeros(400, np.int32), np.arange(400))
    assert finetune_lib.task_padding("auto", full, protocol, "cpu")[0] == "step"
    assert finetune_lib.task_padding("auto", full, protocol, "gpu")[0] == "call"
    assert finetune_lib.task_padding("auto", full, protocol, "tpu")[0] == "step"
    assert finetune_lib.task_padding("step", short, protocol, "gpu") == ("step", "train_padding=step")
    with pytest.raises(ConfigError, match="train_padding"):
        finetune_lib.task_padding("row", short, protocol, "gpu")


def test_full_prediction_padding_is_one_program_and_predicts_what_bucketed_batches_do():
    """eval_padding: bucketed batches run a program per padded length, full ones one at
    max_seq_len (auto's choice off the CPU), and the predictions agree."""
    from roformer.errors import ConfigError

    _, protocol, classifier, programs = _small_run(position="t5")
    features = _random_features(120)
    bucket = finetune_lib.predict_lengths("auto", 64, "cpu")
    assert bucket == finetune_lib.predict_lengths("bucket", 64, "gpu") == (16, 32, 64)
    assert finetune_lib.predict_lengths("auto", 64, "gpu") == finetune_lib.predict_lengths("auto", 64, "tpu") == (64,)
    assert finetune_lib.predict_shapes([features], batch_size=8, lengths=bucket) == [(8, 16), (8, 32), (8, 64)]
    assert finetune_lib.predict_shapes([features], batch_size=8, lengths=(64,)) == [(8, 64)]
    regression = finetune_lib.Programs(classifier, protocol.update_settings, True)
    for progs in (programs, regression):
        by_bucket, full = (finetune_lib.predict(classifier, progs, features, batch_size=8, lengths=lengths, pad_id=0)
                           for lengths in (bucket, (64,)))
        np.testing.assert_allclose(full, by_bucket, rtol=1e-5, atol=1e-5)
    assert len(set(by_bucket.tolist())) > 1          # scores that differ per example, not a constant
    with pytest.raises(ConfigError, match="eval_padding"):
        finetune_lib.predict_lengths("longest", 64)


def test_per_call_padding_runs_each_call_at_its_longest_length_with_no_branch(monkeypatch):
    """A call's program is the longest padded length of its steps; a one-length program, as
    lowered off the CPU (where the model has no conditional of its own), has no conditional;
    the per-step program has one, a branch per length."""
    from roformer.glue.features import planned_train_batches
    from roformer.model import backend

    features, protocol, _, programs = _small_run()
    total = protocol.total_steps(len(features))
    plan = planned_train_batches(features, 8, 64, 3, total)
    per_call = finetune_lib.call_programs(plan, protocol, "call", 2)
    assert len(per_call) == -(-total // 2)
    for i, program in enumerate(per_call):
        assert program.lengths == (max(length for length, _ in plan[2 * i:2 * i + 2]),)
    assert len({p.lengths for p in per_call}) > 1
    assert set(finetune_lib.train_programs(features, protocol, [3], "call", 2)) == set(per_call)
    assert finetune_lib.call_programs(plan, protocol, "step", 2) == [finetune_lib.TrainProgram.for_protocol(protocol, 2)] * len(per_call)
    monkeypatch.setattr(backend, "on_cpu", lambda: False)
    assert "stablehlo.case" not in programs.lower_train(per_call[0]).as_text()
    assert "stablehlo.case" in programs.lower_train(finetune_lib.TrainProgram.for_protocol(protocol, 3)).as_text()


@pytest.mark.parametrize("padding, position", [("call", "rope"), ("packed", "rope"), ("packed", "learned"),
                                               ("packed", "t5")])
def test_unbranched_layouts_make_the_per_step_updates_and_their_padding_steps_change_nothing(padding, position):
    """Without dropout (whose masks are drawn for the layout's shape, so each layout draws
    its own), a call's steps padded to their longest length, or a step's examples packed end
    to end into rows (each its own segment, positions from 0), give the per-step run's
    losses and params to float32 rounding, for rotary, absolute and relative positions: the
    extra padding is masked out. A call padded with steps past the run's end (computed, with
    rows of weight 0 at rate 0) leaves the params bit for bit as a call without them."""
    features, protocol, classifier, programs = _small_run(dropout=0.0, position=position)
    total = protocol.total_steps(len(features))

    def run(padding, steps_per_call):
        logged = []
        trained, _ = finetune_lib.finetune(classifier, programs, features, protocol, seed=3, pad_id=0, log_every=1,
                                           log_fn=logged.append, progress=False, steps_per_call=steps_per_call,
                                           padding=padding)
        return [row["loss"] for row in logged], jax.tree.leaves(trained.params)

    step_losses, step_params = run("step", 4)
    losses, params = run(padding, 4)
    np.testing.assert_allclose(losses, step_losses, rtol=2e-5, atol=1e-6)
    for ours, theirs in zip(params, step_params):
        np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=1e-4, atol=1e-6)
    if position == "rope":
        whole_losses, whole_params = run(padding, total)
        padded_losses, padded_params = run(padding, total + 5)
        assert padded_losses == whole_losses
        for ours, theirs in zip(padded_params, whole_params):
            np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))


def test_packed_programs_take_the_rows_their_calls_need_and_have_no_branch(monkeypatch):
    from roformer.glue.features import pack_rows, planned_train_batches, row_buckets
    from roformer.model import backend

    features, protocol, _, programs = _small_run()
    total = protocol.total_steps(len(features))
    plan = planned_train_batches(features, 8, 64, 3, total)
    per_call = finetune_lib.call_programs(plan, protocol, "packed", 2, features.lengths)
    for i, program in enumerate(per_call):
        needed = max(pack_rows(features.lengths[rows], 64)[2] for _, rows in plan[2 * i:2 * i + 2])
        assert program.lengths == (64,) and program.rows == min(n for n in row_buckets(8) if n >= needed)
    assert max(p.rows for p in per_call) < 8     # fewer rows than examples: that is the point
    with pytest.raises(ValueError, match="packed"):
        finetune_lib.call_programs(plan, protocol, "packed", 2)     # the rows need the examples' lengths
    monkeypatch.setattr(backend, "on_cpu", lambda: False)
    assert "stablehlo.case" not in programs.lower_train(per_call[0]).as_text()


def test_the_progress_bar_counts_finished_steps_and_compiling_is_announced(monkeypatch, caplog):
    """Each step the bar counts has finished on the device (a call waited for), not merely
    been queued; and a first run says it is compiling before the silent minutes that takes."""
    features, protocol, classifier, programs = _small_run()
    events = []

    class Bar:
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def update(self, n):
            events.append(("update", n))

    real_wait = jax.block_until_ready
    monkeypatch.setattr(finetune_lib, "progress_bar", Bar)
    monkeypatch.setattr(finetune_lib.jax, "block_until_ready",
                        lambda x: (events.append(("finished", None)), real_wait(x))[1])
    with caplog.at_level("INFO", logger="roformer.glue"):
        finetune_lib.finetune(classifier, programs, features, protocol, seed=0, pad_id=0, steps_per_call=2)
    total = protocol.total_steps(len(features))
    assert sum(n for kind, n in events if kind == "update") == total
    assert all(events[i - 1][0] == "finished" for i, (kind, _) in enumerate(events) if kind == "update")
    assert any(record.getMessage().startswith("compiling ") and " programs (" in record.getMessage()
               for record in caplog.records)


def test_the_progress_into_a_log_is_plain_lines_of_finished_steps(monkeypatch, caplog):
    """Into a file or a pipe (not a terminal) GLUE's progress is pretraining's: plain log
    lines, no carriage-return redraws, ending at the task's step count (not the steps its
    last call was padded to)."""
    import io

    features, protocol, classifier, programs = _small_run()
    stream = io.StringIO()          # not a terminal
    monkeypatch.setattr("sys.stderr", stream)
    with caplog.at_level("INFO", logger="roformer"):
        finetune_lib.finetune(classifier, programs, features, protocol, seed=0, pad_id=0, steps_per_call=3,
                              desc="SST-2 seed 0")
    total = protocol.total_steps(len(features))
    assert total % 3                 # the last call is padded with steps the bar must not count
    assert "\r" not in stream.getvalue()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("SST-2 seed 0: step")]
    assert lines and lines[-1].startswith(f"SST-2 seed 0: step {total} of {total} (100%)")


@pytest.mark.parametrize("padding, grad_accum", [("step", 4), ("call", 2), ("packed", 4)])
def test_accumulated_micro_batches_make_the_updates_of_the_whole_batch(padding, grad_accum):
    """config.grad_accum: each step as k micro-batches of batch/k, gradients summed before
    the update, gives the whole batch's losses and params (dropout off: micro-batches draw
    their own masks) to float32 rounding, short last batch and padding steps included; its
    program runs micro-batches of batch/k (k=4: 2 rows of 64 tokens each)."""
    features, protocol, classifier, programs = _small_run(dropout=0.0)

    def run(grad_accum):
        logged = []
        accumulated = dataclasses.replace(protocol, grad_accum=grad_accum)
        trained, _ = finetune_lib.finetune(classifier, programs, features, accumulated, seed=3, pad_id=0,
                                           log_every=1, log_fn=logged.append, progress=False, steps_per_call=3,
                                           padding=padding)
        return [row["loss"] for row in logged], jax.tree.leaves(trained.params)

    whole_losses, whole_params = run(1)
    losses, params = run(grad_accum)
    np.testing.assert_allclose(losses, whole_losses, rtol=2e-5, atol=1e-6)
    for ours, theirs in zip(params, whole_params):
        np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=1e-4, atol=1e-6)
    if padding != "step":
        return
    program = finetune_lib.TrainProgram(8, (64,), 3, micro_batches=4)
    text = programs.lower_train(program).as_text()
    assert "tensor<3x4x2x64xi32>" in text and "tensor<3x8x64xi32>" not in text


def test_a_batch_that_grad_accum_does_not_divide_is_refused():
    from roformer.errors import ConfigError

    config = glue_config.get_config()
    config.update(batch_size=12, grad_accum=8)
    with pytest.raises(ConfigError, match="batch_size=12 must be a multiple of grad_accum=8"):
        finetune_lib.Protocol.from_config(config, "rte").check("rte")
    config.per_task.rte.grad_accum = 4
    finetune_lib.Protocol.from_config(config, "rte").check("rte")
    assert finetune_lib.Protocol.from_config(config, "rte").grad_accum == 4
