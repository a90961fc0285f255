"""Device mesh, logical-axis sharding rules for parameters, and batch placement.

Every parameter declares logical axis names ("embed", "mlp", "heads", "vocab", ...)
where the model creates it (roformer.model.axes); a rules table maps those names to mesh
axes (MaxText style), so the same model runs data-parallel, FSDP or tensor-parallel
by changing only the `mesh` config.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from roformer.errors import ConfigError
from roformer.settings import check

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")   # the batch dimension is split over both

# logical axis -> mesh axis (None = replicated). FSDP shards the model width of
# every matrix; tensor parallelism splits heads, the MLP width and the vocabulary.
LOGICAL_AXIS_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", BATCH_AXES),
    ("embed", "fsdp"),
    ("embedding", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("num_heads", "tensor"),
    ("vocab", "tensor"),
    ("kv", None),
    ("layers", None),
    ("norm", None),
)


def mesh_shape(mesh_cfg: Mapping[str, int], num_devices: int) -> tuple[int, ...]:
    """Resolve the (data, fsdp, tensor) sizes; one -1 entry takes the remaining devices."""
    sizes = [int(mesh_cfg[name]) for name in MESH_AXES]
    if sum(s == -1 for s in sizes) > 1:
        raise ConfigError(f"mesh: at most one axis may be -1, got {dict(zip(MESH_AXES, sizes))}")
    if any(s == 0 or s < -1 for s in sizes):
        raise ConfigError(f"mesh: axis sizes must be positive or -1, got {dict(zip(MESH_AXES, sizes))}")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if num_devices % known:
            raise ConfigError(f"mesh: {num_devices} devices are not divisible by the fixed axes "
                              f"{dict(zip(MESH_AXES, sizes))}")
        sizes[sizes.index(-1)] = num_devices // known
    if math.prod(sizes) != num_devices:
        raise ConfigError(f"mesh: {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices, "
                          f"but {num_devices} are available")
    return tuple(sizes)


def make_mesh(mesh_cfg: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Mesh over `devices`, default all devices or the first `mesh_cfg["num_devices"]`
    (> 0; single-process only, e.g. to benchmark on part of a host)."""
    if devices is None:
        devices = jax.devices()
        limit = mesh_cfg.get("num_devices", 0) or 0
        check("mesh.num_devices", limit, "int >= 0")
        if limit > 0:
            if jax.process_count() > 1 or limit > len(devices):
                raise ConfigError(f"mesh.num_devices={limit} needs a single process with at least that "
                                  f"many devices ({jax.process_count()} processes, {len(devices)} devices)")
            devices = devices[:limit]
    devices = list(devices)
    shape = mesh_shape(mesh_cfg, len(devices))
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES),
                         devices=devices)


def param_logical_axes(params: nnx.State) -> dict:
    """Logical-axis tuples for `params` (an nnx.State of Params, concrete or abstract),
    as a pure nested dict shaped like `nnx.to_pure_dict(params)`: the names each
    parameter declared where it was created (flax `out_sharding` metadata).

    A parameter without declared axes, without one name per dimension, or with a
    name the rules do not know is an error naming its path: nothing is sharded by guess."""
    known = {name for name, _ in LOGICAL_AXIS_RULES}
    declared = {}
    for path, var in nnx.to_flat_state(params):
        names = var.get_metadata().get("out_sharding")
        where = "/".join(str(p) for p in path)
        if names is None:
            raise ValueError(f"parameter {where} declares no logical axes; create it with "
                             "roformer.model.axes.declare(...) metadata")
        names, shape = tuple(names), tuple(var.shape)
        if len(names) != len(shape):
            raise ValueError(f"parameter {where} of shape {shape} declares {len(names)} logical axes {names}")
        unknown = [n for n in names if n is not None and n not in known]
        if unknown:
            raise ValueError(f"parameter {where} declares logical axes {unknown} that "
                             f"LOGICAL_AXIS_RULES does not map")
        declared[tuple(path)] = names

    def axes(path, _):
        return declared[tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)]

    return jax.tree_util.tree_map_with_path(axes, nnx.to_pure_dict(params))


def logical_to_spec(logical: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                    rules=LOGICAL_AXIS_RULES) -> P:
    """Map logical names to a PartitionSpec; a dimension not divisible by its mesh
    axes, or a mesh axis already used by an earlier dimension, stays replicated."""
    table = dict(rules)
    used: set[str] = set()
    spec = []
    for name, dim in zip(logical, shape):
        axes = table.get(name) if name is not None else None
        axes_tuple = (axes,) if isinstance(axes, str) else tuple(axes or ())
        axes_tuple = tuple(a for a in axes_tuple if mesh.shape[a] > 1)
        size = math.prod(mesh.shape[a] for a in axes_tuple)
        if not axes_tuple or dim % size or used.intersection(axes_tuple):
            spec.append(None)
            continue
        used.update(axes_tuple)
        spec.append(axes_tuple[0] if len(axes_tuple) == 1 else axes_tuple)
    return P(*spec)


def state_shardings(abstract_state, logical_tree, mesh: Mesh):
    """NamedSharding tree for a state given its logical-axis tree (same structure)."""
    def one(leaf, logical):
        return NamedSharding(mesh, logical_to_spec(logical, leaf.shape, mesh))
    # the logical tree is flattened up to the state's leaves, so each tuple arrives whole
    return jax.tree.map(one, abstract_state, logical_tree)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(BATCH_AXES))


def global_batch(local_batch: Mapping[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """Assemble per-process numpy batches (each process its own rows, the same count) into
    global arrays sharded over (data, fsdp). The global shape is stated, so a mesh whose batch
    shards span processes fails here instead of taking one process's rows as the batch."""
    sharding = batch_sharding(mesh)
    processes = jax.process_count()
    return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v),
                                                      (np.shape(v)[0] * processes, *np.shape(v)[1:]))
            for k, v in local_batch.items()}


@dataclasses.dataclass(frozen=True)
class ProcessLayout:
    """How a global batch and the training state split over the processes of a job on `mesh`:
    what each process feeds, and what it writes of a checkpoint. Computed from the mesh's
    devices and their process indices alone, so the same function describes a real launch and
    a target compiled for ahead of the hardware (roformer.launch_check)."""
    num_processes: int
    devices_per_process: int
    batch_size: int                      # global
    rows_per_process: int                # what each process's input pipeline makes per step
    # process -> the [start, stop) blocks of the global batch its devices hold, in order: its
    # rows fill them one after the other (jax.make_array_from_process_local_data)
    rows: tuple[tuple[tuple[int, int], ...], ...]

    def describe(self) -> str:
        return (f"{self.num_processes} process(es) x {self.devices_per_process} device(s); each process feeds "
                f"{self.rows_per_process} of the {self.batch_size} rows of a step")


def mesh_process_count(mesh: Mesh) -> int:
    return len({d.process_index for d in mesh.devices.flat})


def process_layout(mesh: Mesh, batch_size: int, grad_accum: int = 1, processes: int | None = None) -> ProcessLayout:
    """The per-process split of a `batch_size` batch on `mesh` (ProcessLayout), after refusing
    a batch or a mesh that cannot be fed that way (ConfigError): every process's devices must
    hold the same number of distinct rows, since each makes its own rows (`global_batch`), and a
    batch shard spanning processes would take one process's rows as the whole batch, silently. `processes`: the job's process count (a real launch's
    jax.process_count()), default the processes the mesh's devices name; where they name fewer
    (one process standing in for several, in a test) only the counts are checked."""
    named = mesh_process_count(mesh)
    processes = named if processes is None else processes
    batch_shards = mesh.shape["data"] * mesh.shape["fsdp"]
    if batch_size % processes:
        raise ConfigError(f"train.batch_size={batch_size} must divide over {processes} processes")
    if batch_shards % processes:
        raise ConfigError(f"mesh data*fsdp={batch_shards} must be a multiple of the {processes} "
                          f"processes, which each feed their own rows of the batch (got mesh {dict(mesh.shape)}); "
                          "give the batch axes more of the devices, e.g. mesh.data=-1")
    if batch_size % (batch_shards * grad_accum):
        raise ConfigError(f"train.batch_size={batch_size} must be divisible by mesh data*fsdp="
                          f"{batch_shards} times train.grad_accum={grad_accum}")
    per_process = batch_size // processes
    if named != processes:
        return ProcessLayout(processes, mesh.devices.size // processes, batch_size, per_process,
                             tuple(((p * per_process, (p + 1) * per_process),) for p in range(processes)))
    addressed: dict[int, set[int]] = {}
    for device, index in batch_sharding(mesh).devices_indices_map((batch_size,)).items():
        rows = range(*index[0].indices(batch_size))
        addressed.setdefault(device.process_index, set()).update(rows)
    blocks = []
    for process in sorted(addressed):
        rows = sorted(addressed[process])
        if len(rows) != per_process:
            raise ConfigError(f"mesh {dict(mesh.shape)}: process {process}'s devices hold {len(rows)} rows of the "
                              f"batch, where each of the {processes} processes feeds {per_process}; give the "
                              "batch axes (data, fsdp) the devices of every process, e.g. mesh.data=-1")
        starts = [r for i, r in enumerate(rows) if i == 0 or rows[i - 1] != r - 1]
        stops = [r + 1 for i, r in enumerate(rows) if i == len(rows) - 1 or rows[i + 1] != r + 1]
        blocks.append(tuple(zip(starts, stops)))
    devices_per_process = mesh.devices.size // processes
    return ProcessLayout(processes, devices_per_process, batch_size, per_process, tuple(blocks))


def checkpoint_bytes_per_process(sharded_state) -> list[int]:
    """Bytes of a checkpoint of `sharded_state` (ShapeDtypeStructs or arrays with shardings)
    each process writes: orbax writes every distinct shard once, from the first device that
    holds it (replica 0), so a replicated array is written by process 0's device."""
    written: dict[int, int] = {}
    for leaf in jax.tree.leaves(sharded_state):
        itemsize = np.dtype(leaf.dtype).itemsize
        seen = set()
        for device, index in leaf.sharding.devices_indices_map(tuple(leaf.shape)).items():
            key = tuple((s.start, s.stop) for s in index)
            if key in seen:
                continue
            seen.add(key)
            size = math.prod(len(range(*s.indices(d))) for s, d in zip(index, leaf.shape)) * itemsize
            written[device.process_index] = written.get(device.process_index, 0) + size
        for device in leaf.sharding.device_set:
            written.setdefault(device.process_index, 0)
    return [written[p] for p in sorted(written)]
