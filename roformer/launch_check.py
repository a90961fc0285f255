"""A pretraining config checked for a TPU slice or GPU cluster it does not run on: the real
train and eval steps compiled ahead of time for the target's devices (jax's deviceless AOT,
`jax.experimental.topologies`), on any host, before data or checkpoints are touched.

    python -m roformer.pretrain --config=configs/rotary.py:size=base --compile_only=v5e:4x4

It reports per-device memory (parameters, optimizer state, the step's temporaries) against the
device's, the sharding of every parameter group, each process's share of the batch and of a
checkpoint, and the collectives of the optimised program with the bytes they move per step. A
config that does not fit is refused in one line that says by how much and which setting helps;
a real launch on the hardware runs the same fit check on the step it compiles anyway
(`refuse_unfit_step`), before the state is made.

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
import time
from typing import Iterator

import jax
import numpy as np

from roformer.errors import ConfigError

GIB = 2 ** 30
# The vendor's HBM per chip (Cloud TPU system architecture pages); a topology whose devices
# are TensorCores (v4 without megacore) shares a chip's memory between its devices.
TPU_CHIP_HBM = {"v4": 32 * GIB, "v5e": 16 * GIB, "v5p": 95 * GIB, "v6e": 32 * GIB}
TPU_INSTALL_HINT = "pip install -e .[tpu] (libtpu; no TPU needed)"
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


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
    try:
        from roformer import deviceless
    except ImportError:
        raise ConfigError(f"--compile_only={target.name}: compiling for a GPU needs roformer.deviceless, which this "
                          "version lacks; TPU targets (v5e:4x4, ...) work") from None
    if target.hosts > 1:
        raise ConfigError(f"--compile_only={target.name}: GPUs of several hosts are not described here yet; "
                          f"check one host's {target.per_host} ({target.kind}:{target.per_host})")
    return list(deviceless.target_devices(target.kind, target.per_host))


def device_memory_bytes(target: Target, devices: list) -> int:
    """Memory of one of the target's devices."""
    if target.platform == "tpu":
        chips = math.prod(int(n) for n in target.topology.split("x"))
        return TPU_CHIP_HBM[target.kind] * chips // len(devices)
    from roformer import deviceless

    return deviceless.gpu_kind(target.kind).device_memory_size


# ---- the optimised program's collectives ---------------------------------------------

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
                "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([\d,]*)\]")
_INSTRUCTION = re.compile(r"=\s*(.*?)\s(" + "|".join(COLLECTIVES) + r")(-start)?\(")


@dataclasses.dataclass
class Collective:
    """The collectives of one kind in a step: how many, the bytes of their arrays per device
    (all-reduce's operand, all-gather's result, reduce-scatter's input, all-to-all's and
    collective-permute's operand), and what a ring algorithm sends per device for them."""
    kind: str
    count: int = 0
    array_bytes: int = 0
    sent_bytes: float = 0.0


def _group_size(line: str) -> int:
    """Devices in each replica group of a collective's HLO line (1 when it names none)."""
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)
    if iota:
        return int(iota[2])
    named = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if named:
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", named[1]))
        return math.prod(int(sizes[a]) for a in re.findall(r"'([^']+)'", named[2]) if a in sizes) or 1
    explicit = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
    if explicit:
        return len(explicit[1].split(","))
    pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", line)
    return 2 if pairs else 1


def collectives(hlo_text: str) -> dict[str, Collective]:
    """The collectives of an optimised HLO module, by kind (COLLECTIVES); an async pair counts
    once (its -start). An op inside a loop body (train.grad_accum > 1) counts once."""
    found = {kind: Collective(kind) for kind in COLLECTIVES}
    for line in hlo_text.splitlines():
        match = _INSTRUCTION.search(line)
        if not match:
            continue
        kind, shapes = match[2], [math.prod(int(d) for d in dims.split(",") if d) * _DTYPE_BYTES[dtype]
                                  for dtype, dims in _ARRAY.findall(match[1])]
        if not shapes:
            continue
        result, n = max(shapes), _group_size(line)
        if kind == "reduce-scatter" and not match[3]:
            result *= n   # its result is one device's part of the input
        sent = {"all-reduce": 2 * result * (n - 1) / n, "all-gather": result * (n - 1) / n,
                "reduce-scatter": result * (n - 1) / n, "all-to-all": result * (n - 1) / n,
                "collective-permute": result}[kind]
        entry = found[kind]
        entry.count, entry.array_bytes, entry.sent_bytes = entry.count + 1, entry.array_bytes + result, \
            entry.sent_bytes + sent
    return {kind: entry for kind, entry in found.items() if entry.count}


# ---- compiling the run's steps -----------------------------------------------------------

@dataclasses.dataclass
class StepReport:
    name: str
    memory: dict[str, int]            # XLA's memory_analysis, bytes per device
    collectives: dict[str, Collective]
    compile_s: float

    @property
    def peak_bytes(self) -> int:
        """Arguments, temporaries and the outputs that do not reuse a donated argument."""
        m = self.memory
        return m["argument_size_in_bytes"] + m["temp_size_in_bytes"] + m["output_size_in_bytes"] \
            - m["alias_size_in_bytes"]


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

    @property
    def peak_bytes(self) -> int:
        return max(step.peak_bytes for step in self.steps)


def _memory(compiled) -> dict[str, int]:
    analysis = compiled.memory_analysis()
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
              "generated_code_size_in_bytes")
    return {field: int(getattr(analysis, field)) for field in fields}


def device_bytes(tree) -> int:
    """One device's bytes of a tree of sharded ShapeDtypeStructs (the first device's share)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shard = leaf.sharding.shard_shape(tuple(leaf.shape))
        total += math.prod(shard) * np.dtype(leaf.dtype).itemsize
    return total


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


def step_batch(data_cfg, seq_len: int, batch_size: int, mesh) -> dict:
    """The batch a step takes, as shapes on the mesh (the data pipeline's format)."""
    from roformer.data import DataConfig
    from roformer.data.pipeline import batch_format
    from roformer.train import sharding

    placed = sharding.batch_sharding(mesh)
    return {name: jax.ShapeDtypeStruct(spec.shape, spec.dtype, sharding=placed)
            for name, spec in batch_format(DataConfig.from_mapping(data_cfg), seq_len=seq_len,
                                           batch_size=batch_size).items()}


def compile_step(jitted, *args, name: str, compiler_options: dict | None = None) -> tuple[object, StepReport]:
    started = time.perf_counter()
    compiled = jitted.lower(*args).compile(compiler_options=compiler_options)
    report = StepReport(name, _memory(compiled), collectives(compiled.as_text()), time.perf_counter() - started)
    return compiled, report


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
    return LaunchReport(
        target=target, mesh=dict(mesh.shape), layout=layout, device_bytes=device_memory_bytes(target, devices),
        param_bytes=device_bytes(state["params"]), opt_bytes=device_bytes(state["opt_state"]),
        groups=param_groups(state["params"], logical), checkpoint_bytes=sharding.checkpoint_bytes_per_process(state),
        steps=reports, model=f"{config.model.size} ({_count(state['params']) / 1e6:.0f}M parameters, "
                             f"{model_cfg.dtype} compute)",
        batch=f"{tc.batch_size} x {tc.seq_len}" + (f", grad_accum {tc.grad_accum}" if tc.grad_accum > 1 else ""))


def _count(tree) -> int:
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(tree))


def nnx_params(setup):
    """The setup's abstract parameters as the nnx.State their logical axes are declared on."""
    from flax import nnx

    from roformer.model import RoFormerForMaskedLM

    model = nnx.eval_shape(lambda: RoFormerForMaskedLM(setup.model_cfg, rngs=nnx.Rngs(0)))
    return nnx.state(model, nnx.Param)


# ---- the fit check and the report ------------------------------------------------------------

def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB / 10 else f"{n / 2 ** 20:.1f} MiB"


def unfit_message(peak: int, limit: int, *, where: str, state_bytes: int, temp_bytes: int, fsdp: int) -> str | None:
    """One line refusing a step of `peak` bytes per device on devices of `limit`, or None when it
    fits: by how much, and which settings lower it (the batch's activations and temporaries, or
    the parameters and optimizer state that more FSDP shards split further)."""
    if peak <= limit:
        return None
    knobs = [(temp_bytes, f"lower train.batch_size or raise train.grad_accum (the step's activations and "
                          f"temporaries are {_gib(temp_bytes)} per device)"),
             (state_bytes, f"raise mesh.fsdp (now {fsdp}; parameters and optimizer state are {_gib(state_bytes)} "
                           "per device)")]
    knobs.sort(key=lambda k: -k[0])
    return (f"does not fit: the train step needs {_gib(peak)} per device on {where}, which has {_gib(limit)} "
            f"({_gib(peak - limit)} over); " + ", or ".join(text for _, text in knobs))


def check_fits(report: LaunchReport) -> None:
    """ConfigError (one line) when the target's devices cannot hold the compiled steps."""
    train = report.steps[0]
    peak = report.peak_bytes
    message = unfit_message(peak, report.device_bytes, where=f"{report.target.name} ({report.target.kind})",
                            state_bytes=report.param_bytes + report.opt_bytes,
                            temp_bytes=max(s.memory["temp_size_in_bytes"] for s in report.steps),
                            fsdp=report.mesh["fsdp"])
    if message:
        raise ConfigError(message + f" [compiled: {train.name} {_gib(train.peak_bytes)}]")


def device_memory_limit() -> int | None:
    """The memory one of this process's devices lets a program use (its allocator's limit), or
    None where the device reports none (a CPU)."""
    return (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")


def refuse_unfit_step(jitted, args: tuple, *, fsdp: int, state_bytes: int, limit: int | None = None):
    """A real launch's fit check: compile `jitted` for `args` (ShapeDtypeStructs on the run's
    mesh; the same jitted function the loop then calls, so the program is compiled once) and
    refuse it in one line (ConfigError) when one device cannot hold it. `limit`: the device's
    memory, default what it reports (bytes_limit); none reported (a CPU): nothing is done."""
    limit = device_memory_limit() if limit is None else limit
    if not limit:
        return None
    compiled, report = compile_step(jitted, *args, name="train step")
    message = unfit_message(report.peak_bytes, int(limit), where=f"this {jax.local_devices()[0].device_kind}",
                            state_bytes=state_bytes, temp_bytes=report.memory["temp_size_in_bytes"], fsdp=fsdp)
    if message:
        raise ConfigError(message)
    return compiled


def format_report(report: LaunchReport, *, predicted: str | None = None) -> str:
    """The report as the command prints it."""
    t, layout = report.target, report.layout
    lines = [f"target {t.name}: {layout.num_processes * layout.devices_per_process} "
             f"{t.platform.upper()} {t.kind} devices, {_gib(report.device_bytes)} each; mesh "
             + " x ".join(f"{k}={v}" for k, v in report.mesh.items()),
             f"model {report.model}; batch {report.batch}",
             f"processes: {layout.describe()}; checkpoint written per process "
             f"{_gib(min(report.checkpoint_bytes))}..{_gib(max(report.checkpoint_bytes))}",
             "memory per device:",
             f"  parameters       {_gib(report.param_bytes)}",
             f"  optimizer state  {_gib(report.opt_bytes)}"]
    for step in report.steps:
        m = step.memory
        lines.append(f"  {step.name + ':':<16} arguments {_gib(m['argument_size_in_bytes'])}, temporaries "
                     f"{_gib(m['temp_size_in_bytes'])}, outputs not donated "
                     f"{_gib(m['output_size_in_bytes'] - m['alias_size_in_bytes'])} -> peak {_gib(step.peak_bytes)} "
                     f"(compiled in {step.compile_s:.0f}s)")
    share = report.peak_bytes / report.device_bytes
    lines.append(f"  fits: {_gib(report.peak_bytes)} of {_gib(report.device_bytes)} ({share:.0%})"
                 if share <= 1 else f"  DOES NOT FIT: {_gib(report.peak_bytes)} of {_gib(report.device_bytes)}")
    lines.append("parameter sharding (path, shape, logical axes -> mesh axes, per device):")
    for g in report.groups:
        times = f" x{g.count}" if g.count > 1 else ""
        lines.append(f"  {g.path}{times}  {list(g.shape)}  {g.logical} -> {g.spec}  {_gib(g.device_bytes)}")
    lines.append(f"  (all {len(report.groups)} groups: {_gib(report.param_bytes)} per device)")
    for step in report.steps:
        lines.append(f"collectives of the {step.name} (per device per step; ring traffic):")
        if not step.collectives:
            lines.append("  none")
        for c in step.collectives.values():
            lines.append(f"  {c.kind:<18} {c.count:>4} ops, arrays {_gib(c.array_bytes)}, sent {_gib(c.sent_bytes)}")
    lines.append(f"predicted step time: {predicted or 'not covered (no cost model for ' + t.name + ')'}")
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
