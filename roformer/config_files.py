"""Where the config files are, and how `--config=configs/<name>.py` finds one anywhere;
where the shared data they name lives (`shared_data`); how a list setting reads
(`split_list`) and a config's stable hash (`fingerprint`), which the ablation and the study
both key their records by.

The repository keeps the config files at its top, in configs/; a wheel ships the same
files as the package roformer.configs (setuptools maps the directory: pyproject.toml).
`CONFIG_DIR` is whichever of the two this installation has. The files import each other
as the package `configs` (`from configs import base`), which a checkout's root provides
on sys.path; elsewhere `make_importable` provides it from `CONFIG_DIR`.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

_PACKAGE_DIR = Path(__file__).resolve().parent
# a wheel: roformer/configs; a checkout (editable install): configs/ beside roformer/
CONFIG_DIR = (_PACKAGE_DIR / "configs" if (_PACKAGE_DIR / "configs").is_dir()
              else _PACKAGE_DIR.parent / "configs")


def shared_data() -> Path:
    """The shared data (corpora, vocabularies, GLUE): where ROFORMER_SHARED_DATA points, else
    ../shared/data beside a checkout. Read at each call, so a config file loaded after the
    variable changed (a test's) sees the new place."""
    return Path(os.environ.get("ROFORMER_SHARED_DATA", _PACKAGE_DIR.parent.parent / "shared" / "data"))


def resolve(spec: str) -> str:
    """`spec` (`path[:arg]`, as --config takes it) with `configs/<name>.py` read from this
    installation's config files when no such file exists relative to the working directory;
    any other spec is returned unchanged (a missing file is reported by its reader)."""
    path, colon, arg = spec.partition(":")
    given = Path(path)
    if given.exists() or given.is_absolute() or given.parts[:-1] != ("configs",):
        return spec
    shipped = CONFIG_DIR / given.name
    return f"{shipped}{colon}{arg}" if shipped.is_file() else spec


def make_importable() -> None:
    """Let config files `import configs` where no `configs` package is on sys.path (an
    installed package run outside a checkout): the package is then this installation's
    CONFIG_DIR. Where one is on sys.path (a checkout's root), it is left alone."""
    if "configs" in sys.modules or importlib.util.find_spec("configs") is not None:
        return
    spec = importlib.util.spec_from_file_location("configs", CONFIG_DIR / "__init__.py",
                                                  submodule_search_locations=[str(CONFIG_DIR)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["configs"] = module
    spec.loader.exec_module(module)


def split_list(value: Any) -> list[str]:
    """A list setting's items as text: a tuple or list (a config file's form; from the command
    line `--config.schemes=rope,learned` arrives as the tuple ("rope,learned",)) or a comma
    string; comma items are split, blanks dropped."""
    items = value if isinstance(value, (list, tuple)) else [value]
    return [part.strip() for item in items for part in str(item).split(",") if part.strip()]


def fingerprint(*parts: Any) -> str:
    """Stable hash of JSON-able parts (keys sorted; other values by their text)."""
    text = json.dumps(list(parts), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
