"""How runs and processes that share a cache coordinate: the lock of a cache entry (token
shards, a trained tokenizer), so that runs build an entry once and the others wait for it
and then read it; and the handshake by which the processes of one job find out whether they
share the cache directory (then they split a build).

Not roformer.workdir_lock's lock file: a workdir refuses a second run at once, naming its
holder's host and pid, while a cache entry makes the second run wait and then reuse what
the first built, which filelock's flock does with no stale lock to clear (the kernel releases
it when the holder dies).
"""
from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import filelock

from roformer.errors import UserError
from roformer.files import write_text_atomic

log = logging.getLogger(__name__)


class CacheUnwritable(UserError, OSError):
    """A cache entry must be built, and the cache directory cannot be written (read-only, no
    permission)."""


@contextlib.contextmanager
def build_lock(target: Path) -> Iterator[None]:
    """Holds the lock of cache entry `target` (`.<name>.lock` beside it, a `filelock.FileLock`)
    for the block, waiting while another process holds it. The caller checks again for the
    entry once it holds the lock: the process it waited for has usually built it.

    filelock locks with flock, not with the file's existence: the kernel releases it when the
    holder exits or is killed, so a dead builder never blocks. The holder names itself in
    `.<name>.builder` beside it (the waiting line says whom it waits for) and removes that file
    before it unlocks; one found there by the next holder was left by a build stopped by
    SIGTERM or SIGKILL, and is said in the log. Where the lock cannot be taken (a file system
    that refuses it), the block runs unlocked: correct, at worst built twice."""
    path = target.with_name(f".{target.name}.lock")
    builder = target.with_name(f".{target.name}.builder")
    _prepare(path, target)
    lock = filelock.FileLock(path)
    try:
        try:
            lock.acquire(timeout=0)
        except filelock.Timeout:
            log.info("%s is being built by %s; waiting for it", target, _read(builder) or "another run")
            lock.acquire()
    except (OSError, NotImplementedError, RuntimeError) as err:   # e.g. ENOLCK on some network file systems
        log.info("cannot lock %s (%s): building %s without waiting for other runs", path, err, target.name)
        locked = False
    else:
        locked = True
    if not locked:
        yield
        return
    try:
        left = _read(builder)
        if left:   # its holder was killed (SIGTERM, SIGKILL) before it removed it: nothing holds it now
            log.info("%s: taking over the lock left by a build that was stopped (%s); building it again",
                     target, left)
        write_text_atomic(builder, f"host {socket.gethostname()} pid {os.getpid()}\n")
        yield
    finally:
        builder.unlink(missing_ok=True)
        lock.release()


def _read(path: Path) -> str:
    """The text of a small file, '' where it is absent or unreadable."""
    try:
        return path.read_text(errors="replace").strip()
    except OSError:
        return ""


def _prepare(path: Path, target: Path) -> None:
    """The directory of lock file `path` (of entry `target`), created and writable, with no
    dangling symbolic link in the lock's place; a cache that cannot be written is said in one
    line (CacheUnwritable)."""
    try:
        if path.is_symlink() and not path.exists():   # a link to nothing: no build made it, none holds it
            log.info("removing %s, a symbolic link to nothing", path)
            path.unlink()
        path.parent.mkdir(parents=True, exist_ok=True)
        open(path, "a").close()   # as filelock will open it: refused here in the cache's words
    except OSError as error:
        raise CacheUnwritable(f"{target} must be built but the cache {path.parent} cannot be written "
                              f"({error.strerror or error}); make it writable, or set data.cache_dir (or "
                              "$ROFORMER_CACHE) to a directory that is") from None


def find_each_other(parts_dir: Path, process_index: int, process_count: int, seconds: float) -> bool:
    """True when all processes of the job see each other's marker in parts_dir within `seconds`:
    the cache directory is shared and they can split the build."""
    parts_dir.mkdir(parents=True, exist_ok=True)
    markers = [parts_dir / f"process_{i}_of_{process_count}" for i in range(process_count)]
    markers[process_index].touch()
    deadline, delay = time.monotonic() + seconds, 0.05
    while True:
        absent = [i for i, marker in enumerate(markers) if not marker.exists()]
        if not absent:
            return True
        if time.monotonic() > deadline:
            break
        time.sleep(delay)
        delay = min(2 * delay, 2.0)
    log.warning("processes %s of %d did not appear in %s within %.0fs: the cache directory seems private "
                "to each host, so process %d tokenizes the whole corpus (set data.cache_dir to storage every "
                "host sees to split the work)", absent, process_count, parts_dir.parent.parent, seconds,
                process_index)
    markers[process_index].unlink(missing_ok=True)
    try:
        parts_dir.rmdir()
    except OSError:
        pass
    return False
