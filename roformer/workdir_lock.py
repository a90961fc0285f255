"""One run per workdir: `DIR/workdir.lock` names the process using it.

Pretraining, GLUE and the ablation take it for their whole run, so a second run on a
workdir in use stops at once, naming the holder's host and pid, instead of both
writing the same checkpoints and metrics. A lock left by a process that died on this
host (SIGKILL, OOM, a crash) is taken over with a warning, and so is an empty or
unreadable lock file that stays so for some seconds (its writer failed, e.g. on a full disk;
counted on this process's clock, since the file's mtime may lie, e.g. lie in the future), and
a symbolic link to nothing; one held on another host cannot be checked from here and is
refused. Taking the lock never waits silently nor more than a minute: a lock that keeps
changing is refused. In a multi-host run only process 0 takes it: every process of that run
shares the workdir. The same process may take it again
(nested runs); it is released when the outermost `with` exits, and the directories the
lock created are removed again if the run left them empty (e.g. refused a bad config).
A workdir that cannot hold a run (a regular file, not creatable, not writable) is refused
before anything is written (`WorkdirUnusable`).
"""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import jax

from roformer.errors import UserError
from roformer.files import process_alive, process_state  # noqa: F401 - process_state: also the tests'

log = logging.getLogger("roformer")

LOCK_FILE = "workdir.lock"
UNREADABLE_GRACE_S = 5.0
GIVE_UP_S = 60.0   # a lock that keeps changing for this long is refused, never waited on forever

_depth: dict[Path, int] = {}   # locks this process holds -> nesting depth


class WorkdirError(UserError, RuntimeError):
    """The workdir cannot be used for this run: the user's to fix (roformer.cli)."""


class WorkdirBusy(WorkdirError):
    """Another live process holds the workdir."""


class WorkdirUnusable(WorkdirError):
    """The workdir is a regular file, cannot be created or cannot be written."""


def _read(path: Path) -> dict | None:
    """The holder a lock file names; {"unreadable": its age in seconds} for an empty or torn
    one; None when there is none."""
    try:
        text = path.read_text()
        holder = json.loads(text)
        if isinstance(holder, dict):
            return holder
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError):
        pass
    try:
        return {"unreadable": time.time() - path.stat().st_mtime}
    except FileNotFoundError:
        return None


def _acquire(path: Path, me: dict) -> None:
    # How long this process has seen the lock empty or torn, on its own clock: a file's mtime
    # may lie (set in the future, or a clock that differs on a network file system).
    unreadable_since = None
    deadline = time.monotonic() + GIVE_UP_S
    while True:
        if time.monotonic() > deadline:
            raise WorkdirBusy(f"could not take {path} within {GIVE_UP_S:.0f}s: it keeps changing (another run "
                              f"starting on this workdir?); wait for it or use another workdir (if no run uses "
                              f"it, remove {path})")
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _read(path)
            if holder is None:
                if path.is_symlink():   # a link to nothing: the project never makes one, it holds nothing
                    log.warning("%s: removing %s, a symbolic link to nothing (%s), which no run holds",
                                path.parent, path.name, os.readlink(path))
                    path.unlink(missing_ok=True)
                continue   # released meanwhile: try again
            if "unreadable" in holder:
                # A taker writes its line right after creating the file: one still empty or torn
                # after UNREADABLE_GRACE_S was left by a write that failed (a full disk) or a
                # process killed in between, and holds nothing.
                now = time.monotonic()
                if unreadable_since is None:
                    unreadable_since = now - max(0.0, min(holder["unreadable"], UNREADABLE_GRACE_S))
                    if now - unreadable_since < UNREADABLE_GRACE_S:
                        log.info("%s: the lock file is empty; waiting up to %.0fs for the run creating it",
                                 path.parent, UNREADABLE_GRACE_S)
                if now - unreadable_since < UNREADABLE_GRACE_S:
                    time.sleep(0.05)
                    continue
                log.warning("%s: taking over an empty or unreadable lock file (left by a run that could not "
                            "finish writing it)", path.parent)
                path.unlink(missing_ok=True)
                unreadable_since = None
                continue
            unreadable_since = None
            host, pid = holder.get("host"), holder.get("pid")
            if host == me["host"] and pid == me["pid"]:
                return   # ours already (written by this process)
            if host != me["host"] or not isinstance(pid, int) or pid <= 0 or process_alive(pid):
                raise WorkdirBusy(
                    f"{path.parent} is in use by another run (host {host}, pid {pid}, since "
                    f"{holder.get('since', '?')}); wait for it or use another workdir (if that run "
                    f"is gone, remove {path})") from None
            if _read(path) == holder:   # still the same stale lock: take it over
                log.warning("%s: taking over the lock of a run that is no longer running "
                            "(host %s, pid %s)", path.parent, host, pid)
                path.unlink(missing_ok=True)
            continue
        try:
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(me) + "\n")
        except OSError:   # e.g. a full disk: leave no empty lock behind to refuse the next run
            path.unlink(missing_ok=True)
            raise
        return


@contextlib.contextmanager
def workdir_lock(workdir: str | Path) -> Iterator[None]:
    """Hold `workdir`'s lock for the block (creating the directory); see the module doc."""
    if jax.process_index() != 0:
        yield
        return
    path = Path(workdir).expanduser().resolve() / LOCK_FILE
    created = None
    if path not in _depth:
        created = _make_workdir(path.parent)
        try:
            _acquire(path, {"host": socket.gethostname(), "pid": os.getpid(),
                            "since": time.strftime("%Y-%m-%d %H:%M:%S")})
        except OSError as error:   # read-only file system, no write permission
            _remove_if_empty(path.parent, created)
            raise WorkdirUnusable(f"workdir {path.parent} is not writable: {_reason(error)}") from None
    _depth[path] = _depth.get(path, 0) + 1
    try:
        yield
    finally:
        _depth[path] -= 1
        if not _depth[path]:
            del _depth[path]
            holder = _read(path)
            if holder and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
                path.unlink(missing_ok=True)
            _remove_if_empty(path.parent, created)


def _make_workdir(directory: Path) -> Path | None:
    """Create `directory` (and missing parents); returns the topmost directory it created
    (None: it existed). What stops it is the user's to fix, named in one line."""
    if directory.is_dir():
        return None
    if directory.exists() or directory.is_symlink():
        raise WorkdirUnusable(f"workdir {directory} is a file, not a directory; give a directory "
                              "(it is created if missing)")
    top = directory
    while not top.parent.exists() and top.parent != top:
        top = top.parent
    try:
        directory.mkdir(parents=True)
    except FileExistsError:   # another process made it meanwhile
        return _make_workdir(directory)
    except OSError as error:
        _remove_if_empty(directory, top)   # parents made before the failure
        blocker = next((p for p in directory.parents if p.exists() and not p.is_dir()), None)
        reason = f"{blocker} is a file, not a directory" if blocker else _reason(error)
        raise WorkdirUnusable(f"workdir {directory} cannot be created: {reason}") from None
    return top


def _reason(error: OSError) -> str:
    where = f" ({error.filename})" if error.filename else ""
    return f"{error.strerror or os.strerror(error.errno or errno.EIO)}{where}"


def _remove_if_empty(directory: Path, created: Path | None) -> None:
    """A run refused before it wrote anything leaves none of the directories made for the lock:
    `directory` and its parents up to `created`, the topmost one made."""
    if created is None:
        return
    for path in (directory, *directory.parents):
        if not path.is_relative_to(created):
            return
        try:
            path.rmdir()
        except FileNotFoundError:   # a creation that failed part-way: its parents may be there
            continue
        except OSError:   # not empty: the run wrote into it
            return
