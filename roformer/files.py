"""Replacing a file atomically: readers see the old content or the new, never a partial one.

Every file the project rewrites in place (a run's summary, a cache manifest, a trimmed
metrics log) goes through `replacing` or one of its text/bytes/JSON forms: the content is
written to a hidden staging file beside the target (named by process and a random suffix, so
processes and threads writing the same file never share one) and renamed over it. A write
that fails leaves the old file and no staging file. Staging directories built the same way
(`staging_name`) and left by a killed process are found by `stale_staging`.

A write that fails because the disk is full becomes a `StorageError` naming what was being
written, in one line (`writing`).
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from roformer.errors import NotWritable, StorageError

# No space left on device, disk quota exceeded, file too large for the file system.
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
# How a full disk reads where no errno comes with it: numpy's short write ("751923 requested
# and 28608 written"), the tokenizers library's Rust I/O error ("... (os error 28)").
_DISK_FULL_TEXT = re.compile(r"\d+ requested and \d+ written|os error (28|122)\b|No space left on device")
_STAGING = re.compile(r"^\.(?P<name>.+)\.partial-(?P<pid>\d+)-[0-9a-f]{8}$")


# Lies in an export's output directory while a conversion writes it (roformer.convert); a
# directory that still has it was left by a conversion that was stopped: refused as input and
# never uploaded (roformer.hub).
EXPORT_INCOMPLETE = "EXPORT_INCOMPLETE"


def is_disk_full(error: BaseException) -> bool:
    """Whether `error` says the disk (or quota) is full."""
    if isinstance(error, OSError) and error.errno in DISK_FULL_ERRNOS:
        return True
    return bool(_DISK_FULL_TEXT.search(str(error)))


@contextlib.contextmanager
def writing(what: str) -> Iterator[None]:
    """Turn a full disk met in the block into one StorageError line naming `what` (e.g.
    'the token shard cache entry DIR'); other errors pass unchanged."""
    try:
        yield
    except StorageError:
        raise
    except Exception as error:  # noqa: BLE001 - only a full disk is translated
        if not is_disk_full(error):
            raise
        full = StorageError(f"could not write {what}: no space left on device ({error}); free some space and run "
                            "the same command again")
        full.errno = errno.ENOSPC
        raise full from error


def check_writable(directory: str | Path, what: str) -> None:
    """Refuse in one line (NotWritable) a `directory` that `what` (e.g. 'the held-out metrics
    eval_4.json') cannot be written into, by writing and removing a staging file there: before
    a command spends minutes computing it. The directory is created if missing."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = staging_name(directory / ".write-check")
        probe.touch(exist_ok=False)
        probe.unlink()
    except OSError as error:
        raise NotWritable(f"cannot write {what} into {directory}: {error.strerror or error}; make it writable or "
                          "choose another place") from None


def staging_name(path: Path) -> Path:
    """A hidden staging path beside `path`, named by this process and a random suffix."""
    return path.with_name(f".{path.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def stale_staging(directory: Path) -> list[Path]:
    """The staging files and directories in `directory` (`staging_name`) whose process is no
    longer running on this host: what a killed write or build left behind."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    stale = []
    for name in names:
        match = _STAGING.match(name)
        if match and not process_alive(int(match["pid"])):
            stale.append(directory / name)
    return stale


def process_alive(pid: int) -> bool:
    """Whether process `pid` runs on this host (a zombie, which has exited, does not)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # exists, owned by someone else
        return True
    except OverflowError:
        return False
    # A zombie has exited and waits to be reaped: a killed run whose parent died too is reaped
    # by init, which in a container may take seconds or never happen; it holds nothing.
    return process_state(pid) not in ("Z", "X")


def process_state(pid: int) -> str | None:
    """Linux: the state letter of `pid` in /proc (R, S, Z, ...); None without procfs (macOS)
    or once the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[0]   # after the command name, which may hold ")"


@contextlib.contextmanager
def replacing(path: str | Path, mode: str = "wb", **open_kwargs) -> Iterator[IO]:
    """A new file, opened with `mode`, that replaces `path` when the block ends without an error."""
    path = Path(path)
    staging = staging_name(path)
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


def write_figure_atomic(path: str | Path, figure, **savefig) -> None:
    """Replace `path` with a matplotlib figure (the format named by its suffix; `savefig`'s
    options, e.g. dpi): a reader, or a copy made while a report is written, never sees half an
    image."""
    with replacing(path, "wb") as file:
        figure.savefig(file, format=Path(path).suffix.lstrip(".") or "png", **savefig)
