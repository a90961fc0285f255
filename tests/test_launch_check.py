"""A config checked for a TPU slice or GPUs on a host without them (roformer.launch_check):
targets, the optimised program's collectives, the one-line refusals, and, where libtpu is
installed, the real steps compiled for a TPU topology with the per-process layout a launch
on it computes."""
import dataclasses

import jax
import numpy as np
import pytest

from roformer.configs import tiny
from roformer import deviceless, launch_check
from roformer.errors import ConfigError
from roformer.train import compiled, loop, sharding

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
needs_plugin = pytest.mark.skipif(not deviceless.plugin_available(),
                                  reason="compiling for a GPU needs the CUDA plugin (the [cuda13] extra)")
needs_libtpu = pytest.mark.skipif(not launch_check.libtpu_available(),
                                  reason="compiling for a TPU needs libtpu (the [tpu] extra)")


def micro_config(**mesh):
    config = tiny.get_config()
    config.model.update(hidden_size=32, intermediate_size=64, num_heads=2)
    config.data.vocab_size = 512
    config.train.update(batch_size=16, seq_len=32)
    config.mesh.update(mesh)
    return config


def test_targets_parse_and_a_bad_one_is_refused_in_one_line():
    assert launch_check.parse_target("v5e:4x4") == launch_check.Target("v5e:4x4", "tpu", "v5e", topology="4x4")
    assert launch_check.parse_target("V5P:2x2x4").topology == "2x2x4"
    gpu = launch_check.parse_target("h100:8x2")
    assert (gpu.platform, gpu.kind, gpu.per_host, gpu.hosts) == ("gpu", "h100", 8, 2)
    assert launch_check.parse_target("h200:8").hosts == 1
    for bad, said in (("v5e", "not a target"), ("v9z:2x2", "unknown TPU generation"), ("tpu-v4-32", "not a target")):
        with pytest.raises(ConfigError, match=f"^--compile_only=[^\n]*{said}[^\n]*$"):
            launch_check.parse_target(bad)


HLO = """
  %all-gather.6 = bf16[1024,1024]{1,0} all-gather(%convert), channel_id=2, replica_groups=mesh['axis_0'=4,'axis_1'=4] {'axis_1'}, dimensions={0}
  %all-reduce = f32[256]{0} all-reduce(%fusion), channel_id=3, replica_groups=[1,16]<=[16], to_apply=%add
  %ars = (f32[64]{0}, f32[64]{0}) all-reduce-start(%x), replica_groups={{0,1},{2,3}}, to_apply=%add
  %ard = f32[64]{0} all-reduce-done(%ars)
  %rs = f32[32]{0} reduce-scatter(%y), replica_groups=[2,8]<=[16], dimensions={0}, to_apply=%add
  %cp = s32[10]{0} collective-permute(%z), source_target_pairs={{0,1},{1,0}}
  %combined = (f32[100]{0}, bf16[50,2]{1,0}) all-reduce(%a, %b), replica_groups=[1,16]<=[16], to_apply=%add
  %ags = (bf16[8,4]{1,0}, bf16[32,4]{1,0}, u32[], u32[]) all-gather-start(%c), replica_groups=[4,4]<=[16], dimensions={0}
"""


def test_collectives_are_counted_with_the_bytes_they_move():
    found = compiled.collectives(HLO)
    assert set(found) == {"all-gather", "all-reduce", "reduce-scatter", "collective-permute"}
    gather = found["all-gather"]   # the plain one, and the async one by its result (not its operand)
    assert (gather.count, gather.array_bytes) == (2, 2 * 2**20 + 256)
    assert gather.sent_bytes == (2 * 2**20 + 256) * 3 / 4
    reduce = found["all-reduce"]   # a plain and a combined one over 16 devices, a combined async one over 2
    assert (reduce.count, reduce.array_bytes) == (3, 1024 + 600 + 512)
    assert reduce.sent_bytes == 2 * (1024 + 600) * 15 / 16 + 2 * 512 * 1 / 2
    scatter = found["reduce-scatter"]   # its input is 8 results of 128 bytes
    assert (scatter.array_bytes, scatter.sent_bytes) == (1024, 1024 * 7 / 8)
    assert found["collective-permute"].sent_bytes == 40


def test_a_step_that_does_not_fit_is_refused_in_one_line_naming_the_knob():
    gib = compiled.GIB
    assert compiled.unfit_message(10 * gib, 16 * gib, where="x", state_bytes=gib, temp_bytes=gib, fsdp=1) is None
    message = compiled.unfit_message(20 * gib, 16 * gib, where="v5e:4x4 (v5e)", state_bytes=3 * gib,
                                         temp_bytes=15 * gib, fsdp=1)
    assert "\n" not in message
    assert message.startswith("does not fit: the train step needs 20.00 GiB per device on v5e:4x4 (v5e), which has "
                              "16.00 GiB (4.00 GiB over); lower train.batch_size")
    state_heavy = compiled.unfit_message(20 * gib, 16 * gib, where="x", state_bytes=12 * gib,
                                             temp_bytes=2 * gib, fsdp=2)
    assert "over); raise mesh.fsdp (now 2; parameters and optimizer state are 12.00 GiB per device)" in state_heavy
    without_remat = compiled.unfit_message(20 * gib, 16 * gib, where="x", state_bytes=gib, temp_bytes=15 * gib,
                                           remat="none")
    assert "raise train.grad_accum or set model.remat=full instead of none (the train step's activations" in without_remat
    assert "model.remat" not in compiled.unfit_message(20 * gib, 16 * gib, where="x", state_bytes=gib,
                                                       temp_bytes=15 * gib, remat="full")


def test_a_gpu_target_without_its_compiler_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(deviceless, "plugin_available", lambda: False)
    for target in ("h100:8", "h100:8x2"):
        with pytest.raises(ConfigError, match=r"^[^\n]*needs the CUDA plugin[^\n]*$"):
            launch_check.target_devices(launch_check.parse_target(target))


def test_a_tpu_target_without_libtpu_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(launch_check, "libtpu_available", lambda: False)
    with pytest.raises(ConfigError, match=r"^compiling for a TPU on this host needs libtpu: pip install -e \.\[tpu\]"):
        launch_check.check_target(micro_config(), "v5e:2x2")


def test_a_real_launch_refuses_a_step_its_device_cannot_hold_and_runs_the_program_it_checked():
    """refuse_unfit_step on this host's devices: the compiled step against a limit it exceeds is
    one line; against one it fits, the program compiled for the check is what the first call
    runs (no second compilation)."""
    from roformer.train import bookkeeping
    from roformer.train.config import TrainConfig
    from roformer.train.loop import build_model_config
    from roformer.train.state import TrainSetup

    config = micro_config(num_devices=1)
    tc = TrainConfig.from_section(config.train)
    mesh = sharding.make_mesh(config.mesh)
    setup = TrainSetup(build_model_config(config.model, vocab_size=512), *bookkeeping.run_optimizer(tc), mesh)
    step = setup.jit_train_step()
    structs = setup.sharded_abstract_state()
    args = (structs, setup.sharded_abstract_rest(), compiled.step_batch(config.data, 32, 16, mesh))
    state_bytes = compiled.device_bytes(structs)
    compiles = []
    listener = lambda event, duration, **_: compiles.append(event)   # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        with jax.set_mesh(mesh):
            with pytest.raises(ConfigError, match=r"^does not fit: the train step needs [^\n]* per device on this "
                                                  r"cpu, which has 1.0 MiB \([^\n]* over\); [^\n]*$"):
                compiled.refuse_unfit_step(step, args, fsdp=1, state_bytes=state_bytes, limit=2**20)
            assert compiled.refuse_unfit_step(step, args, fsdp=1, state_bytes=state_bytes, limit=2**40)
            assert BACKEND_COMPILE in compiles   # the check compiled the step
            state, rest = setup.init_state(), setup.init_rest()
            batch = {k: np.zeros(v.shape, v.dtype) for k, v in args[2].items()}
            compiles.clear()
            step(state, rest, sharding.global_batch(batch, mesh))
            assert BACKEND_COMPILE not in compiles   # ... and its first call ran that program
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def untouchable(what):
    def touched(*args, **kwargs):
        raise AssertionError(f"{what} was touched")
    return touched


@pytest.mark.parametrize("vocab", ["", "bert-base-uncased-vocab.txt"])
def test_a_real_launch_refuses_an_unfit_step_before_the_data_or_a_checkpoint_is_touched(tmp_path, monkeypatch,
                                                                                       shared_data, vocab):
    """On a device that reports 1 MiB, the launch fails with the one line before its data
    pipeline (a cache build on every host) starts or its checkpoints are opened; with a given
    vocabulary file, for that vocabulary's model."""
    from roformer.train import bookkeeping, train_and_evaluate

    config = micro_config(num_devices=1)
    if vocab:
        config.data.vocab = str(shared_data / "vocab" / vocab)
    built = []
    build = loop.build_model_config
    monkeypatch.setattr(loop, "build_model_config", lambda *a, **k: built.append(k["vocab_size"]) or build(*a, **k))
    monkeypatch.setattr(compiled, "device_memory_limit", lambda: 2**20)
    monkeypatch.setattr(bookkeeping, "run_data", untouchable("the data pipeline"))
    monkeypatch.setattr(bookkeeping, "make_pretrain_data", untouchable("the data pipeline"))
    monkeypatch.setattr(bookkeeping, "open_run", untouchable("the checkpoints"))
    monkeypatch.setattr(bookkeeping, "restore_or_init", untouchable("the checkpoints"))
    with pytest.raises(ConfigError, match=r"^does not fit: the train step needs [^\n]* per device on this cpu, which "
                                          r"has 1.0 MiB \([^\n]* over\); [^\n]*$"):
        train_and_evaluate(config, tmp_path / "run")
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert built == [30522 if vocab else 512]


@pytest.mark.slow
def test_a_real_launch_that_fits_runs_the_step_it_checked_before_the_data(tmp_path, monkeypatch, wiki_cache):
    """The fit check runs once, before the data, and the loop keeps the step it compiled."""
    from helpers.train import make_config
    from roformer.train import bookkeeping, train_and_evaluate

    order, checked = [], []
    run_data, refuse = bookkeeping.run_data, compiled.refuse_unfit_step

    def data(*args, **kwargs):
        order.append("data")
        return run_data(*args, **kwargs)

    def check(jitted, *args, **kwargs):
        order.append("fit check")
        checked.append(jitted)
        return refuse(jitted, *args, **kwargs)
    monkeypatch.setattr(compiled, "device_memory_limit", lambda: 2**40)
    monkeypatch.setattr(bookkeeping, "run_data", data)
    monkeypatch.setattr(compiled, "refuse_unfit_step", check)
    summary = train_and_evaluate(make_config(wiki_cache, **{"train.steps": 2}), tmp_path / "run")
    assert summary["final_step"] == 2
    # the tokenizer reaches data.vocab_size on this corpus, so the model checked is the run's
    assert order == ["fit check", "data"] and len(checked) == 1


def test_compile_only_compiles_the_steps_without_touching_data_or_checkpoints(monkeypatch):
    """The whole check on a target of this host's four CPU devices (standing in for a TPU's,
    which need libtpu) with every data and checkpoint entry point made to fail if touched."""
    from roformer.data import pipeline
    from roformer.train import bookkeeping

    monkeypatch.setattr(launch_check, "target_devices", lambda target: jax.devices()[:4])
    monkeypatch.setattr(launch_check, "device_memory_bytes", lambda target, devices: 2**30)
    for module, name in ((bookkeeping, "run_data"), (bookkeeping, "make_pretrain_data"),
                         (pipeline, "make_pretrain_data"), (pipeline, "make_source"), (pipeline, "load_tokenizer"),
                         (bookkeeping, "open_run"), (bookkeeping, "restore_or_init")):
        monkeypatch.setattr(module, name, untouchable(f"{module.__name__}.{name}"))
    report = launch_check.compile_run(micro_config(data=-1, fsdp=2), launch_check.Target("cpu:4", "cpu", "cpu"))
    assert report.mesh == {"data": 2, "fsdp": 2, "tensor": 1} and [s.name for s in report.steps] == [
        "train step", "eval step"]
    assert "all-gather" in report.steps[0].collectives   # FSDP gathers the parameters
    launch_check.check_fits(report)
    assert "fits: " in launch_check.format_report(report)


# ---- with libtpu: the real steps compiled for TPU topologies ----------------------------------

@needs_libtpu
@pytest.mark.slow
def test_compile_only_for_a_small_tpu_slice_reports_memory_sharding_and_collectives():
    report = launch_check.compile_run(micro_config(data=-1, fsdp=2), launch_check.parse_target("v5e:2x2"))
    assert report.mesh == {"data": 2, "fsdp": 2, "tensor": 1}
    assert report.device_bytes == 16 * compiled.GIB
    train, evaluation = report.steps
    assert train.memory["temp_size_in_bytes"] > 0 and train.peak_bytes >= report.param_bytes + report.opt_bytes
    assert "all-gather" in train.collectives and "all-reduce" in train.collectives   # FSDP gathers, DP reduces
    kernel = next(g for g in report.groups if g.path.endswith("query/kernel"))
    assert (kernel.logical, kernel.spec) == (("embed", "heads"), "P('fsdp', None)")
    text = launch_check.format_report(report)
    assert "fits:" in text and "collectives of the train step" in text and "not covered" in text
    launch_check.check_fits(report)
    with pytest.raises(ConfigError, match=r"^does not fit: the train step needs [^\n]* on v5e:2x2 \(v5e\)[^\n]*$"):
        launch_check.check_fits(dataclasses.replace(report, device_bytes=report.peak_bytes // 2))


@needs_libtpu
def test_multi_host_layout_is_what_a_launch_on_the_topology_computes(monkeypatch):
    """v5e:8x8: 64 devices of 16 hosts. The layout computed here matches what the launch's own
    code computes on those devices: its mesh (loop._make_mesh), each process's rows of the
    batch as jax places them, and the per-process batch its input pipeline is built with."""
    from roformer.train import bookkeeping, loop
    from roformer.train.config import TrainConfig

    devices = launch_check.target_devices(launch_check.parse_target("v5e:8x8"))
    config = micro_config(data=-1, fsdp=4)
    config.train.batch_size = 256
    tc = TrainConfig.from_section(config.train)
    layout = sharding.process_layout(sharding.make_mesh(config.mesh, devices=devices), tc.batch_size)
    assert (layout.num_processes, layout.devices_per_process, layout.rows_per_process) == (16, 4, 16)

    monkeypatch.setattr(jax, "devices", lambda *a: devices)
    monkeypatch.setattr(jax, "process_count", lambda: 16)
    mesh = loop._make_mesh(config.mesh, tc)   # what a launch on the slice runs
    assert dict(mesh.shape) == {"data": 16, "fsdp": 4, "tensor": 1}
    for process, blocks in enumerate(layout.rows):
        held = {r for d, idx in sharding.batch_sharding(mesh).devices_indices_map((256,)).items()
                if d.process_index == process for r in range(*idx[0].indices(256))}
        assert sorted(held) == [r for start, stop in blocks for r in range(start, stop)]
        assert len(held) == layout.rows_per_process
    seen = {}

    def pipeline(data_cfg, *, batch_size, process_index, process_count, **_):
        seen.update(batch_size=batch_size, process_count=process_count)
        raise StopIteration
    monkeypatch.setattr(bookkeeping, "make_pretrain_data", pipeline)
    with pytest.raises(StopIteration):
        bookkeeping.run_data(config.data, tc)
    assert seen == {"batch_size": layout.rows_per_process, "process_count": layout.num_processes}

    # a checkpoint: every distinct shard once, FSDP's shards from every host
    from roformer.train.state import TrainSetup
    from roformer.train.loop import build_model_config
    setup = TrainSetup(build_model_config(config.model, vocab_size=512), *bookkeeping.run_optimizer(tc),
                       sharding.make_mesh(config.mesh, devices=devices))
    state = setup.sharded_abstract_state()
    written = sharding.checkpoint_bytes_per_process(state)
    total = sum(int(np.prod(leaf.shape)) * leaf.dtype.itemsize for leaf in jax.tree.leaves(state))
    assert len(written) == 16 and sum(written) == total
    assert sum(w > 0 for w in written) > 1   # not process 0 alone


@needs_libtpu
def test_a_mesh_a_multi_host_slice_cannot_feed_is_refused():
    devices = launch_check.target_devices(launch_check.parse_target("v5e:4x4"))   # 4 hosts x 4
    with pytest.raises(ConfigError, match=r"mesh data\*fsdp=2 must be a multiple of the 4 processes"):
        sharding.process_layout(sharding.make_mesh({"data": 2, "fsdp": 1, "tensor": -1}, devices=devices), 16)
    with pytest.raises(ConfigError, match="must divide over 4 processes"):
        sharding.process_layout(sharding.make_mesh({"data": -1, "fsdp": 1, "tensor": 1}, devices=devices), 18)


@pytest.mark.slow
@needs_plugin
def test_compile_only_for_gpus_of_two_hosts_reports_layout_and_a_predicted_step():
    report = launch_check.compile_run(micro_config(data=-1, fsdp=2), launch_check.parse_target("h100:2x2"))
    assert report.mesh == {"data": 2, "fsdp": 2, "tensor": 1}
    assert (report.layout.num_processes, report.layout.rows_per_process) == (2, 8)
    assert report.device_bytes == int(0.75 * 84_978_434_048)   # the allocator's default share
    assert report.steps[0].collectives and report.predicted.endswith("so a lower bound)")
    assert "predicted step time: " + report.predicted in launch_check.format_report(report)
