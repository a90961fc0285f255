"""Replacing a file atomically: readers see the old content or the new, never a partial one.

Every file the project rewrites in place (a run's summary, a cache manifest, a trimmed
metrics log) goes through `replacing` or one of its text/bytes/JSON forms: the content is
written to a hidden staging file beside the target (named by process and a random suffix, so
processes and threads writing the same file never share one) and renamed over it. A write
that fails leaves the old file and no staging file.
"""
from __future__ import annotations

import contextlib
import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any


@contextlib.contextmanager
def replacing(path: str | Path, mode: str = "wb", **open_kwargs) -> Iterator[IO]:
    """A new file, opened with `mode`, that replaces `path` when the block ends without an error."""
    path = Path(path)
    staging = path.with_name(f".{path.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(staging, mode, **open_kwargs) as file:
            yield file
        os.replace(staging, path)
    finally:
        staging.unlink(missing_ok=True)


def write_text_atomic(path: str | Path, text: str, *, encoding: str | None = None) -> None:
    """Replace `path` with `text`."""
    with replacing(path, "w", encoding=encoding) as file:
        file.write(text)


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    """Replace `path` with `data`."""
    with replacing(path, "wb") as file:
        file.write(data)


def write_json_atomic(path: str | Path, value: Any, *, indent: int | None = 2, **dumps_kwargs) -> None:
    """Replace `path` with `value` as JSON (`json.dumps(value, indent=indent, **dumps_kwargs)`)
    and a final newline."""
    write_text_atomic(path, json.dumps(value, indent=indent, **dumps_kwargs) + "\n")
