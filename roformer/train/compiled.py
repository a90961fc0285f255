"""What a step compiled for its devices needs there: memory per device (XLA's analysis of
the compiled program), the collectives of the optimised program with the bytes they move, and
the one-line refusal of a step one device cannot hold, with the setting that helps. A real
launch checks its train step this way before making the state (roformer.train.loop); a config
checked for hardware it does not run on uses the same pieces (roformer.launch_check)."""
from __future__ import annotations

import dataclasses
import logging
import math
import re
import time

import jax
import numpy as np

from roformer.errors import ConfigError

log = logging.getLogger("roformer.train")

GIB = 2 ** 30
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


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
        # a combined op moves a tuple of arrays; an async all-gather's or permute's start holds its
        # operands, then its results (then scalar contexts, left out)
        kind, shapes = match[2], [math.prod(int(d) for d in dims.split(",")) * _DTYPE_BYTES[dtype]
                                  for dtype, dims in _ARRAY.findall(match[1]) if dims]
        if not shapes:
            continue
        if match[3] and kind in ("all-gather", "collective-permute"):
            shapes = shapes[len(shapes) // 2:]
        result, n = sum(shapes), _group_size(line)
        if kind == "reduce-scatter" and not match[3]:
            result *= n   # its result is one device's part of the input
        sent = {"all-reduce": 2 * result * (n - 1) / n, "all-gather": result * (n - 1) / n,
                "reduce-scatter": result * (n - 1) / n, "all-to-all": result * (n - 1) / n,
                "collective-permute": result}[kind]
        entry = found[kind]
        entry.count, entry.array_bytes, entry.sent_bytes = entry.count + 1, entry.array_bytes + result, \
            entry.sent_bytes + sent
    return {kind: entry for kind, entry in found.items() if entry.count}


@dataclasses.dataclass
class StepReport:
    name: str
    memory: dict[str, int]            # XLA's memory_analysis, bytes per device
    collectives: dict[str, Collective]
    compile_s: float
    hlo_text: str = dataclasses.field(default="", repr=False)   # the optimised program

    @property
    def peak_bytes(self) -> int:
        """Arguments, temporaries and the outputs that do not reuse a donated argument."""
        m = self.memory
        return m["argument_size_in_bytes"] + m["temp_size_in_bytes"] + m["output_size_in_bytes"] \
            - m["alias_size_in_bytes"]


def memory_analysis(compiled) -> dict[str, int]:
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
    return compile_lowered(jitted.lower(*args), name=name, compiler_options=compiler_options, started=started)


def compile_lowered(lowered, *, name: str, compiler_options: dict | None = None,
                    started: float | None = None) -> tuple[object, StepReport]:
    """Compile a lowered program and report what it needs per device (from `started`, the
    time its tracing began, when given)."""
    started = time.perf_counter() if started is None else started
    compiled = lowered.compile(compiler_options=compiler_options)
    text = compiled.as_text()
    report = StepReport(name, memory_analysis(compiled), collectives(text), time.perf_counter() - started, text)
    return compiled, report


def size_text(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB / 10 else f"{n / 2 ** 20:.1f} MiB"


def unfit_message(peak: int, limit: int, *, where: str, state_bytes: int, temp_bytes: int, fsdp: int = 1,
                  remat: str = "", step: str = "train step", temp_knob: str = "", state_knob: str = "") -> str | None:
    """One line refusing a step of `peak` bytes per device on devices of `limit`, or None when it
    fits: by how much, and which settings lower it, the larger share first (the batch's
    activations and temporaries, which gradient checkpointing also cuts where `remat` is not
    "full" already, or the parameters and optimizer state that more FSDP shards split further).
    `temp_knob`, `state_knob`: another program's settings for the two (GLUE's)."""
    if peak <= limit:
        return None
    temp_knob = temp_knob or "lower train.batch_size or raise train.grad_accum"
    if remat and remat != "full":
        temp_knob += f" or set model.remat=full instead of {remat}"
    state_knob = state_knob or f"raise mesh.fsdp (now {fsdp};"
    knobs = [(temp_bytes, f"{temp_knob} (the {step}'s activations and temporaries are {size_text(temp_bytes)} "
                          "per device)"),
             (state_bytes, f"{state_knob}{' ' if state_knob.endswith(';') else ' ('}parameters and optimizer state "
                           f"are {size_text(state_bytes)} per device)")]
    knobs.sort(key=lambda k: -k[0])
    return (f"does not fit: the {step} needs {size_text(peak)} per device on {where}, which has {size_text(limit)} "
            f"({size_text(peak - limit)} over); " + ", or ".join(text for _, text in knobs))


def device_memory_limit() -> int | None:
    """The memory one of this process's devices lets a program use (its allocator's limit), or
    None where the device reports none (a CPU)."""
    return (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")


def refuse_unfit_step(jitted, args: tuple, *, fsdp: int, state_bytes: int, limit: int | None = None,
                      remat: str = ""):
    """A real launch's fit check: compile `jitted` for `args` (ShapeDtypeStructs on the run's
    mesh; the same jitted function the loop then calls, so the program is compiled once) and
    refuse it in one line (ConfigError) when one device cannot hold it. `limit`: the device's
    memory, default what it reports (bytes_limit); none reported (a CPU): nothing is done."""
    limit = device_memory_limit() if limit is None else limit
    if not limit:
        return None
    log.info("compiling the train step to check it fits this device's %s ...", size_text(int(limit)))
    compiled, report = compile_step(jitted, *args, name="train step")
    log.info("compiled the train step in %.1fs: it needs %s per device", report.compile_s, size_text(report.peak_bytes))
    message = unfit_message(report.peak_bytes, int(limit), where=f"this {jax.local_devices()[0].device_kind}",
                            state_bytes=state_bytes, temp_bytes=report.memory["temp_size_in_bytes"], fsdp=fsdp,
                            remat=remat)
    if message:
        raise ConfigError(message)
    return compiled
