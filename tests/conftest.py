"""Test setup shared by every test module.

XLA's flags must be set before jax is imported anywhere, so that sharding tests see 8
virtual CPU devices (single-device code is unaffected); every process a test starts
inherits them, and the suite's compilation cache (below).
"""
import os
from importlib import metadata
from pathlib import Path

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
# in XLA_FLAGS is kept. docs/results/2026-11-26-test-suite-time-cpu.md measures both.
LEGACY_EMITTERS_FLAG = "--xla_cpu_use_fusion_emitters=false"
COMPILE_FAST_FLAGS = ["--xla_backend_optimization_level=0"] + ([LEGACY_EMITTERS_FLAG] if _jaxlib_before(0, 11) else [])
for flag in ("--xla_force_host_platform_device_count=8", *COMPILE_FAST_FLAGS):
    if flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
# Whether this run compiles with the older emitters: two programs that run the same step
# inside different surroundings (one step per call, several in a loop) are then equal to an
# ulp, not bit for bit, and a test that compares them says which.
LEGACY_FUSION_EMITTERS = LEGACY_EMITTERS_FLAG in os.environ["XLA_FLAGS"].split()

import importlib.util  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

import pytest  # noqa: E402

from roformer import config_files  # noqa: E402

# Test modules import helpers from one another across the package folders (tests/<package>/),
# so every folder of the suite is on the import path, as tests/ itself is.
for _folder in sorted(Path(__file__).resolve().parent.iterdir()):
    if _folder.is_dir() and not _folder.name.startswith(("_", ".")) and str(_folder) not in sys.path:
        sys.path.append(str(_folder))

# The fast lane (`python -m pytest tests -m fast`, docs/testing.md): the unit tests of every
# package, no training run and no command in a process of its own. A module joins when its
# tests take seconds.
FAST_LANE = frozenset({"test_accelerator", "test_ablation_plan", "test_ablation_progress",
    "test_ablation_report", "test_ablation_state", "test_ablation_stats", "test_attention",
    "test_attention_stats", "test_backend",
    "test_checkpoint_source", "test_data_masking", "test_data_sources", "test_data_tokenizer",
    "test_docs_links", "test_files", "test_glue_features", "test_glue_metrics", "test_glue_readers",
    "test_imports", "test_machine", "test_model", "test_orbax_logs", "test_position_signal", "test_positions",
    "test_rope", "test_settings"})


def pytest_configure(config):
    """One jax compilation cache for the whole suite: many tests (and the commands they start
    as processes) compile the same tiny programs, and a cache hit costs a file read instead of
    a compilation. Set in the controlling process before xdist starts its workers, so they
    and every process they start share it; a JAX_COMPILATION_CACHE_DIR of the caller's is kept."""
    if hasattr(config, "workerinput") or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return
    from roformer.ablation.parallel import compile_cache_settings

    directory = Path(tempfile.mkdtemp(prefix="roformer-tests-jax-cache-"))
    config._roformer_jax_cache = directory
    os.environ.update({name: str(value) for name, value in compile_cache_settings(directory).items()})


@pytest.hookimpl(tryfirst=True)   # before `-m` selects by marker
def pytest_collection_modifyitems(config, items):
    """The slow tests first (a stable sort keeps each group's order), so that none of them
    starts last and leaves one xdist worker running alone at the end of the suite; the fast
    lane's tests marked `fast`."""
    for item in items:
        if item.path.stem in FAST_LANE and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.fast)
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_unconfigure(config):
    directory = getattr(config, "_roformer_jax_cache", None)
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)


def _needs(module: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(importlib.util.find_spec(module) is None,
                              reason=f"needs {module} (a parity reference: pip install -e '.[dev]')")


# The parity references come with the `dev` extra, not the `test` extra (CI's pass on the
# newest Python has no torch build to install): only the tests that use them skip without them.
needs_torch = _needs("torch")
needs_transformers = _needs("transformers")

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = config_files.shared_data()   # ../shared/data beside the project, or ROFORMER_SHARED_DATA


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.fail(f"shared data not found at {SHARED_DATA}; set ROFORMER_SHARED_DATA")
    return SHARED_DATA


@pytest.fixture(scope="session")
def wiki_cache(tmp_path_factory) -> Path:
    """One token-shard cache for every test that reads the shared Wikipedia files."""
    return tmp_path_factory.getbasetemp() / "wiki_cache"


@pytest.fixture(scope="session")
def fake_study(tmp_path_factory) -> Path:
    """A study workdir of `configs/ablation.py:gpu_smoke` with fake records (random losses at the
    real shapes: every scheme's grid and a group beyond it) and its report, made by
    scripts/study_report_time.py. Read only: copy it to change it."""
    import runpy

    workdir = tmp_path_factory.mktemp("fake_study") / "study"
    runpy.run_path(str(REPO_ROOT / "scripts" / "study_report_time.py"))["main"](["gpu_smoke", "--dir", str(workdir)])
    return workdir


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
    import jax.numpy as jnp   # here: conftest sets the XLA flags before jax is first imported

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
