"""Compiled GLUE programs kept on disk whole, so that a warm run neither traces nor compiles them.

jax's persistent compilation cache keys a program by its lowered form: a run that finds a
program there has still traced and lowered it, which at base size takes seconds per program.
This store keys a compiled program by everything that decides it instead, and
keeps the executable jax serializes (`jax.experimental.serialize_executable`):

- what it computes, described by its owner (`roformer.glue.finetune.Programs`): the kind
  and shapes of the program, the model's graph (its config with every field, the number of
  labels, every static attribute), the shapes and dtypes of its state, the optimizer
  settings and the head;
- where it runs (`environment`): the jax, jaxlib, flax and optax versions, the backend, its
  platform version, device kinds and count, XLA_FLAGS, the model's backend forms, and a
  digest of the source of every module of the roformer package, so any code change misses.

Entries are written atomically. A program is run once on zeros of its inputs' shapes
(`trial_run`) before it is stored and again when it is loaded: an executable jax took from
its persistent cache may serialize without the functions it calls (XLA:CPU), and then loads
but fails when run. One that cannot be read, loaded or run (cut short, written by another
build, such an executable) is logged in one line, deleted and compiled again.

A stored program is code: its executable runs as it is, and its entry is unpickled (as jax
serializes executables). So the store, like jax's persistent cache beside it, must be the
user's own, as config files are (Python, run as they are): entries are loaded only from a
folder, and files, owned by the user and not writable by other users (`trusted`); elsewhere
the store is not used, said once.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import pickle
import re
import stat
from pathlib import Path

import flax
import jax
import jaxlib
import numpy as np
import optax
from jax.experimental import serialize_executable

import roformer
from roformer.files import stale_staging, write_bytes_atomic
from roformer.model import backend

log = logging.getLogger("roformer.glue")

# The store's folder inside the compilation cache directory.
FOLDER = "roformer-programs"
SUFFIX = ".program"


@functools.cache
def source_digest() -> str:
    """sha256 of the path and bytes of every .py file of the roformer package."""
    root = Path(roformer.__file__).parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def environment() -> dict:
    """Where a compiled program runs, besides what it computes."""
    devices = jax.devices()
    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "flax": flax.__version__,
            "optax": optax.__version__, "backend": jax.default_backend(),
            "platform_version": devices[0].client.platform_version,
            "device_kinds": sorted({d.device_kind for d in devices}), "device_count": len(devices),
            "xla_flags": os.environ.get("XLA_FLAGS", ""), "backend_forms": sorted(backend.active_forms()),
            "x64": bool(jax.config.jax_enable_x64),
            "matmul_precision": str(jax.config.jax_default_matmul_precision), "source": source_digest()}


def graph_text(graphdef) -> str:
    """An NNX graph as text that is the same in every process: its repr without the memory
    addresses of the functions it holds (which the source digest covers)."""
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(graphdef))


def tree_text(tree) -> str:
    """A pytree of arrays or ShapeDtypeStructs as text: its structure, and each leaf's dtype and shape."""
    leaves, structure = jax.tree.flatten(tree)
    return f"{structure} {[(str(leaf.dtype), tuple(leaf.shape)) for leaf in leaves]}"


def trial_run(compiled: jax.stages.Compiled) -> None:
    """Run `compiled` once on zeros of its inputs' shapes and wait for it; raises what running
    it raises. (Its inputs are made for the run: a program that donates them consumes them.)"""
    def zeros(info, sharding):
        if jax.dtypes.issubdtype(info.dtype, jax.dtypes.prng_key):
            value = jax.numpy.broadcast_to(jax.random.key(0), info.shape)
            if value.dtype != info.dtype:
                raise ValueError(f"no trial input for a key array of {info.dtype}")
        else:
            value = np.zeros(info.shape, info.dtype)
        return jax.device_put(value, sharding)

    args, kwargs = jax.tree.map(zeros, compiled.args_info, compiled.input_shardings)
    jax.block_until_ready(compiled(*args, **kwargs))


def trusted(path: Path) -> bool:
    """Whether `path` (a store folder or entry) is the user's own: owned by this user and not
    writable by other users. What is loaded from it is run as it is."""
    try:
        info = path.stat()
    except OSError:
        return False
    return info.st_uid == os.getuid() and not info.st_mode & stat.S_IWOTH


class ProgramStore:
    """Compiled programs in `directory`, one file each, named by the digest of their key."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self._swept = False
        self._untrusted_said = False

    @classmethod
    def under(cls, cache_dir: str | None) -> "ProgramStore | None":
        """The store inside a compilation cache directory; None (no store) without one."""
        return cls(Path(cache_dir) / FOLDER) if cache_dir else None

    def key(self, description: dict) -> str:
        return json.dumps({"program": description, "environment": environment()}, sort_keys=True, default=str)

    def path(self, key: str) -> Path:
        return self.directory / (hashlib.sha256(key.encode()).hexdigest() + SUFFIX)

    def load(self, description: dict) -> jax.stages.Compiled | None:
        """The stored program of `description`, or None when there is none or it cannot be loaded."""
        key = self.key(description)
        path = self.path(key)
        if not path.exists() or not self._trusted(path):
            return None
        try:
            with open(path, "rb") as file:
                entry = pickle.load(file)
            if entry["key"] != key:
                raise ValueError("its key differs from the program's")
            devices = {d.id: d for d in jax.devices()}
            program = serialize_executable.deserialize_and_load(
                entry["executable"], entry["in_tree"], entry["out_tree"], execution_devices=[devices[entry["device"]]])
            trial_run(program)
            return program
        except Exception as error:  # noqa: BLE001 - any entry that does not load and run is compiled again
            log.warning("program store: %s could not be loaded or run (%s: %s); deleting it and compiling the program",
                        path, type(error).__name__, str(error).split("\n")[0])
            path.unlink(missing_ok=True)
            return None

    def _trusted(self, path: Path) -> bool:
        """Whether the store's folder and `path` are the user's own (`trusted`); said once when not."""
        if trusted(self.directory) and (path == self.directory or trusted(path)):
            return True
        if not self._untrusted_said:
            self._untrusted_said = True
            log.warning("program store: %s is not the user's own (another user owns it or may write to it), so "
                        "its programs are not loaded: a stored program runs as it is. Compiling instead; give "
                        "config.compilation_cache_dir a directory of your own", self.directory)
        return False

    def save(self, description: dict, compiled: jax.stages.Compiled) -> bool:
        """Keep `compiled` for later runs; False (logged) where it cannot be serialized or written."""
        key = self.key(description)
        try:
            devices = {d.id for s in jax.tree.leaves((compiled.input_shardings, compiled.output_shardings))
                       for d in s.device_set}
            if len(devices) != 1:
                raise ValueError(f"it runs on {len(devices)} devices; the store keeps one-device programs")
            executable, in_tree, out_tree = serialize_executable.serialize(compiled)
            device = devices.pop()
            try:   # as the next run will load it: a program that does not run then is not kept
                trial_run(serialize_executable.deserialize_and_load(
                    executable, in_tree, out_tree, execution_devices=[d for d in jax.devices() if d.id == device]))
            except Exception as error:  # noqa: BLE001
                raise ValueError(f"once loaded again it does not run ({type(error).__name__}: "
                                 f"{str(error).splitlines()[0][:200]})") from None
            data = pickle.dumps({"key": key, "executable": executable, "in_tree": in_tree, "out_tree": out_tree,
                                 "device": device})
            self.directory.mkdir(parents=True, exist_ok=True)
            if not self._trusted(self.directory):   # its programs would not be loaded
                return False
            if not self._swept:   # staging files a killed run left
                self._swept = True
                for staging in stale_staging(self.directory):
                    staging.unlink(missing_ok=True)
            write_bytes_atomic(self.path(key), data)
            return True
        except Exception as error:  # noqa: BLE001 - a program not kept still runs; it compiles next time
            log.warning("program store: a %s program was not stored (%s: %s)", description.get("kind", ""),
                        type(error).__name__, str(error).split("\n")[0])
            return False
