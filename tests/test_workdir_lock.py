"""One run per workdir: a second run is refused naming the holder, a dead holder's lock is
taken over, the lock goes when its run ends, and nested runs of one process go ahead."""
import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest

from helpers import finishes
from roformer import workdir_lock as lock_module
from roformer.configs import glue as glue_config
from roformer.configs import tiny
from roformer.ablation import plan, runner, stages
from roformer.glue.run import run_glue
from roformer.train import train_and_evaluate
from roformer.workdir_lock import LOCK_FILE, WorkdirBusy, process_state, workdir_lock

REPO = Path(__file__).resolve().parents[1]
HOLD = ("import sys, time\nfrom roformer.workdir_lock import workdir_lock\n"
        "with workdir_lock(sys.argv[1]):\n    print('locked', flush=True)\n    time.sleep(float(sys.argv[2]))\n")


def hold(workdir: Path, seconds: float) -> subprocess.Popen:
    """Another process holding `workdir`'s lock for `seconds` (returns once it holds it)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(workdir), str(seconds)], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def write_lock(workdir: Path, pid: int, host: str | None = None) -> Path:
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / LOCK_FILE
    path.write_text(json.dumps({"host": host or socket.gethostname(), "pid": pid, "since": "earlier"}))
    return path


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()   # reaped: the pid names no process now
    return proc.pid


def test_second_process_is_refused_at_once_naming_the_holder(tmp_path, caplog):
    holder = hold(tmp_path / "run", 60)
    try:
        start = time.time()
        with pytest.raises(WorkdirBusy) as refused:
            with workdir_lock(tmp_path / "run"):
                pass
        assert time.time() - start < 5
        message = str(refused.value)
        assert "\n" not in message
        assert f"in use by another run (host {socket.gethostname()}, pid {holder.pid}," in message
        # ...and a command on it is refused too, with that one line, no traceback and status 2
        other = subprocess.run([sys.executable, "-m", "roformer.glue", "--config.task=wnli",
                                f"--workdir={tmp_path / 'run'}"], cwd=REPO, capture_output=True, text=True)
        assert other.returncode == 2
        assert other.stderr.splitlines() == [f"error: {message}"]
    finally:
        holder.kill()   # SIGKILL: no clean-up, so the lock is left behind, stale
        holder.wait()
    # its holder is dead: the next run takes the lock over, with a warning
    with caplog.at_level(logging.WARNING, logger="roformer"):
        with workdir_lock(tmp_path / "run"):
            assert json.loads((tmp_path / "run" / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert f"no longer running (host {socket.gethostname()}, pid {holder.pid})" in caplog.text
    assert not (tmp_path / "run" / LOCK_FILE).exists()


def test_lock_is_released_when_its_run_ends(tmp_path):
    (tmp_path / "a").mkdir()
    subprocess.run([sys.executable, "-c", HOLD, str(tmp_path / "a"), "0"], cwd=REPO, check=True,
                   capture_output=True)
    assert (tmp_path / "a").is_dir() and not (tmp_path / "a" / LOCK_FILE).exists()
    with pytest.raises(RuntimeError, match="boom"):
        with workdir_lock(tmp_path / "b"):
            assert (tmp_path / "b" / LOCK_FILE).is_file()
            raise RuntimeError("boom")
    assert not (tmp_path / "b").exists()   # made for the lock and left empty: removed again
    with workdir_lock(tmp_path / "c"):
        (tmp_path / "c" / "metrics.jsonl").write_text("")
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["metrics.jsonl"]


def test_stale_lock_is_taken_over_and_a_live_or_foreign_one_refused(tmp_path, caplog):
    stale = dead_pid()
    path = write_lock(tmp_path, stale)
    with caplog.at_level(logging.WARNING, logger="roformer"):
        with workdir_lock(tmp_path):
            assert json.loads(path.read_text())["pid"] == os.getpid()
    assert f"pid {stale}" in caplog.text and not path.exists()

    write_lock(tmp_path, os.getppid())   # alive (pytest's parent)
    with pytest.raises(WorkdirBusy, match=f"pid {os.getppid()}, since earlier"):
        with workdir_lock(tmp_path):
            pass
    write_lock(tmp_path, stale, host="elsewhere")   # can't tell from here whether it runs
    with pytest.raises(WorkdirBusy, match=f"host elsewhere, pid {stale}"):
        with workdir_lock(tmp_path):
            pass


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="tells a zombie by /proc (Linux)")
def test_a_killed_holder_not_yet_reaped_is_taken_over(tmp_path, caplog):
    # A run killed with its parent waits for init to reap it, seconds in some containers;
    # its pid still answers kill(pid, 0) meanwhile.
    holder = hold(tmp_path, 60)
    holder.kill()
    while process_state(holder.pid) != "Z":
        time.sleep(0.01)
    try:
        with caplog.at_level(logging.WARNING, logger="roformer"):
            with workdir_lock(tmp_path):
                assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
        assert f"pid {holder.pid}" in caplog.text
    finally:
        holder.wait()


def test_same_process_reenters_and_only_process_0_locks(tmp_path, monkeypatch):
    with workdir_lock(tmp_path):
        with workdir_lock(tmp_path / "."):   # the same directory, entered again
            with workdir_lock(tmp_path / "sub"):
                assert (tmp_path / "sub" / LOCK_FILE).is_file()
        assert (tmp_path / LOCK_FILE).is_file()   # held until the outermost exit
    assert not (tmp_path / LOCK_FILE).exists()

    write_lock(tmp_path, os.getppid())
    monkeypatch.setattr(jax, "process_index", lambda: 1)   # another host of a multi-host run
    with workdir_lock(tmp_path / "other"):
        pass
    assert not (tmp_path / "other").exists()


def test_pretraining_glue_and_ablation_refuse_a_busy_workdir(tmp_path):
    write_lock(tmp_path, os.getppid())
    pretrain = tiny.get_config()
    with pytest.raises(WorkdirBusy):
        train_and_evaluate(pretrain, tmp_path)
    with pytest.raises(WorkdirBusy):
        run_glue(glue_config.get_config(), tmp_path)
    with pytest.raises(WorkdirBusy):
        runner.run_ablation(plan.load_config_file("ablation", "smoke"), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_FILE]   # nothing was written


def test_ablation_stages_lock_their_own_workdirs_under_the_ablation_lock(tmp_path, monkeypatch):
    seen = []

    def stage(cfg, workdir):   # as the real runners do: train_and_evaluate / run_glue lock workdir
        with workdir_lock(workdir), workdir_lock(tmp_path):   # and the same process re-entering
            seen.append(((tmp_path / LOCK_FILE).is_file(), (workdir / LOCK_FILE).is_file()))
        raise RuntimeError("stop here")   # recorded as a failed stage; the ablation goes on

    monkeypatch.setitem(stages.STAGE_RUNNERS, "pretrain", stage)
    config = plan.load_config_file("ablation", "smoke")
    config.schemes, config.seeds, config.extension.enabled = ("rope",), 1, False
    runner.run_ablation(config, tmp_path)
    assert seen and all(seen_ == (True, True) for seen_ in seen)
    assert not list(tmp_path.rglob(LOCK_FILE))


@pytest.mark.parametrize("command, config", [
    ("roformer.pretrain", "configs/tiny.py"), ("roformer.glue", "configs/glue.py"),
    ("roformer.ablate", "configs/ablation.py:smoke")])
def test_a_workdir_that_is_a_file_or_under_one_is_one_line(tmp_path, command, config):
    (tmp_path / "file").write_text("mine\n")
    for workdir, expected in [
            (tmp_path / "file", f"error: workdir {tmp_path / 'file'} is a file, not a directory; give a "
                                "directory (it is created if missing)"),
            (tmp_path / "file" / "run", f"error: workdir {tmp_path / 'file' / 'run'} cannot be created: "
                                        f"{tmp_path / 'file'} is a file, not a directory")]:
        proc = subprocess.run([sys.executable, "-m", command, f"--config={config}", f"--workdir={workdir}"],
                              cwd=REPO, capture_output=True, text=True)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert proc.stderr.splitlines() == [expected]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"] and (tmp_path / "file").read_text() == "mine\n"


def test_a_workdir_that_cannot_be_created_or_written_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    """Root may write into a chmod 555 directory, so read-only is simulated where the OS
    answers: creating the lock file (a read-only mount, no permission) or the directory."""
    import errno

    from roformer.workdir_lock import WorkdirUnusable

    real_open, real_mkdir = os.open, os.mkdir
    readonly = tmp_path / "readonly"
    readonly.mkdir()

    def open_(path, *args, **kwargs):
        if Path(path).parent == readonly:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, *args, **kwargs)

    def mkdir(path, *args, **kwargs):
        if Path(path).name == "denied":
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(os, "mkdir", mkdir)
    runs = [lambda w: train_and_evaluate(tiny.get_config(), w), lambda w: run_glue(glue_config.get_config(), w),
            lambda w: runner.run_ablation(plan.load_config_file("ablation", "smoke"), w)]
    for run in runs:
        with pytest.raises(WorkdirUnusable, match=f"^workdir {readonly} is not writable: Permission denied"):
            run(readonly)
        with pytest.raises(WorkdirUnusable, match=f"^workdir {tmp_path}/new/denied cannot be created: "
                                                  "Read-only file system"):
            run(tmp_path / "new" / "denied")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["readonly"] and not any(readonly.iterdir())
    # ...and on the command line it is one line, exit status 2
    from roformer import cli
    with pytest.raises(SystemExit) as exited, cli.user_errors():
        runs[0](readonly)
    assert exited.value.code == 2


def test_directories_made_for_a_refused_run_are_removed(tmp_path):
    with pytest.raises(RuntimeError, match="refused"):
        with workdir_lock(tmp_path / "a" / "b" / "c"):
            raise RuntimeError("refused")
    assert not any(tmp_path.iterdir())
    (tmp_path / "a").mkdir()
    with workdir_lock(tmp_path / "a" / "b" / "c"):
        (tmp_path / "a" / "b" / "note").write_text("")   # the run wrote beside its workdir
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == ["a", "a/b", "a/b/note"]


def test_an_empty_or_torn_lock_file_left_behind_is_taken_over(tmp_path, caplog, monkeypatch):
    """A lock file its writer never filled (a full disk, a kill between creating and writing
    it) holds nothing: once it is some seconds old the next run takes it over with a warning;
    a younger one is waited for (its writer may be about to fill it)."""
    import roformer.workdir_lock as lock

    monkeypatch.setattr(lock, "UNREADABLE_GRACE_S", 0.5)
    for content in ("", '{"host": "h'):
        path = tmp_path / "run" / LOCK_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
        os.utime(path, (time.time() - 10, time.time() - 10))
        with caplog.at_level(logging.WARNING, logger="roformer"), workdir_lock(tmp_path / "run"):
            assert json.loads(path.read_text())["pid"] == os.getpid()
        assert "taking over an empty or unreadable lock file" in caplog.text
        assert not path.exists()
    path.write_text("")   # fresh: its writer is waited for, then it is taken over
    start = time.time()
    with workdir_lock(tmp_path / "run"):
        assert time.time() - start >= 0.4


def test_a_full_disk_when_the_lock_is_written_leaves_no_lock_file(tmp_path, monkeypatch):
    import roformer.workdir_lock as lock

    real_fdopen = os.fdopen

    class FullDisk:
        def __init__(self, fd, mode):
            self.file = real_fdopen(fd, mode)

        def __enter__(self):
            return self

        def write(self, text):
            raise OSError(28, "No space left on device")

        def __exit__(self, *exc):
            self.file.close()

    (tmp_path / "run").mkdir()
    monkeypatch.setattr(lock.os, "fdopen", FullDisk)
    with pytest.raises(lock.WorkdirUnusable, match="not writable: No space left on device"):
        with workdir_lock(tmp_path / "run"):
            pass
    monkeypatch.setattr(lock.os, "fdopen", real_fdopen)
    assert list((tmp_path / "run").iterdir()) == []
    with workdir_lock(tmp_path / "run"):   # space freed: the next run goes ahead
        pass


def take_and_release(workdir: Path) -> None:
    with workdir_lock(workdir):
        pass


def test_an_empty_lock_with_a_future_mtime_is_taken_over(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(lock_module, "UNREADABLE_GRACE_S", 0.3)
    lock = tmp_path / "workdir.lock"
    lock.touch()
    future = lock.stat().st_mtime + 365 * 24 * 3600
    os.utime(lock, (future, future))
    with caplog.at_level(logging.INFO, logger="roformer"):
        assert finishes(lambda: take_and_release(tmp_path), 20), "waited on an empty lock dated in the future"
    assert "waiting up to" in caplog.text and "taking over an empty or unreadable lock file" in caplog.text
    assert not lock.exists()


def test_a_dangling_symlink_lock_is_removed(tmp_path, caplog):
    lock = tmp_path / "workdir.lock"
    lock.symlink_to(tmp_path / "nowhere" / "lock")
    with caplog.at_level(logging.WARNING, logger="roformer"):
        assert finishes(lambda: take_and_release(tmp_path), 20), "waited on a symbolic link to nothing"
    assert "a symbolic link to nothing" in caplog.text
    assert not lock.is_symlink()
