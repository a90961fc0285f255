"""The train step compiled for a GPU on a host that has none (jax's deviceless AOT).

jax can compile a program for devices it cannot reach: `jax.experimental.topologies` builds
abstract devices from a target description (for an NVIDIA GPU, XLA's GpuTargetConfigProto:
SM count, clock, memory bandwidth, compute capability, cuDNN version), and a step lowered with
inputs sharded on them compiles through the GPU pipeline with the same fusions, kernels and
byte counts that the device itself would run. Nothing executes: the result is the optimised
program's text and XLA's memory analysis. It needs the CUDA plugin wheels (`pip install -e
.[cuda13]`, Python 3.12+) and no GPU.

    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, devices=target_devices("h100"))
    setup = TrainSetup(model_config, tx, schedule, mesh)  # roformer.train.state, as training builds it
    compiled = compile_train_step(setup, batch)           # batch: arrays or shapes of one step's inputs
    compiled.hlo_text, compiled.memory                    # the program, its bytes

What a GPU run picks at run time is absent: no autotuning (so `--xla_gpu_enable_triton_gemm=false`
keeps every GEMM a cuBLAS call, as the autotuner mostly chooses on Hopper for these shapes), no
measured timings. `python -m roformer.bench cost` builds the benchmarks' workload this way and
turns the program into a predicted step time.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import time
from collections.abc import Mapping, Sequence

import jax
import numpy as np

from roformer.errors import ConfigError

CUDA_PLUGIN = "jax_plugins.xla_cuda13"
INSTALL_HINT = "pip install -e .[cuda13] (Python 3.12+; no GPU needed)"


@dataclasses.dataclass(frozen=True)
class GpuKind:
    """What the compiler needs to know of one GPU model (XLA's gpu_device_info), plus the
    vendor's dense bf16 peak for MFU."""
    description: str            # device_kind as jax reports it on the device
    core_count: int             # SMs
    memory_bandwidth: float     # bytes/s, the vendor's figure
    device_memory_size: int     # bytes
    l2_cache_size: int = 52_428_800
    clock_rate_ghz: float = 1.98
    compute_capability: tuple[int, int] = (9, 0)
    cudnn_version: tuple[int, int] = (9, 19)

    def target_config(self) -> str:
        """The GpuTargetConfigProto in text form (xla/stream_executor/device_description.proto;
        the Hopper fields as XLA's own xla/tools/hlo_opt/gpu_specs/h100_sxm.txtpb gives them)."""
        major, minor = self.compute_capability
        return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: {self.core_count}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(self.memory_bandwidth)}
  l2_cache_size: {self.l2_cache_size}
  clock_rate_ghz: {self.clock_rate_ghz}
  device_memory_size: {self.device_memory_size}
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: {self.cudnn_version[0]} minor: {self.cudnn_version[1]} }}
device_description_str: "{self.description}"
"""


GPU_KINDS: dict[str, GpuKind] = {
    "h100": GpuKind("NVIDIA H100 80GB HBM3", core_count=132, memory_bandwidth=3.35232e12,
                    device_memory_size=84_978_434_048),
    "h200": GpuKind("NVIDIA H200", core_count=132, memory_bandwidth=4.8e12,
                    device_memory_size=150_754_820_096),
}


def gpu_kind(name: str) -> GpuKind:
    try:
        return GPU_KINDS[name.lower()]
    except KeyError:
        raise ConfigError(f"unknown GPU kind {name!r}; choose one of {sorted(GPU_KINDS)}") from None


def plugin_available() -> bool:
    """Whether the CUDA plugin that compiles for a GPU is installed (no GPU needed)."""
    try:
        return importlib.util.find_spec(CUDA_PLUGIN) is not None
    except ModuleNotFoundError:
        return False


def target_devices(kind: str, count: int = 1) -> list:
    """`count` abstract devices of GPU `kind` ("h100", "h200") on one host: compile for them
    (lower with inputs sharded on a mesh of them, under jax.set_mesh); nothing runs."""
    spec = gpu_kind(kind)
    if not plugin_available():
        raise ConfigError(f"compiling for a GPU on this host needs the CUDA plugin ({CUDA_PLUGIN}): {INSTALL_HINT}")
    from jax.experimental import topologies

    try:
        topology = topologies.get_topology_desc("gpu", "cuda", target_config=spec.target_config(),
                                                topology=f"1x1x{count}")
    except Exception as error:   # noqa: BLE001 (the plugin's own message, on one line)
        raise ConfigError(f"cannot describe {count} x {kind} to the CUDA plugin: "
                          f"{str(error).splitlines()[0] if str(error) else type(error).__name__}") from None
    return list(topology.devices)


# No autotuner runs without a device: XLA would then make every GEMM a Triton fusion of its
# default tiling. cuBLAS is what the autotuner picks for most of this step's products on Hopper.
DEFAULT_COMPILER_OPTIONS = {"xla_gpu_enable_triton_gemm": False}


@dataclasses.dataclass
class CompiledStep:
    hlo_text: str                     # the optimised program
    memory: dict[str, int]            # XLA's memory_analysis, bytes
    compile_s: float
    forms: tuple[str, ...]            # the backend forms the step was traced with


def _memory(compiled) -> dict[str, int]:
    analysis = compiled.memory_analysis()
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
              "generated_code_size_in_bytes", "peak_memory_in_bytes")
    return {field: int(getattr(analysis, field)) for field in fields if hasattr(analysis, field)} if analysis else {}


def compile_train_step(setup, batch: Mapping[str, object], *, forms: Sequence[str] | None = None,
                       compiler_options: Mapping[str, object] | None = None) -> CompiledStep:
    """The train step of `setup` (roformer.train.state.TrainSetup, made with a mesh of
    `target_devices`) compiled for those devices, traced as a GPU's step
    (roformer.model.backend.targeting) with `forms` (None: the GPU's default set). `batch`:
    the batch's arrays or shapes (anything with .shape and .dtype), one entry per input.
    `compiler_options`: XLA debug options (`xla_gpu_...`) over DEFAULT_COMPILER_OPTIONS."""
    from roformer.model import backend
    from roformer.train import sharding

    batch_sharding = sharding.batch_sharding(setup.mesh)
    abstract_batch = {name: jax.ShapeDtypeStruct(np.shape(value), np.dtype(value.dtype), sharding=batch_sharding)
                      for name, value in batch.items()}
    chosen_forms = backend.using_forms(forms) if forms is not None else contextlib.nullcontext()
    with backend.targeting("gpu"), chosen_forms:
        chosen = backend.active_forms()
        # Jitted outside the target's mesh: its eager random-key ops cannot run on abstract devices.
        step = setup.jit_train_step()
        started = time.perf_counter()
        with jax.set_mesh(setup.mesh):
            lowered = step.lower(setup.sharded_abstract_state(), setup.sharded_abstract_rest(), abstract_batch)
            compiled = lowered.compile(compiler_options={**DEFAULT_COMPILER_OPTIONS, **(compiler_options or {})})
    return CompiledStep(compiled.as_text(), _memory(compiled), time.perf_counter() - started, tuple(sorted(chosen)))
