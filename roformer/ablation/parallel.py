"""Several small runs at once on one CPU host, each in a process of its own.

At the reference comparison's size a train step leaves a core idle much of the time (per-op
overhead, products too small to share well over two threads), so a 2-core host trains more
runs per hour as two processes than as one (docs/performance.md, `python -m roformer.bench
runs`). Each process gets XLA:CPU's one-core setting (its products run on the calling thread
instead of being handed to a thread pool) and is left free to run on any core: pinned to a
core of its own (`sched_setaffinity`, which `enter_slot` also applies when asked), a
process cannot move off a core that another program is using, and on a shared host the
pinned runs measured slower than unpinned ones. Every process calls `retain_host_memory()`
itself, as every command does, and is killed when the process that started it dies
(`PR_SET_PDEATHSIG`), so a kill -9 of the ablation leaves no run behind holding its workdir.
The process applies both itself (`enter_slot`), first thing: a `preexec_fn` would run Python
in a fork of a multithreaded parent (jax's), which can deadlock.

`python -m roformer.ablate --config.parallel=K` runs its (scheme, seed) runs K at a time
this way (roformer.ablation.runner starts them); `python -m roformer.ablation.job JOB.json`
is the process one such run executes in. This module imports nothing of the ablation's, so
the config's validation, the runner and the benchmarks can all use it.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
from pathlib import Path

from roformer.errors import ConfigError
from roformer.machine import available_cores

# XLA:CPU runs a product on the thread that runs the program instead of its thread pool.
SINGLE_CORE_XLA_FLAGS = "--xla_cpu_multi_thread_eigen=false"
PR_SET_PDEATHSIG = 1


def core_slots(parallel: int) -> list[list[int]]:
    """The available cores dealt into `parallel` groups as even as they go (consecutive ids
    together: hyper-thread siblings are usually not, so this does not try to keep them
    apart)."""
    cores = sorted(available_cores())
    if not 1 <= parallel <= len(cores):
        raise ConfigError(f"give 1 to {len(cores)} runs at once (a core or more for each): this process "
                         f"may use {len(cores)} cores")
    return [cores[len(cores) * i // parallel: len(cores) * (i + 1) // parallel] for i in range(parallel)]


# How a run's process learns its cores and the process it must not outlive (it applies
# them itself, first thing: a fork of the multithreaded parent may run no Python before exec).
CORES_ENV = "ROFORMER_RUN_CORES"
PARENT_ENV = "ROFORMER_RUN_PARENT"


# jax's persistent compilation cache, as the runs' processes share it: programs that took at
# least this long to compile are written, and a size limit turns on jax's file lock, so that
# no process reads an entry another is still writing.
COMPILE_CACHE_MIN_SECONDS = 0.2
COMPILE_CACHE_MAX_BYTES = 1 << 30


def compile_cache_settings(directory: Path) -> dict[str, object]:
    """jax's persistent-cache settings (environment names) that keep compiled programs in
    `directory`; {} when the caller keeps a JAX_COMPILATION_CACHE_DIR of their own, and the
    caller's own minimum compile time or size limit stays."""
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return {}
    defaults = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": COMPILE_CACHE_MIN_SECONDS,
                "JAX_COMPILATION_CACHE_MAX_SIZE": COMPILE_CACHE_MAX_BYTES}
    return {"JAX_COMPILATION_CACHE_DIR": str(directory),
            **{name: value for name, value in defaults.items() if name not in os.environ}}


def use_compile_cache(directory: Path) -> None:
    """Keep this process's compiled programs in `directory`, as `child_env` has the runs'
    processes do, so that runs in turn (the seeds of a scheme, a resumed run) load what an
    earlier one compiled. jax reads the setting at its first compilation: call this before
    the process compiles anything."""
    settings = compile_cache_settings(directory)
    if not settings:
        return
    import jax   # not at module level: a run's process sets XLA's flags before jax is imported

    for name, value in settings.items():   # each environment variable's config option
        jax.config.update(name.lower(), value)


def child_env(cores: list[int] | None, pin: bool = False, compile_cache: Path | None = None) -> dict[str, str]:
    """The environment of a run's process: this one's, plus its cores (None: every core) and
    XLA:CPU's one-core settings when it gets one; `enter_slot()` in the child applies them.
    `pin=True` also confines the process to `cores` (see the module doc for why runs are not).
    `compile_cache`: a directory where the processes keep the programs they compiled, so a run
    whose programs another run compiled before (the seeds of a scheme, a resumed run) loads
    them instead; a JAX_COMPILATION_CACHE_DIR of the caller's own is kept instead."""
    env = dict(os.environ)
    # Processes side by side on one GPU (bench runs'): by default each would reserve most of its memory.
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if compile_cache is not None:
        env.update({name: str(value) for name, value in compile_cache_settings(compile_cache).items()})
    # The run's process imports this very package, wherever the command was started.
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH", "")]))
    env[PARENT_ENV] = str(os.getpid())
    env.pop(CORES_ENV, None)
    if cores is not None:
        if pin:
            env[CORES_ENV] = ",".join(map(str, cores))
        if len(cores) == 1:
            env["XLA_FLAGS"] = " ".join(filter(None, [env.get("XLA_FLAGS", ""), SINGLE_CORE_XLA_FLAGS]))
    return env


def enter_slot() -> None:
    """In a run's process, before jax starts: pin it to its cores if asked (XLA:CPU sizes its
    thread pools by the cores it may use) and have the kernel kill it when its parent dies."""
    if os.environ.get(CORES_ENV):
        os.sched_setaffinity(0, [int(c) for c in os.environ[CORES_ENV].split(",")])
    parent = os.environ.pop(PARENT_ENV, "")   # not for processes this one starts
    if parent:
        die_with_parent()
        if os.getppid() != int(parent):   # it died before the line above took effect
            os._exit(1)


def die_with_parent() -> None:
    """Linux: SIGKILL this process when the process that started it exits (however it ends)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
