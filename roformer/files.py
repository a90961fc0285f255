"""Replacing a file atomically: readers see the old content or the new, never a partial one."""
from __future__ import annotations

import os
from pathlib import Path


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write `text` to a staging file beside `path` (named by this process) and rename it over `path`."""
    path = Path(path)
    staging = path.with_name(f"{path.name}.partial-{os.getpid()}")
    staging.write_text(text)
    os.replace(staging, path)
