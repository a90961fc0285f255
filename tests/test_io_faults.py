"""I/O faults and bad bytes end in one line naming the file or cache entry, and what a killed
or failed write left is cleaned up: a full disk (token shards, tokenizer cache, metrics and
TensorBoard, GLUE outputs), a truncated cached tokenizer, a killed shard build's staging
directory, a GLUE TSV that is not UTF-8."""
import errno
import shutil
import subprocess
import sys

import numpy as np
import pytest

from helpers import cache_entries
from roformer import cli
from roformer.data import DataConfig, make_pretrain_data
from roformer.data import shards as shards_lib


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def one_line_error(call, capsys) -> str:
    """What the command line prints for the error `call()` raises: one line, status 2."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info, cli.user_errors():
        call()
    assert exit_info.value.code == cli.EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err[len("error: "):-1]


def embedded(cache, **overrides) -> DataConfig:
    return DataConfig(**{"source": "embedded", "vocab_size": 500, "cache_dir": str(cache), **overrides})


def build(cache, **overrides):
    return make_pretrain_data(embedded(cache, **overrides), seq_len=32, batch_size=2, seed=0, show_progress=False)


def test_a_truncated_cached_tokenizer_is_rebuilt_and_named_as_a_cache_entry(tmp_path, caplog):
    first = build(tmp_path)
    [entry] = cache_entries(tmp_path / "tokenizers")
    path = entry / "tokenizer.json"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])   # a full disk cut it short
    again = build(tmp_path)
    assert again.vocab_size == first.vocab_size and again.tokenizer.hash   # a working tokenizer again
    warning = [r.getMessage() for r in caplog.records if "unusable" in r.getMessage()]
    assert warning and f"tokenizer cache entry {entry} is unusable" in warning[0] and "data.vocab" not in warning[0]


def test_a_killed_builds_staging_directories_are_gone_after_the_next_run(tmp_path):
    shards_root, tokenizers_root = tmp_path / "shards", tmp_path / "tokenizers"
    left = [shards_root / f".embedded-0123.partial-{dead_pid()}-0badc0de",
            tokenizers_root / f".embedded-4567.partial-{dead_pid()}-0badc0de"]
    for directory in left:
        directory.mkdir(parents=True)
        (directory / "shard_00000.tokens.npy").write_bytes(b"half")
    build(tmp_path)
    assert not any(directory.exists() for directory in left)
    assert not [p for p in [*shards_root.iterdir(), *tokenizers_root.iterdir()] if ".partial-" in p.name]


def test_a_full_disk_while_writing_shards_is_one_line_naming_the_cache_entry(tmp_path, monkeypatch, capsys):
    real_save = np.save

    def short_write(path, array, *args, **kwargs):   # numpy's words for a full disk, no errno
        if "tokens" in str(path):
            raise OSError("751923 requested and 28608 written")
        return real_save(path, array, *args, **kwargs)

    build(tmp_path)   # the tokenizer; then the shards again
    for entry in cache_entries(tmp_path / "shards"):
        shutil.rmtree(entry)
    monkeypatch.setattr(shards_lib.np, "save", short_write)
    message = one_line_error(lambda: build(tmp_path), capsys)
    assert message.startswith(f"could not write the token shard cache entry {tmp_path / 'shards'}/embedded-")
    assert "no space left on device (751923 requested and 28608 written)" in message and "\n" not in message
    assert not [p for p in (tmp_path / "shards").iterdir() if ".partial-" in p.name]


def test_a_full_disk_while_saving_a_trained_tokenizer_is_one_line(tmp_path, monkeypatch, capsys):
    from roformer.data.tokenizer import WordPieceTokenizer

    def full(self, directory):
        raise Exception("No space left on device (os error 28)")   # as the Rust library says it

    monkeypatch.setattr(WordPieceTokenizer, "save", full)
    message = one_line_error(lambda: build(tmp_path), capsys)
    assert message.startswith(f"could not write the tokenizer cache entry {tmp_path / 'tokenizers'}/embedded-")


def test_any_other_full_disk_is_one_line_naming_its_file(capsys):
    def write():
        raise OSError(errno.ENOSPC, "No space left on device", "/runs/x/metrics.jsonl")

    assert one_line_error(write, capsys) == ("could not write /runs/x/metrics.jsonl: No space left on device; "
                                             "free some space and run the same command again")


def test_a_full_disk_at_a_metrics_or_tensorboard_flush_is_one_line(tmp_path, capsys, monkeypatch):
    from tensorboardX import SummaryWriter

    from roformer.train.metrics import MetricsWriter

    writer = MetricsWriter(tmp_path, enabled=True)
    writer.write(1, {"loss": 2.0})

    def full(self):
        raise OSError(errno.ENOSPC, "No space left on device")   # no file name: the events writer's

    monkeypatch.setattr(SummaryWriter, "flush", full)
    message = one_line_error(lambda: writer.write(2, {"loss": 1.5}), capsys)
    assert message.startswith(f"could not write the metrics of {tmp_path} (metrics.jsonl, tensorboard/): no space "
                              "left on device")
    monkeypatch.undo()
    writer.close()


@pytest.mark.parametrize("workdir", ["runs/tiny", "/tmp/my runs/tiny $x", "runs/it's"])
def test_the_next_glue_command_runs_in_a_shell_as_printed(workdir):
    import shlex

    from roformer.pretrain import next_steps

    command = next_steps({"final_step": 10}, workdir).split("Next, GLUE: ", 1)[1]
    args = shlex.split(command, comments=True)   # what a shell runs: the note after `#` is a comment
    assert args == ["python", "-m", "roformer.glue", "--config=configs/glue.py:smoke", f"--config.init={workdir}",
                    f"--workdir={workdir}_glue"]   # the smoke variant: minutes, not hours
    assert "'--config.task=<task|all>' runs the full protocol" in command   # quoted: < and | are the shell's


def test_ctrl_c_outside_a_training_loop_is_one_line_and_status_130(capsys):
    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as exit_info, cli.user_errors():
        interrupted()
    assert exit_info.value.code == 130
    assert capsys.readouterr().err == "error: interrupted (Ctrl-C)\n"


def test_a_full_disk_while_glue_logs_is_one_line_naming_its_outputs(tmp_path, capsys, monkeypatch):
    from roformer.glue.run import RunLog

    log = RunLog(tmp_path, {"config": {}})
    log.write("wnli", 0, 1, {"loss": 0.7})
    real_open = open

    class Full:
        def __init__(self, file):
            self.file = file

        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, name):
            return getattr(self.file, name)

    monkeypatch.setattr("builtins.open", lambda *a, **k: Full(real_open(*a, **k)))
    message = one_line_error(lambda: log.write("mrpc", 0, 1, {"loss": 0.6}), capsys)
    monkeypatch.undo()
    assert message.startswith(f"could not write the GLUE metrics in {tmp_path}: no space left on device")
    log.close()
