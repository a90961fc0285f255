"""Keep freed host memory in the process, so XLA:CPU's per-step buffers are not faulted in anew.

On CPU, every execution of a compiled step allocates its temporaries (hundreds of MB for a
mini model at 4,096 tokens) from the C heap and frees them at the end. glibc's malloc hands
blocks that large to the kernel and back: allocations above its mmap threshold, and any that
a thread's own arena cannot hold, are fresh `mmap`s, and freed ones are unmapped or trimmed,
so each step page-faults and zero-fills all of that memory again (measured in
docs/results/archive/2026-11-25-host-memory-cpu.md).

`retain_host_memory()` sets glibc's malloc to serve every thread from the main heap
(M_ARENA_MAX 1), never with mmap (M_MMAP_MAX 0), and never to give the heap's free top back
(M_TRIM_THRESHOLD at its maximum): after the first steps, a step's buffers are memory the
process already owns, and its resident memory stays at its peak (which heap fragmentation
makes a few times what a step holds otherwise; docs/pretraining.md). The same settings as
    GLIBC_TUNABLES=glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647
and, like them, they bind arenas not created yet: call it before jax runs anything (the
command lines do so first thing). It does nothing where jax may run on an accelerator (an
accelerator plugin is installed and JAX_PLATFORMS does not say cpu): there, host buffers are
not the step's working memory, and one arena would serialise the compiler's threads'
allocations. ROFORMER_RETAIN_HOST_MEMORY=0 turns it off, =1 applies it regardless.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import importlib.metadata
import importlib.util
import os
import platform

ENV = "ROFORMER_RETAIN_HOST_MEMORY"
# mallopt parameters from glibc's <malloc.h>.
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
INT_MAX = 2**31 - 1


def retain_host_memory() -> bool:
    """Apply the settings above; True if they were applied."""
    choice = os.environ.get(ENV, "")
    if choice == "0" or platform.libc_ver()[0] != "glibc":
        return False
    if choice != "1" and not cpu_only():
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    settings = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, INT_MAX))
    # mallopt returns 1 on success, 0 for a value it refuses.
    return all(libc.mallopt(ctypes.c_int(param), ctypes.c_int(value)) == 1 for param, value in settings)


def cpu_only() -> bool:
    """Whether jax in this process can only use the CPU: JAX_PLATFORMS lists cpu alone, or it
    is unset and no accelerator plugin is installed (how jax finds them: a `jax_plugins` entry
    point or namespace package, e.g. CUDA's; or libtpu)."""
    platforms = os.environ.get("JAX_PLATFORMS", "").strip()
    if platforms:
        return {p.strip() for p in platforms.split(",") if p.strip()} == {"cpu"}
    if importlib.metadata.entry_points(group="jax_plugins"):
        return False
    return all(importlib.util.find_spec(name) is None for name in ("jax_plugins", "libtpu"))
