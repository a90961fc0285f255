"""Nothing restored silently wrong: a checkpoint whose arrays or metadata changed on disk is
moved aside like an unreadable one and the run falls back to the previous one; a divergence
right after a resume names a checkpoint before the one resumed from."""
from roformer.train.guard import DivergenceGuard


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
