"""Shared benchmark helpers: blocked timing, alternating A/B runs, matmul peak, tables, JSON.

The CPU this project is developed on is shared and noisy, so comparisons are
measured as alternating rounds (A B A B ...) and summarised by the median of the
per-round ratios with their min and max, never by one long run of each side.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax

from roformer.files import write_text_atomic


def time_call(fn: Callable[[], Any], iters: int) -> float:
    """Median seconds of `iters` calls of fn, each waited for with block_until_ready."""
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# Calls of a train step before any is timed. On CPU the process's heap reaches the step's
# peak only after a few steps (roformer.host_memory keeps it there); until then each step
# page-faults its buffers in.
TRAIN_STEP_WARMUP = 5


def warm_up(fns: Mapping[str, Callable[[], Any]], warmup: int) -> None:
    """Compile and run every variant `warmup` times so no round pays for compilation."""
    for fn in fns.values():
        for _ in range(warmup):
            jax.block_until_ready(fn())


def alternate(
    fns: Mapping[str, Callable[[], Any]], *, rounds: int, iters: int, warmup: int = 2
) -> dict[str, list[float]]:
    """Time the variants in alternating rounds; returns name -> per-round seconds.

    Each round runs every variant once (median of `iters` calls), so round i of A and
    round i of B saw nearly the same machine load. The order rotates by one each round
    (A B C, B C A, ...): with a fixed order, the `none` position control (strictly less
    work than `learned`) timed 2-8% slower than `learned`, which always ran first.
    """
    warm_up(fns, warmup)
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(time_call(fns[name], iters))
    return times


def ratio_stats(numerator: Sequence[float], denominator: Sequence[float]) -> dict[str, float]:
    """Median, min and max of the per-round ratios numerator[i] / denominator[i]."""
    if len(numerator) != len(denominator) or not numerator:
        raise ValueError("ratio_stats needs two equally long, non-empty lists of round times")
    ratios = [a / b for a, b in zip(numerator, denominator)]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def matmul_probe(n: int, dtype: str = "float32") -> tuple[Callable[[], Any], float]:
    """A zero-argument jitted n x n matmul on fixed inputs, and its FLOPs (2 n^3).

    Timed alongside a workload, it gives the matmul peak of this device under the
    same load at the same moment: the MFU denominator on machines without a vendor
    peak (CPU), measured rather than assumed.
    """
    a = jax.random.normal(jax.random.key(0), (n, n), dtype=dtype)
    matmul = jax.jit(lambda x: x @ x)
    return (lambda: matmul(a)), 2.0 * n**3


# The vector extensions that decide XLA:CPU's matmul and elementwise rates (x86, then Arm),
# reported in this order. A virtual machine of one name can land on hosts with and without
# AVX-512, whose matmul rates differ widely (docs/results/2026-11-26-many-runs-avx2-cpu.md).
VECTOR_FLAGS = ("avx", "avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "asimd", "sve")


def cpu_identity(cpuinfo: str | None = None) -> dict[str, Any]:
    """The host processor as /proc/cpuinfo names it (model name, family and model numbers,
    `VECTOR_FLAGS` present); empty where there is no /proc/cpuinfo (macOS)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return {}
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():   # the first processor's block is enough
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    identity = {"model_name": fields.get("model name", ""), "family": fields.get("cpu family", ""),
                "model": fields.get("model", ""), "vector": " ".join(f for f in VECTOR_FLAGS if f in flags)}
    return {k: v for k, v in identity.items() if v}


def describe_cpu(identity: Mapping[str, Any]) -> str:
    """`cpu_identity` in one phrase, e.g. 'AMD EPYC, family 25 model 1, avx avx2 fma'."""
    parts = [identity.get("model_name", "")]
    if identity.get("family"):
        parts.append(f"family {identity['family']} model {identity.get('model', '?')}")
    parts.append(identity.get("vector", ""))
    return ", ".join(p for p in parts if p)


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on, stored next to them in every JSON."""
    device = jax.devices()[0]
    return {
        "platform": device.platform,
        "device_kind": device.device_kind,
        "device_count": jax.device_count(),
        "cpu_count": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "cpu": cpu_identity(),
        "jax": jax.__version__,
        "utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
    }


def write_json(path: Path, result: Mapping[str, Any]) -> None:
    """A benchmark's result as indented JSON (values JSON lacks, such as paths, as text)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(result, indent=2, default=str) + "\n")


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None) -> str:
    """Markdown table of the rows; floats get 3 significant digits (4 for ratios near 1)."""
    if not rows:
        return "(no rows)"
    columns = list(columns or rows[0].keys())

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.0f}"
        return "" if value is None else str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def failure(error: Exception) -> str:
    """'Type: first line of the message' (at most 200 characters of it), for a benchmark's
    note on what failed."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:200] if text else ''}"
