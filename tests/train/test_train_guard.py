"""roformer.train.guard: the divergence guard."""

import numpy as np
import pytest

pytestmark = pytest.mark.fast   # the fast lane (docs/testing.md)




def test_divergence_guard_stops_a_finite_spike_after_patience_but_not_warmup_or_noise():
    """The guard judges rows only after warmup and against the median of recent in-range
    losses: warmup spikes, noise and a short spike pass; `patience` out-of-range rows in a
    row stop; a nearly solved task's tiny losses are compared with at least 1 nat; factor 0
    is off."""
    from roformer.train.guard import DivergenceGuard, TrainingDiverged

    guard = DivergenceGuard(factor=3.0, patience=3, window=20, after_step=25)
    for step, loss in [(10, 8.0), (20, 60.0), (30, 7.0)]:   # a warmup spike is recorded, not judged
        assert guard.check_loss(step, loss) is None
    rng = np.random.default_rng(0)
    for step in range(40, 400, 10):                         # noisy, slowly falling: never out of range
        assert guard.check_loss(step, 6.0 - step / 200 + rng.normal(0, 0.5)) is None
    assert not guard.suspicious and guard.last_good_step == 390
    assert guard.check_loss(400, 1e8) is None and guard.check_loss(410, 1e8) is None   # two strikes
    assert guard.suspicious and guard.last_good_step == 390
    assert guard.check_loss(420, 5.0) is None and not guard.suspicious              # recovered: reset
    guard.check_loss(430, 1e8), guard.check_loss(440, 1e8)
    reason = guard.check_loss(450, 1e8)
    assert reason.startswith("training loss 1e+08 stayed above 3 x its recent median") and guard.last_good_step == 420

    solved = DivergenceGuard(after_step=0, history=[0.02, 0.05, 0.01, 0.03, 0.02])
    assert solved.check_loss(10, 0.5) is None and not solved.suspicious     # 25x the median, below 3 nats
    off = DivergenceGuard(factor=0, patience=1, history=[5.0] * 5)
    assert off.check_loss(10, 1e8) is None and off.check_eval(10, 1e8) is None
    assert off.check_eval(20, float("nan")) == "non-finite held-out loss nan"   # NaN stops even when off

    evals = DivergenceGuard(after_step=25)
    assert evals.check_eval(0, 5.0) is None and evals.check_eval(10, 40.0) is None   # warmup: not judged
    assert evals.check_eval(100, 4.0) is None and evals.best_eval == 4.0
    assert evals.check_eval(200, 13.0).startswith("held-out loss 13 is above 3 x the best so far, 4")
    assert issubclass(TrainingDiverged, FloatingPointError)
    with pytest.raises(ValueError, match="divergence_factor=0.5 must be above 1"):
        DivergenceGuard(factor=0.5)
