"""The shard cache's build lock: a lock left by a stopped build or a dangling symbolic link
is taken over, and a cache that cannot be written is one line, not a traceback."""
import logging

from helpers import finishes, needs_unwritable, one_line_error, UNWRITABLE
from roformer import cli
from roformer.data import cache_lock
from roformer.errors import UserError


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
    """SIGTERM's default action ends a build before it can remove its lock file; the kernel
    released the flock with the process, and the next build takes the file over, saying so."""
    target = tmp_path / "shards" / "entry"
    target.parent.mkdir()
    (target.parent / ".entry.lock").write_text("host elsewhere pid 4194304\n")
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
