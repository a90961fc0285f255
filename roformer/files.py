"""Replacing a file atomically: readers see the old content or the new, never a partial one."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    """Write `data` to a staging file beside `path` (named by this process) and rename it over `path`."""
    path = Path(path)
    staging = path.with_name(f"{path.name}.partial-{os.getpid()}")
    staging.write_bytes(data)
    os.replace(staging, path)


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write `text` to a staging file beside `path` (named by this process) and rename it over `path`."""
    write_bytes_atomic(path, text.encode())


def write_json_atomic(path: str | Path, data: Any, indent: int | None = 2) -> None:
    """`data` as JSON (and a final newline), replaced atomically."""
    write_text_atomic(path, json.dumps(data, indent=indent) + "\n")
