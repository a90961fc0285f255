"""Multi-host start-up (`jax.distributed.initialize` from the `distributed` config) and
the host-side exchange between processes."""
from __future__ import annotations

import json
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from roformer.errors import ConfigError


def initialize_distributed(dist_cfg) -> None:
    """Join the multi-process job described by `dist_cfg`, once per process.

    Nothing happens for a single-process run. `enabled=True` with no address lets
    JAX auto-detect the cluster (TPU pods, SLURM); an explicit `coordinator_address`
    also needs `num_processes` and `process_id` (manual clusters, local tests).
    """
    explicit = bool(dist_cfg.coordinator_address)
    if not (dist_cfg.enabled or explicit) or jax.distributed.is_initialized():
        return
    kwargs = {}
    if explicit:
        if dist_cfg.num_processes < 1 or dist_cfg.process_id < 0:
            raise ConfigError("distributed.coordinator_address is set, so distributed.num_processes "
                              "and distributed.process_id must be set too "
                              f"(got {dist_cfg.num_processes}, {dist_cfg.process_id})")
        kwargs = dict(coordinator_address=dist_cfg.coordinator_address,
                      num_processes=dist_cfg.num_processes, process_id=dist_cfg.process_id)
    if dist_cfg.local_device_ids:
        kwargs["local_device_ids"] = [int(i) for i in str(dist_cfg.local_device_ids).split(",")]
    jax.distributed.initialize(**kwargs)


def allgather_json(obj: Any) -> list[Any]:
    """Every process's JSON-serialisable `obj`, in process order (a collective: every
    process calls it). One process: [obj], without communication."""
    if jax.process_count() == 1:
        return [obj]
    encoded = np.frombuffer(json.dumps(obj).encode(), dtype=np.uint8)
    lengths = multihost_utils.process_allgather(np.array([encoded.size], np.int32))
    padded = np.zeros(int(lengths.max()), np.uint8)
    padded[:encoded.size] = encoded
    gathered = multihost_utils.process_allgather(padded)
    return [json.loads(bytes(row[:n]).decode()) for row, n in zip(gathered, lengths.reshape(-1))]
