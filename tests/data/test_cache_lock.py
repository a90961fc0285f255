"""The shard cache's build lock (roformer.data.cache_lock.build_lock, a filelock.FileLock): a
second builder waits and says for whom; a killed builder, a lock left by a stopped build or a
dangling symbolic link never blocks and its leftover is said; a cache that cannot be written is
one line, not a traceback."""
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import filelock

from helpers import finishes, needs_unwritable, one_line_error, UNWRITABLE
from roformer import cli
from roformer.data import cache_lock
from roformer.errors import UserError


def in_thread(fn):
    done = threading.Event()
    threading.Thread(target=lambda: (fn(), done.set()), daemon=True).start()
    return done


def test_a_second_builder_waits_for_the_first_and_names_it(tmp_path, caplog):
    target = tmp_path / "shards" / "entry"
    inside, release, order = threading.Event(), threading.Event(), []

    def first():
        with cache_lock.build_lock(target):
            order.append("first")
            inside.set()
            release.wait(20)

    def second():
        with cache_lock.build_lock(target):
            order.append("second")

    first_done = in_thread(first)
    assert inside.wait(20)
    with caplog.at_level(logging.INFO, logger="roformer.data.cache_lock"):
        second_done = in_thread(second)
        time.sleep(0.5)
        assert not second_done.is_set(), "the second builder did not wait"
        release.set()
        assert first_done.wait(20) and second_done.wait(20), "the second builder waited past the release"
    assert order == ["first", "second"]
    assert f"{target} is being built by host " in caplog.text and f"pid {os.getpid()}; waiting for it" in caplog.text
    # the holder's name goes with it; nothing says a finished build was stopped
    assert not (target.parent / ".entry.builder").exists() and "taking over" not in caplog.text


def test_a_lock_held_through_filelock_elsewhere_is_waited_for(tmp_path):
    """Any filelock.FileLock on the entry's lock file is honoured (one locking library)."""
    target = tmp_path / "entry"
    held = filelock.FileLock(tmp_path / ".entry.lock")
    held.acquire()
    done = in_thread(lambda: cache_lock.build_lock(target).__enter__())
    time.sleep(0.5)
    assert not done.is_set()
    held.release()
    assert done.wait(20)


def test_a_killed_builder_does_not_block_and_its_leftover_is_said(tmp_path, caplog):
    """A builder killed by SIGKILL holds nothing (the kernel drops its flock) but leaves its
    name: the next build goes on at once and says it takes over a stopped build."""
    target = tmp_path / "entry"
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time, filelock; lock = filelock.FileLock(sys.argv[1]); lock.acquire(); "
         "open(sys.argv[2], 'w').write('host elsewhere pid 4194304\\n'); print('held', flush=True); time.sleep(600)",
         str(tmp_path / ".entry.lock"), str(tmp_path / ".entry.builder")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with caplog.at_level(logging.INFO, logger="roformer.data.cache_lock"):
            waiting = in_thread(lambda: cache_lock.build_lock(target).__enter__())
            time.sleep(0.5)
            assert not waiting.is_set(), "the lock was not held by the other process"
            holder.send_signal(signal.SIGKILL)
            assert waiting.wait(20), "a killed builder blocked the next one"
    finally:
        holder.kill()
        holder.communicate()
    assert "is being built by host elsewhere pid 4194304; waiting for it" in caplog.text
    assert "taking over the lock left by a build that was stopped (host elsewhere pid 4194304)" in caplog.text


def test_the_cache_lock_takes_a_dangling_symlink(tmp_path):
    target = tmp_path / "shards" / "entry"
    target.parent.mkdir()
    (target.parent / ".entry.lock").symlink_to(tmp_path / "nowhere" / "lock")

    def build():
        with cache_lock.build_lock(target):
            target.mkdir()
    assert finishes(build, 20)
    assert target.is_dir() and not (target.parent / ".entry.lock").is_symlink()


def test_a_shard_build_stopped_by_sigterm_leaves_a_lock_the_next_build_takes_over(tmp_path, caplog):
    """SIGTERM's default action ends a build before it can remove its name beside the lock; the
    kernel released the flock with the process, and the next build takes over, saying so."""
    target = tmp_path / "shards" / "entry"
    target.parent.mkdir()
    (target.parent / ".entry.builder").write_text("host elsewhere pid 4194304\n")
    with caplog.at_level(logging.INFO, logger="roformer.data.cache_lock"):
        assert finishes(lambda: cache_lock.build_lock(target).__enter__(), 20)
    assert "taking over the lock left by a build that was stopped (host elsewhere pid 4194304)" in caplog.text


@needs_unwritable
def test_a_cache_that_cannot_be_written_is_one_line(capsys):
    err = one_line_error(capsys, lambda: cache_lock.build_lock(UNWRITABLE / "shards-entry").__enter__())
    assert "must be built but the cache /sys/kernel cannot be written" in err


def test_user_error_types_are_what_the_command_lines_print():
    assert issubclass(cache_lock.CacheUnwritable, UserError)
    assert cli.is_user_error(OSError(36, "File name too long", "x" * 300))
