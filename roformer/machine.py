"""What this process runs on: the cores it may use, the host processor, and a matmul to
time a device's peak with (the MFU denominator where no vendor table has one: CPUs).

The one place these are read or measured (the benchmarks, the ablation report, the data
builders, the vmapped seeds' batch workers). jax is imported only in the functions that need a device, so
the launcher of side-by-side runs asks for cores before jax loads.
"""
from __future__ import annotations

import datetime
import os
import platform
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any


def available_cores() -> set[int]:
    """The cores this process may run on (its CPU affinity; all of them where the OS cannot
    say, e.g. macOS)."""
    if hasattr(os, "sched_getaffinity"):
        return os.sched_getaffinity(0)
    return set(range(os.cpu_count() or 1))


def cores_available() -> int:
    """How many cores this process may run on (`available_cores`)."""
    return len(available_cores())


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
    import jax

    device = jax.devices()[0]
    return {
        "platform": device.platform,
        "device_kind": device.device_kind,
        "device_count": jax.device_count(),
        "cpu_count": cores_available(),
        "processor": platform.processor() or platform.machine(),
        "cpu": cpu_identity(),
        "jax": jax.__version__,
        "utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
    }


def matmul_probe(n: int, dtype: str = "float32") -> tuple[Callable[[], Any], float]:
    """A zero-argument jitted n x n matmul on fixed inputs, and its FLOPs (2 n^3).

    Timed alongside a workload, it gives the matmul peak of this device under the
    same load at the same moment: the MFU denominator on machines without a vendor
    peak (CPU), measured rather than assumed.
    """
    import jax

    a = jax.random.normal(jax.random.key(0), (n, n), dtype=dtype)
    matmul = jax.jit(lambda x: x @ x)
    return (lambda: matmul(a)), 2.0 * n**3
