"""A pretraining config checked for a TPU slice or GPU cluster it does not run on: the real
train and eval steps compiled ahead of time for the target's devices (jax's deviceless AOT,
`jax.experimental.topologies`), on any host, before data or checkpoints are touched.

    python -m roformer.pretrain --config=configs/rotary.py:size=base --compile_only=v5e:4x4

It reports per-device memory (parameters, optimizer state, the step's temporaries) against the
device's, the sharding of every parameter group, each process's share of the batch and of a
checkpoint, and the collectives of the optimised program with the bytes they move per step. A
config that does not fit is refused in one line that says by how much and which setting helps;
a real launch on the hardware runs the same fit check on the step it compiles anyway
(roformer.train.compiled.refuse_unfit_step), before its data pipeline starts.

Targets: a TPU slice as Cloud TPU names it (`v5e:4x4`, `v5p:2x2x4`, `v4:2x2x2`, `v6e:4x4`;
needs libtpu, the `[tpu]` extra, no TPU), or GPUs as `KIND:PER_HOSTxHOSTS` (`h100:8`,
`h100:8x2`; needs roformer.deviceless and the CUDA plugin, no GPU).
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import math
import os
import re
from typing import Iterator

import jax
import numpy as np

from roformer.errors import ConfigError
from roformer.train.compiled import (GIB, StepReport, compile_step, device_bytes, size_text, step_batch,
                                     unfit_message)

# The vendor's HBM per chip (Cloud TPU system architecture pages); a topology whose devices
# are TensorCores (v4 without megacore) shares a chip's memory between its devices.
TPU_CHIP_HBM = {"v4": 32 * GIB, "v5e": 16 * GIB, "v5p": 95 * GIB, "v6e": 32 * GIB}
TPU_INSTALL_HINT = "pip install -e .[tpu] (libtpu; no TPU needed)"


@dataclasses.dataclass(frozen=True)
class Target:
    """Where a run is to go: `platform` "tpu" (kind "v5e", topology "4x4") or "gpu" (kind
    "h100", `per_host` devices on each of `hosts` hosts)."""
    name: str
    platform: str
    kind: str
    topology: str = ""
    per_host: int = 0
    hosts: int = 1


def parse_target(text: str) -> Target:
    """'v5e:4x4' (a TPU slice), 'h100:8' or 'h100:8x2' (GPUs per host x hosts)."""
    text = text.strip().lower()
    tpu = re.fullmatch(r"(v\d+[a-z]*):(\d+(?:x\d+){1,2})", text)
    if tpu:
        if tpu[1] not in TPU_CHIP_HBM:
            raise ConfigError(f"--compile_only={text}: unknown TPU generation {tpu[1]!r}; "
                              f"choose one of {sorted(TPU_CHIP_HBM)}")
        return Target(text, "tpu", tpu[1], topology=tpu[2])
    gpu = re.fullmatch(r"([a-z]\d+[a-z]*):(\d+)(?:x(\d+))?", text)
    if gpu:
        return Target(text, "gpu", gpu[1], per_host=int(gpu[2]), hosts=int(gpu[3] or 1))
    raise ConfigError(f"--compile_only={text}: not a target; give a TPU slice (v5e:4x4, v5p:2x2x4, v4:2x2x2) or "
                      "GPUs per host x hosts (h100:8x2)")


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Silence what native code prints to the process's stderr (libtpu, loaded off a TPU VM,
    warns that it cannot find the TPU's hostnames and accelerator type: true, and harmless
    for compiling). Python exceptions still carry their messages."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def libtpu_available() -> bool:
    try:
        return importlib.util.find_spec("libtpu") is not None
    except (ImportError, ValueError):
        return False


def target_devices(target: Target) -> list:
    """The target's devices, abstract (nothing runs on them), with their process indices."""
    if target.platform == "tpu":
        if not libtpu_available():
            raise ConfigError(f"compiling for a TPU on this host needs libtpu: {TPU_INSTALL_HINT}")
        from jax.experimental import topologies

        # Compiling touches no TPU, so it need not hold libtpu's one-process-per-host lock (a
        # TPU VM's training job may hold it; so may another check on this host).
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        try:
            with quiet_stderr():
                return list(topologies.get_topology_desc(platform="tpu",
                                                         topology_name=f"{target.kind}:{target.topology}").devices)
        except Exception as error:  # noqa: BLE001 - libtpu's own message, on one line
            raise ConfigError(f"libtpu cannot describe {target.name}: "
                              f"{str(error).splitlines()[0] if str(error) else type(error).__name__}") from None
    from roformer import deviceless

    try:
        if target.hosts == 1:
            return list(deviceless.target_devices(target.kind, target.per_host))
        deviceless.target_devices(target.kind)   # the kind and the plugin, each refused in one line
        from jax.experimental import topologies

        return list(topologies.get_topology_desc("gpu", "cuda", target_config=deviceless.gpu_kind(target.kind)
                                                 .target_config(), topology=f"1x{target.hosts}x{target.per_host}")
                    .devices)
    except (ConfigError, RuntimeError, NotImplementedError) as error:
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        hint = ("; on a host without CUDA's libraries, run with JAX_PLATFORMS=cpu"
                if "not implemented for cuda" in first else "")
        raise ConfigError(f"{first}{hint}" if isinstance(error, ConfigError)
                          else f"cannot describe {target.name} to the CUDA plugin: {first}{hint}") from None


def device_memory_bytes(target: Target, devices: list) -> int:
    """Memory of one of the target's devices."""
    if target.platform == "tpu":
        chips = math.prod(int(n) for n in target.topology.split("x"))
        return TPU_CHIP_HBM[target.kind] * chips // len(devices)
    from roformer import deviceless

    # what jax's GPU allocator lets a process use: XLA_PYTHON_CLIENT_MEM_FRACTION, default 0.75
    fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75"))
    return int(deviceless.gpu_kind(target.kind).device_memory_size * fraction)


# ---- compiling the run's steps -----------------------------------------------------------

@dataclasses.dataclass
class ParamGroup:
    path: str            # layers' indices as *
    count: int           # parameters of the model in this group (layers)
    shape: tuple
    logical: tuple
    spec: str            # the PartitionSpec
    device_bytes: int    # one device's share, all the group's parameters


@dataclasses.dataclass
class LaunchReport:
    target: Target
    mesh: dict[str, int]
    layout: object                       # roformer.train.sharding.ProcessLayout
    device_bytes: int
    param_bytes: int                     # per device
    opt_bytes: int                       # per device
    groups: list[ParamGroup]
    checkpoint_bytes: list[int]          # per process
    steps: list[StepReport]
    model: str
    batch: str
    predicted: str | None = None         # the step time a cost model predicts, where one covers the target
    remat: str = ""                      # the model's gradient checkpointing (model.remat)

    @property
    def peak_bytes(self) -> int:
        return max(step.peak_bytes for step in self.steps)


def param_groups(sharded_params, logical) -> list[ParamGroup]:
    """The parameters grouped by path with layer indices as *, each with its sharding."""
    groups: dict[str, ParamGroup] = {}
    flat_logical = dict(jax.tree_util.tree_flatten_with_path(logical, is_leaf=lambda x: isinstance(x, tuple))[0])
    for path, leaf in jax.tree_util.tree_flatten_with_path(sharded_params)[0]:
        keys = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
        name = "/".join("*" if key.isdigit() else key for key in keys)
        size = math.prod(leaf.sharding.shard_shape(tuple(leaf.shape))) * np.dtype(leaf.dtype).itemsize
        group = groups.get(name)
        if group is None:
            groups[name] = ParamGroup(name, 1, tuple(leaf.shape), tuple(flat_logical[path]),
                                      str(leaf.sharding.spec), size)
        else:
            group.count, group.device_bytes = group.count + 1, group.device_bytes + size
    return list(groups.values())


def compile_run(config, target: Target, *, eval_step: bool = True) -> LaunchReport:
    """Compile `config`'s train (and eval) step for `target`, report what they need.

    The vocabulary is data.vocab_size (the tokenizer's target size: the real one is at most
    that), so nothing of the data is read."""
    from roformer.model import backend
    from roformer.model.attention import check_attention_impl
    from roformer.train import bookkeeping, sharding
    from roformer.train.config import TrainConfig
    from roformer.train.loop import build_model_config
    from roformer.train.state import TrainSetup

    tc = TrainConfig.from_section(config.train)
    devices = target_devices(target)
    mesh = sharding.make_mesh(config.mesh, devices=devices)
    layout = sharding.process_layout(mesh, tc.batch_size, tc.grad_accum)
    model_cfg = build_model_config(config.model, vocab_size=int(config.data.vocab_size))
    check_attention_impl(model_cfg, platform=target.platform)
    compiler_options = None
    if target.platform == "gpu":
        from roformer import deviceless

        compiler_options = dict(deviceless.DEFAULT_COMPILER_OPTIONS)
    with backend.targeting(target.platform):
        setup = TrainSetup(model_cfg, *bookkeeping.run_optimizer(tc), mesh, seed=tc.seed,
                           dropout_rng_impl=tc.dropout_rng_impl)
        state, rest = setup.sharded_abstract_state(), setup.sharded_abstract_rest()
        batch = step_batch(config.data, tc.seq_len, tc.batch_size, mesh)
        # made outside the target's mesh: the dropout key is made eagerly, which abstract devices cannot run
        train_step, evaluation = setup.jit_train_step(grad_accum=tc.grad_accum), setup.jit_eval_step()
        reports = []
        with jax.set_mesh(mesh):
            reports.append(compile_step(train_step, state, rest, batch, name="train step",
                                        compiler_options=compiler_options)[1])
            if eval_step:
                reports.append(compile_step(evaluation, state["params"], rest, batch, name="eval step",
                                            compiler_options=compiler_options)[1])
    logical = sharding.param_logical_axes(nnx_params(setup))
    predicted = None
    if target.platform == "gpu":
        from roformer.data import DataConfig
        from roformer.data.pipeline import max_predictions
        from roformer.train import flops

        step_flops = flops.train_flops_per_step(
            model_cfg, batch_size=tc.batch_size, seq_len=tc.seq_len, segmented=config.data.packing == "packed",
            num_predictions=max_predictions(DataConfig.from_mapping(config.data), tc.seq_len))
        predicted = predicted_gpu_step(reports[0].hlo_text, target.kind, step_flops / len(devices), len(devices))
    return LaunchReport(
        target=target, mesh=dict(mesh.shape), layout=layout, device_bytes=device_memory_bytes(target, devices),
        param_bytes=device_bytes(state["params"]), opt_bytes=device_bytes(state["opt_state"]),
        groups=param_groups(state["params"], logical), checkpoint_bytes=sharding.checkpoint_bytes_per_process(state),
        steps=reports, predicted=predicted, remat=model_cfg.remat, model=f"{config.model.size} ({_count(state['params']) / 1e6:.0f}M parameters, "
                             f"{model_cfg.dtype} compute)",
        batch=f"{tc.batch_size} x {tc.seq_len}" + (f", grad_accum {tc.grad_accum}" if tc.grad_accum > 1 else ""))


def predicted_gpu_step(hlo_text: str, kind: str, flops_per_device: float, devices: int) -> str | None:
    """The step time roformer.bench.gpu_cost predicts for one device's program on GPU `kind`
    (None where it has no calibration), with the MFU it implies."""
    from roformer.bench import gpu_cost

    calibration = gpu_cost.CALIBRATIONS.get(kind)
    if calibration is None:
        return None
    prediction = gpu_cost.predict(gpu_cost.kernels(gpu_cost.Program.parse(hlo_text)), calibration)
    text = (f"{prediction.step_s * 1e3:.1f} ms, MFU {prediction.mfu(flops_per_device, calibration.peak_flops):.0%} "
            f"(roformer.bench.gpu_cost: one device's kernels at the rates an {kind} trace calibrated")
    return text + ("; its collectives are not modelled, so a lower bound)" if devices > 1 else ")")


def _count(tree) -> int:
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(tree))


def nnx_params(setup):
    """The setup's abstract parameters as the nnx.State their logical axes are declared on."""
    from flax import nnx

    from roformer.model import RoFormerForMaskedLM

    model = nnx.eval_shape(lambda: RoFormerForMaskedLM(setup.model_cfg, rngs=nnx.Rngs(0)))
    return nnx.state(model, nnx.Param)


# ---- the fit check and the report ------------------------------------------------------------

def check_fits(report: LaunchReport) -> None:
    """ConfigError (one line) when the target's devices cannot hold the compiled steps."""
    train = report.steps[0]
    peak = report.peak_bytes
    message = unfit_message(peak, report.device_bytes, where=f"{report.target.name} ({report.target.kind})",
                            state_bytes=report.param_bytes + report.opt_bytes,
                            temp_bytes=max(s.memory["temp_size_in_bytes"] for s in report.steps),
                            fsdp=report.mesh["fsdp"], remat=report.remat)
    if message:
        raise ConfigError(message + f" [compiled: {train.name} {size_text(train.peak_bytes)}]")


def step_memory_line(step, indent: str, width: int) -> str:
    """A compiled step's memory (its XLA memory analysis) as one report line."""
    m = step.memory
    return (f"{indent}{step.name + ':':<{width}} arguments {size_text(m['argument_size_in_bytes'])}, temporaries "
            f"{size_text(m['temp_size_in_bytes'])}, outputs not donated "
            f"{size_text(m['output_size_in_bytes'] - m['alias_size_in_bytes'])} -> peak {size_text(step.peak_bytes)} "
            f"(compiled in {step.compile_s:.0f}s)")


def fit_line(peak_bytes: int, device_bytes: int) -> str:
    """Whether a peak fits the device's memory, as the report's line."""
    share = peak_bytes / device_bytes
    return (f"  fits: {size_text(peak_bytes)} of {size_text(device_bytes)} ({share:.0%})" if share <= 1
            else f"  DOES NOT FIT: {size_text(peak_bytes)} of {size_text(device_bytes)}")


def format_report(report: LaunchReport) -> str:
    """The report as the command prints it."""
    t, layout = report.target, report.layout
    lines = [f"target {t.name}: {layout.num_processes * layout.devices_per_process} "
             f"{t.platform.upper()} {t.kind} devices, {size_text(report.device_bytes)} each; mesh "
             + " x ".join(f"{k}={v}" for k, v in report.mesh.items()),
             f"model {report.model}; batch {report.batch}",
             f"processes: {layout.describe()}; checkpoint written per process "
             f"{size_text(min(report.checkpoint_bytes))}..{size_text(max(report.checkpoint_bytes))}",
             "memory per device:",
             f"  parameters       {size_text(report.param_bytes)}",
             f"  optimizer state  {size_text(report.opt_bytes)}"]
    lines += [step_memory_line(step, "  ", 16) for step in report.steps]
    lines.append(fit_line(report.peak_bytes, report.device_bytes))
    lines.append("parameter sharding (path, shape, logical axes -> mesh axes, per device):")
    for g in report.groups:
        times = f" x{g.count}" if g.count > 1 else ""
        lines.append(f"  {g.path}{times}  {list(g.shape)}  {g.logical} -> {g.spec}  {size_text(g.device_bytes)}")
    lines.append(f"  (all {len(report.groups)} groups: {size_text(report.param_bytes)} per device)")
    for step in report.steps:
        lines.append(f"collectives of the {step.name} (per device per step; ring traffic):")
        if not step.collectives:
            lines.append("  none")
        for c in step.collectives.values():
            lines.append(f"  {c.kind:<18} {c.count:>4} ops, arrays {size_text(c.array_bytes)}, sent {size_text(c.sent_bytes)}")
    lines.append(f"predicted step time: {report.predicted or 'not covered (no cost model for ' + t.name + ')'}")
    return "\n".join(lines)


def check_target(config, target_name: str) -> str:
    """The report of `config` compiled for `target_name` (the --compile_only command), after
    refusing, in one line, a config whose steps do not fit the target's devices. A staged run
    (train.phases) is checked phase by phase, each with its own batch shape."""
    from roformer.train.config import parse_phases
    from roformer.train.loop import phase_config

    target = parse_target(target_name)
    if not str(config.train.phases or "").strip():
        report = compile_run(config, target)
        check_fits(report)
        return format_report(report)
    phases = parse_phases(config.train)
    texts = []
    for index, phase in enumerate(phases):
        report = compile_run(phase_config(config, phase, phases), target)
        try:
            check_fits(report)
        except ConfigError as error:
            raise ConfigError(f"phase {index + 1} of {len(phases)}: {error}") from None
        texts.append(f"== phase {index + 1} of {len(phases)} ==\n{format_report(report)}")
    return "\n".join(texts)
