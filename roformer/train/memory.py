"""Before the first step: will one training step fit in memory at all?

A batch far too large for the machine (`train.batch_size=10**7`, a typo) would otherwise be
found by the kernel's OOM killer or the device allocator after the workdir is written, with
no word of why. `check_step_memory` counts a floor of what one step must hold, from the same
analytic shapes as the FLOP count (roformer.train.flops): the host batch, the activations the
backward pass keeps (each layer's input, attention output and MLP hidden activations of every
token of a micro-batch, the logits of the masked slots) and the parameters with their
gradients and Adam moments. It refuses the run, in one line saying by how much it is short and
which setting helps, only when that floor exceeds the memory there is (the host's available
memory; an accelerator's own, where it reports one): a step it lets through may still not fit,
one it refuses cannot.
"""
from __future__ import annotations

import math
from pathlib import Path

import jax

from roformer.errors import ConfigError

GIB = 2**30
INT32 = 4


def available_host_bytes() -> int | None:
    """The memory the host can give without swapping (Linux: MemAvailable); None elsewhere."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def device_bytes_limit(device: jax.Device) -> int | None:
    """An accelerator's memory for arrays (None for a CPU, or a device that does not say)."""
    if device.platform == "cpu":
        return None
    try:
        stats = device.memory_stats() or {}
    except Exception:  # noqa: BLE001 - a backend without memory statistics
        return None
    return stats.get("bytes_limit") or None


def step_floor(model_cfg, *, batch_size: int, seq_len: int, num_predictions: int, grad_accum: int,
               num_devices: int, num_processes: int = 1) -> dict[str, float]:
    """Bytes one step holds at least: "batch" (this host's int32 arrays of the batch),
    "activations" and "state" (per device: a device holds at least its share of each)."""
    h, layers, inter = model_cfg.hidden_size, model_cfg.num_layers, model_cfg.intermediate_size
    emb = model_cfg.embedding_size or h
    compute = 2 if model_cfg.dtype == "bfloat16" else 4
    rows = batch_size / grad_accum   # one micro-batch's rows are alive at a time
    kept_per_token = layers * (2 * h + inter)   # a layer's input, attention output, MLP hidden
    activations = rows * (seq_len * kept_per_token * compute + num_predictions * model_cfg.vocab_size * 4)
    params = model_cfg.vocab_size * emb + layers * (4 * h * h + 2 * h * inter)
    return {"batch": batch_size / num_processes * (2 * seq_len + 3 * num_predictions) * INT32,
            "activations": activations / num_devices, "state": 4 * params * 4 / num_devices}


def check_step_memory(model_cfg, *, batch_size: int, seq_len: int, num_predictions: int, grad_accum: int,
                      num_devices: int, num_processes: int = 1, device: jax.Device | None = None,
                      host_bytes: int | None = None, seeds: int = 1) -> None:
    """Refuse (ConfigError, one line) a step whose memory floor (`step_floor`) exceeds what the
    host (`host_bytes`, default its available memory) or the device holds; see the module doc.
    `seeds`: runs stepped together (roformer.train.seeds), each with its own batch and state."""
    device = device or jax.devices()[0]
    floor = {part: seeds * size for part, size in step_floor(
        model_cfg, batch_size=batch_size, seq_len=seq_len, num_predictions=num_predictions, grad_accum=grad_accum,
        num_devices=num_devices, num_processes=num_processes).items()}
    host = available_host_bytes() if host_bytes is None else host_bytes
    limit = device_bytes_limit(device)
    if limit is None:   # the devices are the host's CPU cores: all of it is host memory
        where, have = "host memory", host
        need = floor["batch"] + (floor["activations"] + floor["state"]) * min(num_devices, jax.local_device_count())
    else:
        where, have, need = f"{device.device_kind} memory", limit, floor["activations"] + floor["state"]
        if host is not None and floor["batch"] > host:
            where, have, need = "host memory", host, floor["batch"]
    if have is None or need <= have:
        return
    helps = ("lower train.batch_size" if where == "host memory" and limit is not None else
             "lower train.batch_size, or raise train.grad_accum (each step then runs in that many micro-batches)")
    raise ConfigError(
        f"train.batch_size={batch_size} at train.seq_len={seq_len}{f' for {seeds} seeds' if seeds > 1 else ''} "
        f"cannot fit: one step needs at least "
        f"{need / GIB:,.1f} GiB of {where} ({_parts(floor)}), {math.ceil(need / have):,}x the "
        f"{have / GIB:,.1f} GiB available; {helps}")


def _parts(floor: dict[str, float]) -> str:
    names = {"batch": "the batch", "activations": "activations", "state": "parameters and optimizer state"}
    return ", ".join(f"{names[k]} {v / GIB:,.1f} GiB" for k, v in floor.items())
