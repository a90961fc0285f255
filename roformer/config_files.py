"""Where the config files are, and how `--config=configs/<name>.py` finds one anywhere;
where the shared data they name lives (`shared_data`); how a list setting reads
(`split_list`) and a config's stable hash (`fingerprint`), which the ablation and the study
both key their records by.

The repository keeps the config files at its top, in configs/; a wheel ships the same
files as the package roformer.configs (setuptools maps the directory: pyproject.toml; a
checkout without that install finds them through roformer/__init__.py). `CONFIG_DIR` is
whichever of the two this installation has. The files import each other as that package
(`from roformer.configs import base`), so they import the same way from any directory,
whatever `configs` package the directory holds. A user's config file that still imports the
old top-level name (`from configs import base`) is refused in one line (`old_import`).
"""
from __future__ import annotations

import hashlib
import json
import os
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


def old_import(error: ImportError, spec: str) -> str | None:
    """The one-line refusal of a config file that imports the package `configs` (the name
    the config files had before they became roformer.configs), or None for any other import
    error. From a directory without its own `configs` the old name is not found at all;
    from one with it (a user's own), it is that package, without `base`."""
    if error.name != "configs" and not (error.name or "").startswith("configs."):
        return None
    return (f"--config={spec}: the config file imports the package `configs`; the shipped config "
            f"files are the package roformer.configs now: write `from roformer.configs import base` "
            f"(docs/pretraining.md)")
