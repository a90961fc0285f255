"""The lines orbax (and asyncio under it) prints that say nothing our own messages do not.

Matched by message text and source path, so tests/test_orbax_logs.py checks those texts
against the installed orbax and Python: a release that rewords one fails there, not by
flooding a run's log. Each filter is installed once per process.

- `quiet_unrequested_items(items)`: orbax warns that a checkpoint item 'was found in the
  checkpoint, but could not be restored' when a restore asks for some items only (the
  model config alone, the parameters without the iterator state) -- on purpose here.
- `quiet_failed_restores()`: after one unreadable array, orbax's restore raises and closes
  its event loop while tensorstore finishes the other reads; each then prints an
  unraisable 'Event loop is closed' and asyncio logs each orphaned task's error: hundreds
  of tracebacks after one corrupt checkpoint.
- `save_errors()`: orbax's own ERROR tracebacks from its background threads while a save
  of ours is pending (the Checkpointer reports that save's failure itself, on one line), and
  asyncio's 'never retrieved' for the writes a failed save abandoned (one per array file
  it was writing on a full disk).
"""
from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Iterable

NOT_RESTORED = "was found in the checkpoint, but could not be restored"   # orbax's warning
NEVER_RETRIEVED = ("Task exception was never retrieved", "Future exception was never retrieved",   # asyncio's
                   "_GatheringFuture exception was never retrieved")
CLOSED_LOOP = "Event loop is closed"   # asyncio's RuntimeError
ORBAX_PATH = "orbax/checkpoint"   # in the path of every orbax-checkpoint source file


def _code_in(tb) -> list:
    """The code objects of a traceback's frames, outermost first."""
    codes = []
    while tb is not None:
        codes.append(tb.tb_frame.f_code)
        tb = tb.tb_next
    return codes


def is_closed_loop_callback(unraisable) -> bool:
    """A RuntimeError('Event loop is closed') from asyncio's call_soon_threadsafe, called
    from outside Python (no object): a tensorstore read completing after orbax closed the
    event loop that awaited it."""
    error = unraisable.exc_value
    if not isinstance(error, RuntimeError) or str(error) != CLOSED_LOOP or unraisable.object:
        return False
    return any(code.co_name == "call_soon_threadsafe" for code in _code_in(unraisable.exc_traceback))


class AbandonedOrbaxTasks(logging.Filter):
    """asyncio's 'Task/Future exception was never retrieved' for an error raised in orbax, or
    for a tensorstore read orbax had stopped awaiting: that one is set on its future from
    C++, so it carries no traceback to show where it came from, only tensorstore's spec in
    its text (seen once in a test run under load)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        if not message.startswith(NEVER_RETRIEVED):
            return True
        error, tb = (record.exc_info[1], record.exc_info[2]) if record.exc_info else (None, None)
        if tb is None and "tensorstore_spec" in str(error):
            return False
        files = [code.co_filename for code in _code_in(tb)]
        return not any(ORBAX_PATH in name for name in [message, *files])


class UnrequestedItems(logging.Filter):
    """orbax's warning that one of `items` was 'found in the checkpoint, but could not be
    restored' (a restore that asked for others only); other items' warnings pass."""

    def __init__(self, items: Iterable[str]):
        super().__init__()
        self.items = tuple(items)

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("Item ") and NOT_RESTORED in message
                    and any(f'"{item}"' in message.split(" was found")[0] for item in self.items))


class PendingSaveErrors(logging.Filter):
    """Drops orbax's own ERROR logs while `pending` (saves in flight) is above zero."""

    def __init__(self):
        super().__init__()
        self.pending = 0

    def filter(self, record: logging.LogRecord) -> bool:
        return not (self.pending and record.levelno >= logging.ERROR and ORBAX_PATH in record.pathname)


_LOCK = threading.Lock()
_SAVE_ERRORS = PendingSaveErrors()


def _absl_log() -> logging.Logger:
    return logging.getLogger("absl")   # orbax logs through absl


def quiet_unrequested_items(items: Iterable[str]) -> None:
    """Drop orbax's 'could not be restored' warnings for `items` (once per set of items)."""
    items = tuple(items)
    with _LOCK:
        if not any(isinstance(f, UnrequestedItems) and f.items == items for f in _absl_log().filters):
            _absl_log().addFilter(UnrequestedItems(items))


def quiet_failed_restores() -> None:
    """Silence the echo of a failed restore (install before the first restore): exactly
    the closed-loop callbacks and abandoned orbax tasks are dropped; every other
    unraisable exception goes to the previous hook."""
    _quiet_abandoned_tasks()
    with _LOCK:
        if getattr(sys.unraisablehook, "drops_closed_loop_callbacks", False):
            return
        previous = sys.unraisablehook

        def hook(unraisable) -> None:
            if not is_closed_loop_callback(unraisable):
                previous(unraisable)

        hook.drops_closed_loop_callbacks = True
        sys.unraisablehook = hook


def _quiet_abandoned_tasks() -> None:
    asyncio_log = logging.getLogger("asyncio")
    with _LOCK:
        if not any(isinstance(f, AbandonedOrbaxTasks) for f in asyncio_log.filters):
            asyncio_log.addFilter(AbandonedOrbaxTasks())


def save_errors() -> PendingSaveErrors:
    """The process's one PendingSaveErrors filter, installed on orbax's logger: a saver
    adds 1 to its `pending` while a save is in flight and takes it back after."""
    _quiet_abandoned_tasks()
    with _LOCK:
        if _SAVE_ERRORS not in _absl_log().filters:
            _absl_log().addFilter(_SAVE_ERRORS)
    return _SAVE_ERRORS
