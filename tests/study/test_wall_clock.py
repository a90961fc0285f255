"""The comparison at equal wall-clock time (roformer.study.wall_clock): the interpolation of a
budget curve in tokens, the equal-time differences on synthetic power-law curves, and the
report's section beside M(T) on synthetic records."""
import math

import numpy as np
import pytest

from roformer import config_files as plan
from roformer.cli import load_config
from roformer.study import report, wall_clock

TOKENS = np.array([1e6, 2e6, 4e6, 8e6])


def power_law(tokens):
    return 6.0 * np.asarray(tokens, float) ** -0.1


def test_loss_at_is_exact_on_a_power_law_and_never_extrapolates():
    curves = np.stack([power_law(TOKENS), 2 * power_law(TOKENS)], axis=1)         # [budgets, 2]
    at = np.array([3e6, 5.5e6])
    assert wall_clock.loss_at(TOKENS, curves, at) == pytest.approx([power_law(3e6), 2 * power_law(5.5e6)])
    # At a budget itself: that budget's loss; before the first or past the last: no value.
    assert wall_clock.loss_at(TOKENS, curves, 8e6) == pytest.approx(curves[-1])
    assert wall_clock.loss_at(TOKENS, curves, 1e6) == pytest.approx(curves[0])
    assert np.isnan(wall_clock.loss_at(TOKENS, curves, 0.9e6)).all()
    assert np.isnan(wall_clock.loss_at(TOKENS, curves, 8.1e6)).all()
    # A budget that is not finite (a diverged member) gives no value where it brackets.
    broken = curves.copy()
    broken[2, 0] = math.nan
    got = wall_clock.loss_at(TOKENS, broken, np.array([3e6, 3e6]))
    assert np.isnan(got[0]) and got[1] == pytest.approx(2 * power_law(3e6))
    assert wall_clock.loss_at(TOKENS, broken, np.array([1.5e6, 1.5e6]))[0] == pytest.approx(power_law(1.5e6))
    with pytest.raises(ValueError):
        wall_clock.loss_at(TOKENS[::-1], curves, 2e6)


def _curves(seeds=4, items=6, noise=0.0, rng=None):
    """loss [budgets, seeds, items] summed per item (10 predictions each) on the power law."""
    weight = np.full(items, 10.0)
    loss = np.broadcast_to(power_law(TOKENS)[:, None, None] * weight, (len(TOKENS), seeds, items)).copy()
    if noise:
        loss *= np.exp(rng.normal(0, noise, loss.shape))
    return loss, weight


def test_at_equal_time_a_scheme_at_half_the_throughput_is_read_at_half_the_tokens():
    loss, weight = _curves()
    rows = wall_clock.equal_time_rows(TOKENS, loss, TOKENS, loss, weight, 0.5, samples=50)
    assert [r["scheme_tokens"] for r in rows] == pytest.approx(TOKENS * 0.5)
    assert math.isnan(rows[0]["diff"]) and math.isnan(rows[0]["lo"])     # 0.5M tokens: before its first budget
    for row, t in zip(rows[1:], TOKENS[1:]):
        assert row["diff"] == pytest.approx(power_law(t / 2) - power_law(t))   # exact: identical per token
        assert row["diff"] > 0
    # At the same throughput, the equal-token comparison: no difference.
    same = wall_clock.equal_time_rows(TOKENS, loss, TOKENS, loss, weight, 1.0, samples=50)
    assert [r["diff"] for r in same] == pytest.approx([0.0] * len(TOKENS), abs=1e-12)
    # A faster scheme is read at more tokens: past its last budget, no value.
    fast = wall_clock.equal_time_rows(TOKENS, loss, TOKENS, loss, weight, 1.5, samples=50)
    assert math.isnan(fast[-1]["diff"]) and fast[0]["diff"] < 0
    with pytest.raises(ValueError):
        wall_clock.equal_time_rows(TOKENS, loss, TOKENS, loss, weight, 0.0, samples=10)


def test_the_equal_time_interval_is_the_paired_bootstrap_and_covers_the_truth():
    rng = np.random.default_rng(0)
    loss, weight = _curves(seeds=6, items=40, noise=0.02, rng=rng)
    reference, _ = _curves(seeds=6, items=40, noise=0.02, rng=rng)
    rows = wall_clock.equal_time_rows(TOKENS, loss, TOKENS, reference, weight, 0.5, samples=400)
    for row, t in zip(rows[1:], TOKENS[1:]):
        assert row["lo"] < row["diff"] < row["hi"]
        assert row["lo"] < power_law(t / 2) - power_law(t) < row["hi"]
        assert row["hi"] - row["lo"] < 0.1


def test_a_members_throughput_is_its_groups_over_the_groups_members():
    record = {"members": [{}] * 30, "edges": {"members": 6}, "timing": {"tokens_per_s": 2.4e6}}
    assert wall_clock.member_throughput(record) == pytest.approx(1e5)     # 24 members in its own group
    assert wall_clock.member_throughput({"members": [{}] * 3, "timing": {}}) is None


# --------------------------------------------------------------------------- the report

RATES, SEEDS, BUDGETS, TOKENS_PER_STEP, ITEMS = (1e-3, 2e-3, 4e-3), 3, (10, 18, 20), 128, 5


def _config():
    c = load_config(f"{plan.CONFIG_DIR / 'study.py'}:gpu_smoke")
    c.study.schemes, c.study.seeds, c.study.learning_rates = "rope,alibi", SEEDS, ",".join(map(str, RATES))
    c.study.budget_steps, c.study.tuning_seeds, c.study.scored_seeds = ",".join(map(str, BUDGETS)), "0", "1,2"
    c.study.bootstrap = 50
    return c


def _record(scheme: str, tokens_per_s: float, device: str, stretch: float = 1.0) -> tuple[dict, dict]:
    """Every member on the power law, `stretch` times slower per token; the middle rate chosen."""
    members = [{"index": r * SEEDS + s, "seed": s, "rate": rate} for r, rate in enumerate(RATES) for s in range(SEEDS)]
    validation = [{1e-3: 5.0, 2e-3: 4.9, 4e-3: 5.2}[m["rate"]] for m in members]
    weight = np.full(ITEMS, 20.0)
    arrays = {"test_weight": weight, **{f"budget{s}": np.tile(weight * power_law(s * TOKENS_PER_STEP / stretch),
                                                                (len(members), 1)) for s in BUDGETS}}
    evals = [{"step": s, "tokens": s * TOKENS_PER_STEP, "validation_loss": [6.0] * len(members),
              "gaps": {f"shuffle{w}": [0.5] * len(members) for w in (2, 8, 32)}, "signal": {}}
             for s in range(0, BUDGETS[-1] + 1, 2)]
    record = {"scheme": scheme, "members": members, "tokens_per_step": TOKENS_PER_STEP, "evals": evals,
              "budgets": [{"steps": s, "validation_loss": validation, "diverged_at": [None] * len(members)}
                          for s in BUDGETS], "diverged_at": [None] * len(members), "parameters": 1000,
              "timing": {"compile_s": 1.0, "train_s": 1.0, "eval_s": 1.0, "wall_s": 3.0, "tokens_per_s": tokens_per_s},
              "device": device}
    return record, arrays


def test_the_report_reads_the_comparison_at_equal_time_beside_m_of_t():
    config = _config()
    # alibi: the same loss per token as rope, at 0.6 of rope's throughput.
    runs = {"rope": _record("rope", 9e5, "H200"), "alibi": _record("alibi", 5.4e5, "H200")}
    result = report.summarize(config, None, runs)
    md = report.markdown(config, result, {})
    clock = result["wall_clock"]
    assert clock["throughput"]["alibi"]["member_tokens_per_s"] == pytest.approx(5.4e5 / 9)
    assert clock["throughput"]["alibi"]["ratio"] == pytest.approx(0.6)
    rows = clock["rows"]["alibi"]
    for row, steps in zip(rows, BUDGETS):
        t = steps * TOKENS_PER_STEP
        if t * 0.6 < BUDGETS[0] * TOKENS_PER_STEP:
            assert math.isnan(row["diff"])
        else:
            assert row["diff"] == pytest.approx(power_law(0.6 * t) - power_law(t))
    assert math.isnan(rows[0]["diff"]) and rows[-1]["diff"] > 0
    # The equal-token M(T) is 1 (the same curve per token); in time it is 1 / 0.6.
    assert result["end_state"]["multiplier"]["alibi"][1]["multiplier"] == pytest.approx(1.0)
    assert clock["time_multiplier"]["alibi"][1]["multiplier"] == pytest.approx(1 / 0.6)
    headings = [line for line in md.splitlines() if line.startswith("## ")]
    assert headings.index("## At equal wall-clock time against rope") == \
        headings.index("## End state against rope") + 1
    assert "| alibi | H200 | 60,000 | 0.60 |" in md and "| rope | H200 | 100,000 | 1.00 |" in md
    assert "| alibi | — (0.8k tokens: outside its budgets) |" in md


def test_records_from_different_devices_are_not_read_at_equal_time():
    config = _config()
    runs = {"rope": _record("rope", 9e5, "H200"), "alibi": _record("alibi", 5.4e5, "H100")}
    result = report.summarize(config, None, runs)
    assert result["wall_clock"]["rows"] == {}
    md = report.markdown(config, result, {})
    assert "Not read at equal time: the records were trained on different devices (H100, H200)" in md
