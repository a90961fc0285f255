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
