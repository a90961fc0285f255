"""Optimizer, schedules, gradient accumulation, dropout keys, configs, FLOPs/MFU and the metrics writer."""
import dataclasses
import importlib
import re
import tomllib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from roformer.model import ModelConfig, RoFormerForMaskedLM
from roformer.model.positions import POSITION_SCHEMES
from roformer.train import build_model_config, flops, read_metrics
from roformer.train.bookkeeping import check_same_model_config
from roformer.train.metrics import MetricsWriter, ThroughputTimer
from roformer.train.config import TrainConfig
from roformer.train.optim import decay_mask, make_optimizer, make_schedule
from roformer.train.steps import DROPOUT_RNG_IMPLS, make_train_step, mlm_sums, reseeded

# config file -> the scheme it selects: every scheme's own file, plus a variant
SCHEMES = {scheme.config_file: name for name, scheme in POSITION_SCHEMES.items()} | {"rotary_linear": "rope"}


def load_config(name: str, arg: str | None = None):
    return importlib.import_module(f"roformer.configs.{name}").get_config(arg)


def optimizer(**overrides):
    """make_optimizer with the default AdamW settings (TrainConfig), 10 steps, warmup 2, lr 1e-2."""
    tc = TrainConfig()
    settings = dict(learning_rate=1e-2, warmup_steps=2, total_steps=10, decay=tc.decay, weight_decay=tc.weight_decay,
                    b1=tc.b1, b2=tc.b2, eps=tc.eps, clip_norm=tc.clip_norm)
    return make_optimizer(**{**settings, **overrides})


def test_mlm_sums_are_optax_cross_entropy_and_argmax_accuracy():
    """The step's loss is optax's cross-entropy at the masked slots and its accuracy is
    argmax == label (computed from the loss's max), both weighted by the real slots."""
    import optax
    logits = jax.random.normal(jax.random.key(0), (3, 5, 50)) * 4
    labels = jax.random.randint(jax.random.key(1), (3, 5), 0, 50)
    labels = labels.at[0, :3].set(jnp.argmax(logits[0, :3], -1))     # some slots predicted
    weights = (jnp.arange(5) < jnp.array([[5], [4], [2]])).astype(jnp.float32)

    class Model:
        def __call__(self, input_ids, **unused):
            return logits

    sums = mlm_sums(Model(), {"input_ids": None, "token_type_ids": None, "positions": None, "segment_ids": None,
                              "masked_positions": None, "masked_labels": labels, "masked_weights": weights})
    expected_loss = jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, labels) * weights)
    expected_correct = jnp.sum((jnp.argmax(logits, -1) == labels) * weights)
    np.testing.assert_allclose(sums["loss_sum"], expected_loss, rtol=1e-6)
    assert float(sums["correct_sum"]) == float(expected_correct) >= 3
    assert float(sums["weight_sum"]) == 11


def test_schedule_warms_up_then_decays_linear_and_cosine():
    linear = make_schedule(learning_rate=1.0, warmup_steps=4, total_steps=12, decay="linear")
    np.testing.assert_allclose([linear(s) for s in (0, 2, 4, 8, 12)], [0, 0.5, 1, 0.5, 0], atol=1e-6)
    cosine = make_schedule(learning_rate=1.0, warmup_steps=4, total_steps=12, decay="cosine")
    np.testing.assert_allclose([cosine(s) for s in (4, 8, 12)], [1, 0.5, 0], atol=1e-6)
    with pytest.raises(ValueError, match="train.decay"):
        make_schedule(learning_rate=1.0, warmup_steps=1, total_steps=2, decay="step")


def test_no_weight_decay_on_layernorm_and_biases():
    tx, _ = optimizer(weight_decay=0.5, clip_norm=1.0)
    params = {"dense": {"kernel": jnp.ones((3, 4)), "bias": jnp.ones((4,))},
              "LayerNorm": {"scale": jnp.ones((4,)), "bias": jnp.ones((4,))}}
    assert decay_mask(params) == {"dense": {"kernel": True, "bias": False},
                                  "LayerNorm": {"scale": False, "bias": False}}
    zeros = jax.tree.map(jnp.zeros_like, params)
    _, state = tx.update(zeros, tx.init(params), params)   # step 0: warmup lr is 0
    updates, _ = tx.update(zeros, state, params)            # step 1: zero gradient -> decay only
    assert float(jnp.abs(updates["dense"]["kernel"]).max()) > 0
    for leaf in (updates["dense"]["bias"], updates["LayerNorm"]["scale"], updates["LayerNorm"]["bias"]):
        assert float(jnp.abs(leaf).max()) == 0.0


def test_global_norm_clipping_bounds_the_update():
    tx, _ = optimizer(clip_norm=1.0, weight_decay=0.0, warmup_steps=0)
    params = {"w": jnp.zeros((2, 2))}
    huge = {"w": jnp.full((2, 2), 1e6)}
    state = tx.init(params)
    clipped, _ = tx.update(huge, state, params)
    small, _ = tx.update(jax.tree.map(lambda g: g / 2e6, huge), state, params)  # norm 1 exactly
    np.testing.assert_allclose(clipped["w"], small["w"], rtol=1e-5)


def test_gradient_accumulation_equals_full_batch():
    from test_train_sharding import TINY, synthetic_batch
    tx, schedule = optimizer(warmup_steps=0)
    model = RoFormerForMaskedLM(TINY, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    params = nnx.to_pure_dict(params)
    state = {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}
    batch = {k: jnp.asarray(v) for k, v in synthetic_batch(0).items()}
    full = jax.jit(make_train_step(graphdef, tx, schedule, seed=0))(state, rest, batch)
    accum = jax.jit(make_train_step(graphdef, tx, schedule, seed=0, grad_accum=4))(state, rest, batch)
    np.testing.assert_allclose(accum[1]["loss"], full[1]["loss"], rtol=1e-5)
    np.testing.assert_allclose(accum[1]["grad_norm"], full[1]["grad_norm"], rtol=1e-4)
    for a, b in zip(jax.tree.leaves(accum[0]["params"]), jax.tree.leaves(full[0]["params"])):
        np.testing.assert_allclose(a, b, atol=1e-5)   # Adam step of size lr=1e-2


@pytest.mark.parametrize("impl", DROPOUT_RNG_IMPLS)
def test_every_dropout_site_draws_its_own_mask(monkeypatch, impl):
    """Each nnx.Dropout has a stream of its own; a step's key reaches each as its own key, so
    the embeddings' and every layer's dropout do not drop the same features of a token."""
    from test_train_sharding import TINY, synthetic_batch
    config = dataclasses.replace(TINY, hidden_dropout=0.1, attention_dropout=0.1)
    graphdef, params, rest = nnx.split(RoFormerForMaskedLM(config, rngs=nnx.Rngs(0)), nnx.Param, ...)
    model = nnx.merge(graphdef, params, reseeded(rest, jax.random.fold_in(jax.random.key(0, impl=impl), 7)))
    draws, bernoulli = [], jax.random.bernoulli

    def recording(key, p=0.5, shape=None, **kwargs):
        draws.append(np.asarray(bernoulli(key, p, shape, **kwargs)))
        return draws[-1]

    monkeypatch.setattr(jax.random, "bernoulli", recording)
    batch = synthetic_batch(0)
    mlm_sums(model, {k: jnp.asarray(v) for k, v in batch.items()})
    by_shape = {}
    for mask in draws:
        by_shape.setdefault(mask.shape, []).append(mask)
    assert len(draws) >= 2 * TINY.num_layers + 1 and max(len(m) for m in by_shape.values()) >= 3
    for masks in by_shape.values():
        assert all(not np.array_equal(a, b) for i, a in enumerate(masks) for b in masks[:i])


def test_dropout_rng_impls_are_deterministic_and_distinct():
    """Every dropout key implementation gives the same step twice from the same state (what
    exact resume rests on), works with gradient accumulation, and draws its own masks."""
    from test_train_sharding import TINY, synthetic_batch
    config = dataclasses.replace(TINY, hidden_dropout=0.1, attention_dropout=0.1)
    tx, schedule = optimizer(warmup_steps=0)
    graphdef, params, rest = nnx.split(RoFormerForMaskedLM(config, rngs=nnx.Rngs(0)), nnx.Param, ...)
    params = nnx.to_pure_dict(params)
    state = {"params": params, "opt_state": tx.init(params), "step": jnp.full((), 3, jnp.int32)}
    batch = {k: jnp.asarray(v) for k, v in synthetic_batch(0).items()}
    losses = {}
    for impl in DROPOUT_RNG_IMPLS:
        step = jax.jit(make_train_step(graphdef, tx, schedule, seed=0, dropout_rng_impl=impl))
        first, again = step(state, rest, batch), step(state, rest, batch)
        for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again)):
            np.testing.assert_array_equal(a, b)
        accum = jax.jit(make_train_step(graphdef, tx, schedule, seed=0, grad_accum=2, dropout_rng_impl=impl))
        assert np.isfinite(accum(state, rest, batch)[1]["loss"])
        losses[impl] = float(first[1]["loss"])
    assert len(set(losses.values())) == len(DROPOUT_RNG_IMPLS)   # each draws its own masks
    with pytest.raises(ValueError, match="dropout RNG implementation 'philox'"):
        make_train_step(graphdef, tx, schedule, seed=0, dropout_rng_impl="philox")


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_scheme_configs_build_their_model(name):
    config = load_config(name, "size=mini")
    model_cfg = build_model_config(config.model, vocab_size=1000)
    assert model_cfg.position == SCHEMES[name] and model_cfg.hidden_size == 256
    assert model_cfg.attention == ("linear" if name == "rotary_linear" else "softmax")


def test_config_arguments_and_overrides():
    assert load_config("rotary").model.size == "base"
    tiny = load_config("tiny")
    assert tiny.model.size == "tiny" and tiny.data.source == "embedded"
    assert load_config("tiny", "source=files").model.size == "tiny"
    config = load_config("rotary", "size=base,source=files")
    assert (config.model.size, config.data.source) == ("base", "files")
    config.model.hidden_size = 384                   # an explicit field beats the preset
    assert build_model_config(config.model, vocab_size=10).hidden_size == 384
    with pytest.raises(ValueError, match="unknown config argument"):
        load_config("rotary", "sise=base")


def test_config_sections_are_the_dataclass_defaults_and_a_retired_key_names_its_replacement():
    config = load_config("base")
    assert TrainConfig.from_section(config.train) == TrainConfig()
    assert build_model_config(config.model, vocab_size=1000) == ModelConfig(vocab_size=1000)
    assert config.train.dtype is None            # kept as an unset placeholder, so the CLI reaches the refusal
    config.train.dtype = "bfloat16"
    with pytest.raises(ValueError, match=r"^train.dtype is now model.dtype: set --config.model.dtype instead$"):
        TrainConfig.from_section(config.train)
    with pytest.raises(ValueError, match=r"unknown train settings \['stpes'\]"):
        TrainConfig.from_section({"stpes": 10})


def test_model_config_mismatch_lists_differing_keys(tmp_path):
    saved = ModelConfig(hidden_size=64, num_heads=4).to_dict()
    check_same_model_config(saved, dict(saved), tmp_path)
    with pytest.raises(ValueError, match=r"hidden_size: checkpoint=64 config=128(.|\n)*position"):
        check_same_model_config(saved, {**saved, "hidden_size": 128, "position": "t5"}, tmp_path)
    # A checkpoint written before a ModelConfig field existed resumes (the field is its
    # default), and the attention kernel may change between runs.
    older = {k: v for k, v in saved.items() if k != "attention_impl"}
    check_same_model_config(older, {**saved, "attention_impl": "xla"}, tmp_path)


@pytest.mark.parametrize("embedding_size,attention", [(None, "softmax"), (128, "softmax"), (None, "linear")])
def test_train_flops_match_xla_cost_analysis(embedding_size, attention):
    """The analytic count (matmuls only, forward x 3) against what XLA counts for the compiled
    train step of roformer.train (packed rows): XLA also counts the element-wise work (GELU,
    softmax, LayerNorm, AdamW), about 3% here, so the analytic figure is a slightly lower
    bound. Leaving out the attention scores, or counting the MLM head at every position
    instead of the masked slots, moves the ratio out of the band (to about 1.12 and 0.89).
    Linear attention on packed rows runs its quadratic form, which the count follows."""
    from test_train_sharding import synthetic_batch

    from roformer.train import sharding
    from roformer.train.state import TrainSetup

    cfg = ModelConfig(vocab_size=1000, hidden_size=256, num_layers=2, num_heads=4, intermediate_size=1024,
                      embedding_size=embedding_size, hidden_dropout=0.0, attention_dropout=0.0, attention=attention)
    batch_size, seq_len, predictions = 4, 128, 20
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    setup = TrainSetup(cfg, *optimizer(), mesh)
    with jax.set_mesh(mesh):
        state, rest = setup.init_state(), setup.init_rest()
        batch = sharding.global_batch(synthetic_batch(0, batch_size, seq_len, predictions), mesh)
        cost = setup.jit_train_step().lower(state, rest, batch).compile().cost_analysis()
    analytic = flops.train_flops_per_step(cfg, batch_size=batch_size, seq_len=seq_len, num_predictions=predictions,
                                          segmented=True)
    assert 1.0 <= cost["flops"] / analytic <= 1.05, (cost["flops"], analytic)


def test_mfu_and_device_peaks():
    assert flops.mfu(1e12, 2.0, 1e12, 4) == 0.5

    class Device:
        device_kind = "TPU v5 lite"
    assert flops.device_peak_flops(Device(), "bfloat16") == 197e12
    assert flops.device_peak_flops(Device(), "bfloat16", configured=1e9) == 1e9
    # Names that contain a shorter entry's: each gets its own dense bf16 peak. v5p is "TPU v5"
    # on a TPU VM; a v2/v3 device is one core, half a chip.
    for kind, peak in (("TPU v5", 459e12), ("TPU v5p", 459e12), ("TPU v3", 61.5e12), ("TPU v4", 275e12),
                       ("NVIDIA L40", 181e12), ("NVIDIA L40S", 362e12), ("NVIDIA L4", 121e12),
                       ("NVIDIA H200 NVL", 835e12), ("NVIDIA H200", 989e12), ("NVIDIA GH200 480GB", 989e12),
                       ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12)):
        Device.device_kind = kind
        assert flops.device_peak_flops(Device(), "bfloat16") == peak, kind
    # f32 at jax's default precision: TF32 tensor cores from Ampere on, the CUDA cores on a V100
    for kind, peak in (("NVIDIA H100 80GB HBM3", 494.5e12), ("NVIDIA H200", 494.5e12), ("NVIDIA A100-SXM4-80GB", 156e12),
                       ("Tesla V100-SXM2-16GB", 15.7e12), ("TPU v4", 275e12 / 4)):
        Device.device_kind = kind
        assert flops.device_peak_flops(Device(), "float32") == peak, kind


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
    import jax

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


def test_a_resumed_guard_replays_the_logged_losses(tmp_path):
    """A resumed run's divergence guard: its reference median holds the logged losses it judged
    in range (not a spike's), and a streak of out-of-range rows the run stopped in counts on."""
    import json

    from roformer.train import bookkeeping
    from roformer.train.config import TrainConfig

    rows = [{"step": s, "loss": 590.0 if s in (18, 22) else 6.0} for s in range(2, 23, 2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tc = TrainConfig(warmup_steps=0, divergence_window=20)
    guard = bookkeeping.resumed_guard(tc, bookkeeping.logged_history(tmp_path, 22, 20), 22)
    assert list(guard.history) == [6.0] * 9 and guard.strikes == 1 and guard.suspicious
    assert guard.resumed_step == guard.last_good_step == 22


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
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(3, 2.5)]


def test_divergence_guard_stops_a_finite_spike_after_patience_but_not_warmup_or_noise():
    """The guard judges rows only after warmup and against the median of recent in-range
    losses: warmup spikes, noise and a short spike pass; `patience` out-of-range rows in a
    row stop; a nearly solved task's tiny losses are compared with at least 1 nat; factor 0
    is off."""
    from roformer.train.guard import DivergenceGuard, TrainingDiverged

    guard = DivergenceGuard(factor=3.0, patience=3, window=20, after_step=25)
    for step, loss in [(10, 8.0), (20, 60.0), (30, 7.0)]:   # a warmup spike is recorded, not judged
        assert guard.check_loss(step, loss) is None
    rng = np.random.default_rng(0)
    for step in range(40, 400, 10):                         # noisy, slowly falling: never out of range
        assert guard.check_loss(step, 6.0 - step / 200 + rng.normal(0, 0.5)) is None
    assert not guard.suspicious and guard.last_good_step == 390
    assert guard.check_loss(400, 1e8) is None and guard.check_loss(410, 1e8) is None   # two strikes
    assert guard.suspicious and guard.last_good_step == 390
    assert guard.check_loss(420, 5.0) is None and not guard.suspicious              # recovered: reset
    guard.check_loss(430, 1e8), guard.check_loss(440, 1e8)
    reason = guard.check_loss(450, 1e8)
    assert reason.startswith("training loss 1e+08 stayed above 3 x its recent median") and guard.last_good_step == 420

    solved = DivergenceGuard(after_step=0, history=[0.02, 0.05, 0.01, 0.03, 0.02])
    assert solved.check_loss(10, 0.5) is None and not solved.suspicious     # 25x the median, below 3 nats
    off = DivergenceGuard(factor=0, patience=1, history=[5.0] * 5)
    assert off.check_loss(10, 1e8) is None and off.check_eval(10, 1e8) is None
    assert off.check_eval(20, float("nan")) == "non-finite held-out loss nan"   # NaN stops even when off

    evals = DivergenceGuard(after_step=25)
    assert evals.check_eval(0, 5.0) is None and evals.check_eval(10, 40.0) is None   # warmup: not judged
    assert evals.check_eval(100, 4.0) is None and evals.best_eval == 4.0
    assert evals.check_eval(200, 13.0).startswith("held-out loss 13 is above 3 x the best so far, 4")
    assert issubclass(TrainingDiverged, FloatingPointError)
    with pytest.raises(ValueError, match="divergence_factor=0.5 must be above 1"):
        DivergenceGuard(factor=0.5)



def test_the_jitted_initial_state_is_the_seeds_model_and_takes_the_key_as_input(monkeypatch):
    """TrainSetup's state and RNG streams are those of RoFormerForMaskedLM(rngs=nnx.Rngs(seed)),
    and its jitted initialisers read the key as an argument: with no input a program is all
    constants, which XLA's GPU pipeline tries to fold at compile time."""
    from test_train_sharding import TINY

    from roformer.train import sharding
    from roformer.train.state import TrainSetup

    jit, arguments = jax.jit, []

    def recording_jit(fun, **options):
        jitted = jit(fun, **options)

        def call(*args):
            arguments.append(args)
            return jitted(*args)
        return call

    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    setup = TrainSetup(TINY, *optimizer(), mesh, seed=5)
    monkeypatch.setattr(jax, "jit", recording_jit)
    with jax.set_mesh(mesh):
        state, rest = setup.init_state(), setup.init_rest()
    monkeypatch.undo()
    assert [len(args) for args in arguments] == [1, 1]
    assert all(jnp.issubdtype(args[0].dtype, jax.dtypes.prng_key) for args in arguments)

    _, params, expected_rest = nnx.split(RoFormerForMaskedLM(TINY, rngs=nnx.Rngs(5)), nnx.Param, ...)

    # The same draws; jitted and eager initialisers round the last bit differently.
    for got, want in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(nnx.to_pure_dict(params)), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    for got, want in zip(jax.tree.leaves(rest), jax.tree.leaves(expected_rest), strict=True):
        if jnp.issubdtype(got.dtype, jax.dtypes.prng_key):
            got, want = jax.random.key_data(got), jax.random.key_data(want)
        np.testing.assert_array_equal(got, want)


def test_stacked_initial_states_are_each_seeds_state():
    from test_train_sharding import TINY

    from roformer.train import sharding
    from roformer.train.state import TrainSetup

    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    stacked = TrainSetup(TINY, *optimizer(), mesh).init_states([3, 8])
    for index, seed in enumerate([3, 8]):
        setup = TrainSetup(TINY, *optimizer(), mesh, seed=seed)
        with jax.set_mesh(mesh):
            alone = setup.init_state()
        for got, want in zip(jax.tree.leaves(stacked), jax.tree.leaves(alone), strict=True):
            np.testing.assert_array_equal(got[index], want)


def test_initial_state_op_by_op_equals_the_compiled_one():
    from test_train_sharding import TINY

    from roformer.train import sharding
    from roformer.train.state import TrainSetup

    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    setup = TrainSetup(TINY, *optimizer(), mesh, seed=4)
    with jax.set_mesh(mesh):
        compiled, op_by_op = setup.init_state(), setup.init_state(compiled=False)
    assert jax.tree.structure(op_by_op) == jax.tree.structure(compiled)
    for got, want in zip(jax.tree.leaves(op_by_op), jax.tree.leaves(compiled), strict=True):
        assert got.sharding == want.sharding and got.dtype == want.dtype
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_initial_state_made_on_the_host_equals_the_one_made_sharded_on_the_mesh():
    """on_host: the host CPU's compiled initialiser, then placed with the state's shardings
    (on a GPU the device's program is far slower to compile); the same state, on a mesh of
    devices other than the host's first, inside the mesh's context as the loop calls it."""
    from test_train_sharding import TINY

    from roformer.train import sharding
    from roformer.train.state import TrainSetup

    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 1}, jax.devices()[4:8])
    setup = TrainSetup(TINY, *optimizer(), mesh, seed=5)
    with jax.set_mesh(mesh):
        on_mesh, on_host = setup.init_state(on_host=False), setup.init_state(on_host=True)
    assert jax.tree.structure(on_host) == jax.tree.structure(on_mesh)
    for got, want in zip(jax.tree.leaves(on_host), jax.tree.leaves(on_mesh), strict=True):
        assert got.sharding == want.sharding and got.dtype == want.dtype
        assert jax.devices()[0] not in got.devices()
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    fsdp = [leaf for leaf in jax.tree.leaves(on_host) if leaf.ndim and not leaf.sharding.is_fully_replicated]
    assert fsdp    # some leaves are split over the mesh, not copies
