"""Test setup shared by every test module.

The device count flag must be set before jax is imported anywhere, so that
sharding tests see 8 virtual CPU devices; single-device code is unaffected.
"""
import os
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import importlib.util  # noqa: E402

import pytest  # noqa: E402


def _needs(module: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(importlib.util.find_spec(module) is None,
                              reason=f"needs {module} (a parity reference: pip install -e '.[dev]')")


# The parity references come with the `dev` extra, not the `test` extra (CI's pass on the
# newest Python has no torch build to install): only the tests that use them skip without them.
needs_torch = _needs("torch")
needs_transformers = _needs("transformers")

REPO_ROOT = Path(__file__).resolve().parents[1]
# The shared data lives beside the project (../shared/data); users can point
# elsewhere with ROFORMER_SHARED_DATA.
SHARED_DATA = Path(os.environ.get("ROFORMER_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.fail(f"shared data not found at {SHARED_DATA}; set ROFORMER_SHARED_DATA")
    return SHARED_DATA


@pytest.fixture(scope="session")
def wiki_cache(tmp_path_factory) -> Path:
    """One token-shard cache for every test that reads the shared Wikipedia files."""
    return tmp_path_factory.getbasetemp() / "wiki_cache"


def wiki_cfg(shared_data: Path, cache: Path, **overrides):
    """Data settings reading two shared Wikipedia files with the BERT uncased vocab."""
    from roformer.data import DataConfig

    cfg = {"source": "files", "files": str(shared_data / "wikipedia_en" / "wiki_0[67]"),
           "vocab": str(shared_data / "vocab" / "bert-base-uncased-vocab.txt"), "cache_dir": str(cache)}
    return DataConfig(**{**cfg, **overrides})
