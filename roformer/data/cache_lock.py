"""The lock of a cache entry (token shards, a trained tokenizer): runs that share a cache
build an entry once, the others wait for it and then read it.

Not roformer.workdir_lock's lock file: a workdir refuses a second run at once, naming its
holder's host and pid, while a cache entry makes the second run wait and then reuse what
the first built, which an flock does with no stale lock to clear (the kernel releases it
when the holder dies).
"""
from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)


@contextlib.contextmanager
def build_lock(target: Path) -> Iterator[None]:
    """Holds the lock of cache entry `target` (`.<name>.lock` beside it) for the block, waiting
    while another process holds it. The caller checks again for the entry once it holds the
    lock: the process it waited for has usually built it.

    flock, not a lock file's existence: the kernel releases it when the holder exits or is
    killed, so a dead builder never blocks. The holder removes the file before it unlocks; a
    waiter that then gets the lock of the removed file takes the current one instead. Where
    the file system refuses flock, the block runs unlocked: correct, at worst built twice."""
    path = target.with_name(f".{target.name}.lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    told = False
    while True:
        f = open(path, "a+")
        try:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not told:
                    f.seek(0)
                    log.info("%s is being built by %s; waiting for it", target, f.read().strip() or "another run")
                    told = True
                fcntl.flock(f, fcntl.LOCK_EX)
        except OSError as err:   # e.g. ENOLCK / EOPNOTSUPP on some network file systems
            f.close()
            log.info("cannot lock %s (%s): building %s without waiting for other runs", path, err, target.name)
            f = None
            break
        try:
            current = os.stat(path).st_ino == os.fstat(f.fileno()).st_ino
        except FileNotFoundError:
            current = False
        if current:
            break
        f.close()   # the previous holder removed it: lock the file now at `path`
    if f is None:
        yield
        return
    with f:
        f.seek(0)
        f.truncate()
        f.write(f"host {socket.gethostname()} pid {os.getpid()}\n")
        f.flush()
        try:
            yield
        finally:
            path.unlink(missing_ok=True)
