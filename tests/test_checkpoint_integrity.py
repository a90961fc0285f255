"""Nothing restored silently wrong: a checkpoint whose arrays or metadata changed on disk is
moved aside like an unreadable one and the run falls back to the previous one; a divergence
right after a resume names a checkpoint before the one resumed from."""
import json
import logging
import shutil
from pathlib import Path

import pytest

from helpers import MICRO_MODEL, tiny_run_config
from roformer.train.guard import DivergenceGuard

OVERRIDES = {
    **MICRO_MODEL,
    "train.steps": 8, "train.batch_size": 8, "train.seq_len": 32, "train.warmup_steps": 1,
    "train.log_every": 2, "train.eval_every": 4, "train.eval_batches": 1, "train.eval_attention_stats": False,
    "train.checkpoint_every": 4, "train.keep_checkpoints": 3, "train.progress_bar": False,
    "mesh.num_devices": 1,
}


def make_config(cache: Path, **extra):
    return tiny_run_config(cache, OVERRIDES, **extra)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run checkpointed at steps 4 and 8, and its data cache."""
    from roformer.train import train_and_evaluate

    cache = tmp_path_factory.mktemp("cache")
    workdir = tmp_path_factory.mktemp("trained") / "run"
    train_and_evaluate(make_config(cache), workdir)
    return workdir, cache


def flip_bit(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x04
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["array", "iterator_state"])
def test_a_damaged_newest_checkpoint_is_moved_aside_and_the_previous_one_resumed(trained, tmp_path, caplog, damage):
    """A flipped bit in an array file still decodes (orbax restores it silently, a changed
    value), and an edited data-iterator state is still valid JSON: the checksums saved with the
    step find both, and the run resumes from step 4."""
    from roformer.train import train_and_evaluate

    finished, cache = trained
    workdir = tmp_path / "run"
    shutil.copytree(finished, workdir)
    step8 = workdir / "checkpoints" / "8"
    if damage == "array":
        target = max((p for p in (step8 / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
        flip_bit(target, target.stat().st_size // 2)
    else:
        target = step8 / "data" / "metadata"
        text = target.read_text()
        assert '"step": 8' in text
        target.write_text(text.replace('"step": 8', '"step": 9'))   # valid, and wrong
    with caplog.at_level(logging.WARNING, logger="roformer.train"):
        summary = train_and_evaluate(make_config(cache, **{"train.steps": 10}), workdir)
    assert summary["start_step"] == 4 and summary["final_step"] == 10
    assert (workdir / "corrupt_checkpoints" / "8").is_dir()
    assert (workdir / "checkpoints" / "10" / "checksums.json").is_file()   # the new saves carry them too
    name = target.relative_to(step8).as_posix()
    said = [r.getMessage() for r in caplog.records if "checksums saved with it" in r.getMessage()]
    assert said and said[0].startswith(f"checkpoint at step 8 in {workdir / 'checkpoints'} is unreadable: it does "
                                       f"not match the checksums saved with it ({name} ") and "trying step 4" in said[0]


def test_a_divergence_before_any_good_row_since_the_resume_distrusts_the_resumed_checkpoint():
    guard = DivergenceGuard(factor=3.0, patience=1, window=20, after_step=10, history=[3.0] * 10,
                            last_good_step=60, last_good_eval_step=60, resumed_step=60)
    assert guard.good_checkpoint_step() == 59   # not 60: it may be what produced the divergence
    assert guard.check_loss(70, 2.9) is None    # a row in range since the resume: 60 (and 69) are trusted
    assert guard.good_checkpoint_step() == 69
    fresh = DivergenceGuard(factor=3.0, patience=1, window=20, after_step=10)
    assert fresh.good_checkpoint_step() == 0     # a run from step 0 has nothing before it


def test_checksums_find_a_flipped_bit_a_cut_file_and_a_missing_one(tmp_path):
    import pytest

    from roformer import checksums

    step = tmp_path / "60"
    (step / "state" / "d").mkdir(parents=True)
    (step / "state" / "d" / "chunk").write_bytes(bytes(range(256)) * 64)
    (step / "_CHECKPOINT_METADATA").write_text('{"custom_metadata": {"optimizer": {"learning_rate": 0.001}}}')
    assert checksums.verify(step) is False      # none written: restored unverified
    checksums.write(step)
    assert checksums.verify(step) is True
    chunk = step / "state" / "d" / "chunk"
    data = bytearray(chunk.read_bytes())
    data[1234] ^= 0x10                            # one flipped bit, same size
    chunk.write_bytes(bytes(data))
    with pytest.raises(checksums.ChecksumMismatch, match="state/d/chunk does not match the CRC32"):
        checksums.verify(step)
    chunk.write_bytes(bytes(data[:100]))
    with pytest.raises(checksums.ChecksumMismatch, match="state/d/chunk has 100 bytes, 16384 when saved"):
        checksums.verify(step)
    chunk.unlink()
    with pytest.raises(checksums.ChecksumMismatch, match="state/d/chunk is missing"):
        checksums.verify(step)


def test_a_damaged_checkpoint_is_refused_by_its_readers_in_one_line(trained, tmp_path):
    """GLUE init, warm starts and convert read a run through PretrainWorkdir: a step whose files
    changed is refused naming it, not loaded with changed values."""
    from roformer.errors import ConfigError
    from roformer.workdir import PretrainWorkdir

    finished, _ = trained
    workdir = tmp_path / "run"
    shutil.copytree(finished, workdir)
    target = max((p for p in (workdir / "checkpoints" / "8" / "state").rglob("*") if p.is_file()),
                 key=lambda p: p.stat().st_size)
    flip_bit(target, target.stat().st_size // 3)
    run = PretrainWorkdir(workdir)
    with pytest.raises(ConfigError, match=r"the checkpoint at step 8 does not match the checksums saved with it "
                                          r"\(state/.* does not match the CRC32 saved with it\); it is damaged"):
        run.params(8)
    assert run.params(4)[1]   # the other step still loads


def flip_step_metadata(step_dir: Path) -> None:
    """One flipped bit in orbax's step metadata, which its CheckpointManager parses when it
    opens the directory: "item_handlers" becomes "item_hanflers", valid JSON orbax refuses."""
    path = step_dir / "_CHECKPOINT_METADATA"
    data = bytearray(path.read_bytes())
    data[data.index(b"item_handlers") + 8] ^= 0x02   # d -> f
    path.write_bytes(bytes(data))
    assert b"item_hanflers" in path.read_bytes()


@pytest.mark.parametrize("damaged, checksummed", [(8, True), (8, False), (4, True)])
def test_a_flipped_bit_in_a_steps_metadata_moves_that_step_aside_on_resume(trained, tmp_path, caplog, damaged,
                                                                          checksummed):
    """orbax reads every step's metadata when it opens the checkpoints: one damaged step must
    not fail the open, so it is found first (by its checksums, or as orbax parses it in a step
    saved without them) and moved aside; the run resumes from the newest intact step."""
    from roformer.train import train_and_evaluate

    finished, cache = trained
    workdir = tmp_path / "run"
    shutil.copytree(finished, workdir)
    flip_step_metadata(workdir / "checkpoints" / str(damaged))
    if not checksummed:
        (workdir / "checkpoints" / str(damaged) / "checksums.json").unlink()
    with caplog.at_level(logging.WARNING, logger="roformer.train"):
        summary = train_and_evaluate(make_config(cache, **{"train.steps": 10}), workdir)
    assert summary["start_step"] == (4 if damaged == 8 else 8) and summary["final_step"] == 10
    assert (workdir / "corrupt_checkpoints" / str(damaged) / "_CHECKPOINT_METADATA").is_file()
    said = [r.getMessage() for r in caplog.records if f"checkpoint at step {damaged} in" in r.getMessage()]
    assert len(said) == 1 and "is unreadable: it " in said[0], said
    assert ("CRC32" if checksummed else "unknown key item_hanflers") in said[0]


def test_readers_fall_back_from_a_step_with_damaged_metadata_to_the_one_before(trained, tmp_path, caplog):
    """roformer.evaluate, convert to-hf and GLUE init take the newest intact step, with a
    warning line, and leave the damaged one where it is; a named step is read whatever
    another step's metadata holds."""
    from roformer import convert, evaluate
    from roformer.errors import ConfigError
    from roformer.glue.init import load_init
    from roformer.workdir import PretrainWorkdir

    finished, _ = trained
    workdir = tmp_path / "run"
    shutil.copytree(finished, workdir)
    flip_step_metadata(workdir / "checkpoints" / "8")
    with caplog.at_level(logging.WARNING, logger="roformer"):
        evaluate.main(["--workdir", str(workdir)])
        assert (workdir / "eval_4.json").is_file() and not (workdir / "eval_8.json").exists()
        convert.main(["to-hf", str(workdir), str(tmp_path / "hf")])
        assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "roformer"
        init = load_init(str(workdir))
        assert init.step == 4 and init.encoder_params
    said = [r.getMessage() for r in caplog.records if "the checkpoint at step 8" in r.getMessage()]
    assert len(said) == 3 and all(line.endswith("; using step 4, the newest before it") for line in said), said
    assert (workdir / "checkpoints" / "8").is_dir()   # a reader moves nothing
    with pytest.raises(ConfigError, match="the checkpoint at step 8 does not match the checksums saved with it "
                                          r"\(_CHECKPOINT_METADATA does not match the CRC32"):
        PretrainWorkdir(workdir).params(8)   # named: refused, not replaced by another
    shutil.copytree(finished / "checkpoints" / "8", workdir / "checkpoints" / "8", dirs_exist_ok=True)
    flip_step_metadata(workdir / "checkpoints" / "4")
    assert PretrainWorkdir(workdir).params(8)[1]   # another step's damage does not fail this one
