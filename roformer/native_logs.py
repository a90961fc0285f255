"""The C++ log lines of XLA and jaxlib (absl logging, written straight to stderr), kept out of
the commands' logs.

XLA logs from C++ beside the project's own lines: its slow-operation alarm ("[Compiling
module jit_train_step for GPU] Very slow compile? If you want to file a bug, run with envvar
XLA_FLAGS=--xla_dump_to=..." and "The operation took ...", at ERROR level, whenever a
compile passes XLA's threshold of two minutes), constant-folding alarms, and
the plugins' start-up notices. The commands announce their compiles themselves, so these are
noise to a user; Python's logging cannot filter them (they never pass through it).

`hide()` raises the C++ minimum log level to FATAL: `TF_CPP_MIN_LOG_LEVEL=3` in the
environment, which jaxlib reads when it is imported and an accelerator plugin (the CUDA one)
when jax loads it at first use, and, for a jaxlib already imported, its setter of absl's level.
A level the user set in TF_CPP_MIN_LOG_LEVEL is kept. Call it before jax runs anything (the
command lines do, unless `--verbosity` asks for library lines). What it hides also holds the
details of some real failures (a CUDA library that did not load says why only there): the
command lines say how to see them again when a command fails with a traceback (`hint()`).
"""
from __future__ import annotations

import os
import sys

ENV = "TF_CPP_MIN_LOG_LEVEL"
FATAL_ONLY = 3   # absl's levels: 0 INFO, 1 WARNING, 2 ERROR, 3 FATAL

_hidden = False


def hide() -> bool:
    """Keep XLA's and jaxlib's C++ log lines below FATAL off stderr (see the module doc);
    False where the user's own TF_CPP_MIN_LOG_LEVEL rules."""
    global _hidden
    if os.environ.get(ENV, "").strip():
        return False
    os.environ[ENV] = str(FATAL_ONLY)
    if "jaxlib" in sys.modules:   # imported already: it read the environment before this
        _set_jaxlib_level(FATAL_ONLY)
    _hidden = True
    return True


def hidden() -> bool:
    """Whether hide() turned the C++ log lines off in this process."""
    return _hidden


def hint() -> str:
    """What to do to see the hidden lines again (for a command that failed)."""
    return (f"XLA's own log lines were hidden ({ENV}={FATAL_ONLY}); run again with --verbosity=0 (or "
            f"{ENV}=0 in the environment) to see them")


def _set_jaxlib_level(level: int) -> None:
    try:
        from jax._src.lib import utils   # jaxlib's absl binding; no public setter exists
    except ImportError:
        return
    setter = getattr(utils, "absl_set_min_log_level", None)
    if setter is not None:
        setter(level)
