"""roformer.orbax_logs: each filter drops the lines it is for and nothing else, and the
texts it matches are still the ones the installed orbax and asyncio print (a release that
rewords one fails here)."""
import asyncio
import gc
import logging
import types

import orbax.checkpoint as ocp
import pytest

from roformer import orbax_logs
from roformer.orbax_logs import AbandonedOrbaxTasks, UnrequestedItems

pytestmark = pytest.mark.fast   # the fast lane (docs/testing.md)

NOT_RESTORED_TAIL = (" was found in the checkpoint, but could not be restored. Please provide a "
                     "`CheckpointHandlerRegistry`, or call `restore` with an appropriate `CheckpointArgs` subclass.")


@pytest.fixture
def unfiltered(monkeypatch):
    """The absl and asyncio loggers without the filters other tests installed, so the records
    reach caplog as the libraries emit them."""
    for name in ("absl", "asyncio"):
        monkeypatch.setattr(logging.getLogger(name), "filters", [])


def test_orbax_still_warns_about_unrequested_items_in_the_words_we_match(tmp_path, caplog, unfiltered):
    items = ("state", "data", "theirs")
    with ocp.CheckpointManager(tmp_path, item_names=items) as manager:
        manager.save(1, args=ocp.args.Composite(**{item: ocp.args.JsonSave({"x": 1}) for item in items}))
        manager.wait_until_finished()
    with caplog.at_level(logging.WARNING), ocp.CheckpointManager(tmp_path, item_names=items) as manager:
        manager.metadata(1)   # as Checkpointer.saved_optimizer reads it, with no item's handler known
    warned = {item: [r for r in caplog.records if orbax_logs.NOT_RESTORED in r.getMessage()
                     and f'"{item}"' in r.getMessage()] for item in ("data", "theirs")}
    assert warned["data"] and warned["theirs"], [r.getMessage() for r in caplog.records]
    assert orbax_logs.ORBAX_PATH in warned["data"][0].pathname   # how PendingSaveErrors tells orbax's logs
    keep = UnrequestedItems(("state", "data")).filter
    assert not keep(warned["data"][0]) and keep(warned["theirs"][0])


def test_only_our_own_unrequested_items_are_quiet():
    def record(message):
        return logging.LogRecord("absl", logging.WARNING, __file__, 1, message, None, None)

    keep = UnrequestedItems(("state", "data", "model_config")).filter
    assert not keep(record('Item "data"' + NOT_RESTORED_TAIL)) and not keep(record('Item "state"' + NOT_RESTORED_TAIL))
    assert keep(record('Item "someone_elses"' + NOT_RESTORED_TAIL))
    assert keep(record("Item \"data\" could not be written"))


def test_asyncio_still_says_never_retrieved_in_the_words_we_match(caplog, unfiltered):
    loop = asyncio.new_event_loop()
    try:
        future = loop.create_future()
        future.set_exception(ValueError("lost"))
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            del future
            gc.collect()
    finally:
        loop.close()
    lost = [r for r in caplog.records if r.name == "asyncio"]
    assert lost and str(lost[0].msg).startswith(orbax_logs.NEVER_RETRIEVED), [str(r.msg) for r in lost]
    assert AbandonedOrbaxTasks().filter(lost[0])   # our own lost error: still shown


def test_a_closed_loops_callback_is_recognised_and_nothing_else():
    loop = asyncio.new_event_loop()
    loop.close()
    with pytest.raises(RuntimeError) as closed:
        loop.call_soon_threadsafe(lambda: None)   # what a tensorstore read does after orbax closed the loop

    def unraisable(error, tb, obj=None):
        return types.SimpleNamespace(exc_value=error, exc_traceback=tb, object=obj)

    assert orbax_logs.is_closed_loop_callback(unraisable(closed.value, closed.value.__traceback__))
    assert not orbax_logs.is_closed_loop_callback(unraisable(closed.value, closed.value.__traceback__, obj=loop))
    other = RuntimeError(orbax_logs.CLOSED_LOOP)
    assert not orbax_logs.is_closed_loop_callback(unraisable(other, None))   # not from call_soon_threadsafe


def test_abandoned_restore_reads_are_not_echoed_but_other_lost_errors_are():
    """The asyncio log filter drops 'exception was never retrieved' for orbax's tasks and for
    tensorstore reads whose future had no one left to await it (set from C++: no traceback,
    tensorstore's spec in the text), and nothing else."""
    def record(message, error, tb=None):
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, message, None,
                                 (type(error), error, tb))

    read = ValueError("DATA_LOSS: Error reading \"x/.zarray\" [tensorstore_spec='{\"driver\":\"zarr\"}']")
    lost = ValueError("something else went wrong")
    keep = AbandonedOrbaxTasks().filter
    assert not keep(record("Future exception was never retrieved\nfuture: <Future finished>", read))
    assert keep(record("Future exception was never retrieved\nfuture: <Future finished>", lost))
    try:
        raise read
    except ValueError as error:   # with a traceback from our own code, it is not orbax's read
        assert keep(record("Task exception was never retrieved", error, error.__traceback__))
    assert keep(record("unrelated asyncio error", read))


def test_orbax_errors_are_dropped_only_while_a_save_is_pending():
    errors = orbax_logs.save_errors()
    assert errors is orbax_logs.save_errors() and errors in logging.getLogger("absl").filters   # one, installed once

    def record(path, level=logging.ERROR):
        return logging.LogRecord("absl", level, path, 1, "Traceback ...", None, None)

    orbax_file = f"/site-packages/{orbax_logs.ORBAX_PATH}/_src/checkpoint_manager.py"
    filter_ = orbax_logs.PendingSaveErrors()
    assert filter_.filter(record(orbax_file))
    filter_.pending = 1
    assert not filter_.filter(record(orbax_file))
    assert filter_.filter(record("/site-packages/roformer/train/checkpoint.py"))
    assert filter_.filter(record(orbax_file, logging.WARNING))
