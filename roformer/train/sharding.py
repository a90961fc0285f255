"""Device mesh, logical-axis sharding rules for parameters, and batch placement.

Every parameter declares logical axis names ("embed", "mlp", "heads", "vocab", ...)
where the model creates it (roformer.model.axes); a rules table maps those names to mesh
axes (MaxText style), so the same model runs data-parallel, FSDP or tensor-parallel
by changing only the `mesh` config.
"""
from __future__ import annotations

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
