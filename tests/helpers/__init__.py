"""What the tests share, in one place: test modules import from `helpers` (this package,
`helpers.train`, `helpers.ablation`, `helpers.glue`, `helpers.study`), never from one another
or from conftest.py (tests/test_imports.py checks it).

Importing it first sets the environment every test runs in (tests/conftest.py does, before
any test module): XLA's flags must be set before jax is imported anywhere, so that sharding
tests see 8 virtual CPU devices (single-device code is unaffected); every process a test
starts inherits them.
"""
import importlib.util
import os
import threading
from importlib import metadata
from pathlib import Path

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _jaxlib_before(major: int, minor: int) -> bool:
    try:
        return tuple(int(part) for part in metadata.version("jaxlib").split(".")[:2]) < (major, minor)
    except (metadata.PackageNotFoundError, ValueError):
        return False


# 8 virtual CPU devices, and settings that compile faster: the suite's programs are tiny, so
# compiling them costs far more than running them. LLVM's lowest optimisation level; and
# where jaxlib still has them (before 0.11, which dropped the flag), XLA:CPU's older elemental
# fusion emitters instead of its MLIR ones. XLA's own passes (fusion, layouts), which decide
# what a program computes, run as they do outside the tests; the emitters may round a fused
# computation differently by an ulp (LEGACY_FUSION_EMITTERS below). A setting the caller put
# in XLA_FLAGS is kept. docs/results/2026-11-26-test-suite-time-cpu.md measures the first,
# docs/results/2026-11-29-older-fusion-emitters-cpu.md the second.
LEGACY_EMITTERS_FLAG = "--xla_cpu_use_fusion_emitters=false"
COMPILE_FAST_FLAGS = ["--xla_backend_optimization_level=0"] + ([LEGACY_EMITTERS_FLAG] if _jaxlib_before(0, 11) else [])
for _flag in ("--xla_force_host_platform_device_count=8", *COMPILE_FAST_FLAGS):
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()
# Whether this run compiles with the older emitters: two programs that run the same step
# inside different surroundings (one step per call, several in a loop) are then equal to an
# ulp, not bit for bit, and a test that compares them says which.
LEGACY_FUSION_EMITTERS = LEGACY_EMITTERS_FLAG in os.environ["XLA_FLAGS"].split()

from roformer import config_files  # noqa: E402  (after the flags: it may import jax)

REPO_ROOT = Path(__file__).resolve().parents[2]
SHARED_DATA = config_files.shared_data()   # ../shared/data beside the project, or ROFORMER_SHARED_DATA


def _needs(module: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(importlib.util.find_spec(module) is None,
                              reason=f"needs {module} (a parity reference: pip install -e '.[dev]')")


# The parity references come with the `dev` extra, not the `test` extra (CI's pass on the
# newest Python has no torch build to install): only the tests that use them skip without them.
needs_torch = _needs("torch")
needs_transformers = _needs("transformers")


def patient(seconds: float) -> float:
    """A time limit for a process a test starts (or waits on): `seconds` is generous on an
    idle 2-core machine running the suite with two workers. On a busier machine (more
    runnable processes than cores, by the higher of the 1- and 5-minute load averages when
    the limit is set) the limit is that many times longer, up to 10x: a test must not fail
    because the machine is busy, and a hang still fails, later."""
    load = max(os.getloadavg()[:2]) / (os.cpu_count() or 1)
    return seconds * min(10.0, max(1.0, load))


def wiki_cfg(shared_data: Path, cache: Path, **overrides):
    """Data settings reading two shared Wikipedia files with the BERT uncased vocab."""
    from roformer.data import DataConfig

    cfg = {"source": "files", "files": str(shared_data / "wikipedia_en" / "wiki_0[67]"),
           "vocab": str(shared_data / "vocab" / "bert-base-uncased-vocab.txt"), "cache_dir": str(cache)}
    return DataConfig(**{**cfg, **overrides})


def cudnn_layout_errors(q, k, v, bias, mask, kv_lengths) -> list[str]:
    """What jax's cuDNN path (jax.nn.dot_product_attention -> cudnn_dot_product_attention ->
    combine_bias_and_mask -> check_layout, BTNH layout) would refuse in these arguments
    (tests/model/test_attention_kernels.py, tests/glue/test_glue_finetune.py)."""
    import jax.numpy as jnp

    errors = []
    if q.dtype not in (jnp.bfloat16, jnp.float16) or not q.dtype == k.dtype == v.dtype:
        errors.append(f"Q/K/V must be fp16/bf16 of one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.ndim != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        errors.append(f"Q/K/V shapes {q.shape} {k.shape} {v.shape} are not one BTNH layout")
    if q.shape[-1] % 8 or q.shape[-1] > 128:
        errors.append(f"head size {q.shape[-1]}")
    combined = [t for t in (bias, mask) if t is not None]
    if combined:
        shape = jnp.broadcast_shapes(*[(1,) * (4 - t.ndim) + tuple(t.shape) for t in combined])
        if shape[2] != q.shape[1] or shape[3] != k.shape[1]:
            errors.append(f"Bias must have same seq length as QKV, got {shape[2]} and {shape[3]}")
        if shape[0] not in (1, q.shape[0]) or shape[1] not in (1, q.shape[2]):
            errors.append(f"bias batch/heads {shape[:2]}")
    if kv_lengths is not None and (kv_lengths.dtype != jnp.int32 or kv_lengths.shape != (q.shape[0],)):
        errors.append(f"kv_seqlen must be int32 [B], got {kv_lengths.dtype} {kv_lengths.shape}")
    return errors


# The micro model the short training runs of the tests share (a 32-wide tiny config, a
# 500-token vocabulary): compiled and run in seconds.
MICRO_MODEL = {"model.hidden_size": 32, "model.intermediate_size": 64, "model.num_heads": 2, "data.vocab_size": 500}


def tiny_run_config(cache: Path, overrides: dict, **extra):
    """configs/tiny.py with its data cache in `cache` and `overrides`, then `extra`, set by
    dotted key ("train.steps": 8): the small pretraining runs the training tests share."""
    from roformer.configs import tiny

    config = tiny.get_config()
    config.data.cache_dir = str(cache)
    for key, value in {**overrides, **extra}.items():
        section, name = key.split(".")
        config[section][name] = value
    return config


def finishes(fn, seconds: float) -> bool:
    """Whether fn() returns within `seconds` (it runs in a daemon thread: a hang is left behind)."""
    done = threading.Event()
    threading.Thread(target=lambda: (fn(), done.set()), daemon=True).start()
    return done.wait(seconds)


def one_line_error(capsys, fn) -> str:
    """The `error: ...` line the command lines print for what `fn` raises (exit status 2)."""
    from roformer import cli

    with pytest.raises(SystemExit) as stopped, cli.user_errors():
        fn()
    err = capsys.readouterr().err.strip()
    assert stopped.value.code == cli.EXIT_USER_ERROR and err.startswith("error: ") and "\n" not in err, err
    return err


UNWRITABLE = Path("/sys/kernel")   # a directory even root cannot create files in
needs_unwritable = pytest.mark.skipif(not UNWRITABLE.is_dir() or os.access(UNWRITABLE, os.W_OK) and os.getuid() != 0,
                                      reason="needs Linux's sysfs, where no process may create a file")


def cache_entries(directory: Path) -> list[Path]:
    """The entries of a token-cache folder (`shards/`, `tokenizers/`), without the hidden build
    lock and builder files that stay beside them (roformer.data.cache_lock)."""
    return sorted(p for p in directory.iterdir() if not p.name.startswith("."))
