"""roformer.ablation.onset: per-run onset of word-order use, fraction started with censoring, matched tokens."""
import pytest

from roformer.ablation import figures, findings, onset, report_md

TPS = 1000   # tokens per step


def curve(gaps, losses=None, every=100):
    losses = losses or [5.0] * len(gaps)
    return [{"step": (i + 1) * every, "tokens": (i + 1) * every * TPS, "eval_order_gap": g, "eval_loss": loss}
            for i, (g, loss) in enumerate(zip(gaps, losses))]


def test_run_onset_first_crossing_and_censoring():
    started = onset.run_onset(curve([0.0, 0.05, 0.2, 0.5]), 0.1)
    assert started == {"started": True, "onset_tokens": 300_000, "onset_step": 300, "last_tokens": 400_000,
                       "sustained": True}
    fell_back = onset.run_onset(curve([0.0, 0.2, 0.05]), 0.1)
    assert fell_back["started"] and fell_back["onset_step"] == 200 and fell_back["sustained"] is False
    never = onset.run_onset(curve([0.0, 0.01, None, 0.02]), 0.1)
    assert never == {"started": False, "onset_tokens": None, "onset_step": None, "last_tokens": 400_000,
                     "sustained": None}
    assert onset.run_onset([], 0.1)["last_tokens"] is None


def test_fraction_started_is_kaplan_meier():
    # Onsets at 1 and 3, one run censored at 2 (still running), one never started by 4.
    points = onset.fraction_started([(1, True), (2, False), (3, True), (4, False)])
    # At 1: 4 at risk, 1 starts -> S = 3/4. At 3: 2 at risk (the censored-at-2 run is gone), 1 starts -> S = 3/8.
    assert [(p["tokens"], p["at_risk"], p["started"]) for p in points] == [(1, 4, 1), (3, 2, 1)]
    assert points[0]["fraction"] == pytest.approx(0.25)
    assert points[1]["fraction"] == pytest.approx(1 - 3 / 8)
    assert onset.median_onset(points) == 3
    # Without censoring it is the plain fraction of runs started by t.
    plain = onset.fraction_started([(1, True), (2, True), (5, False), (5, False)])
    assert [p["fraction"] for p in plain] == pytest.approx([0.25, 0.5])
    assert onset.median_onset(onset.fraction_started([(5, False)])) is None


def runs():
    return [
        {"scheme": "rope", "seed": 0, "status": "done", "curve": curve([0.5, 1, 2, 3], [6, 5, 4, 3])},
        {"scheme": "rope", "seed": 1, "status": "done", "curve": curve([0.0, 1, 2, 3], [6, 5.2, 4.1, 3.1])},
        {"scheme": "learned", "seed": 0, "status": "done", "curve": curve([0, 0, 0.3, 1], [6.3, 6.3, 6.0, 4.0])},
        {"scheme": "learned", "seed": 1, "status": "done", "curve": curve([0, 0, 0, 0], [6.3, 6.3, 6.3, 6.2])},
        {"scheme": "learned", "seed": 2, "status": "running", "curve": curve([0, 0], [6.3, 6.3])},
    ]


def test_scheme_onsets_counts_censored_runs():
    by = {s["scheme"]: s for s in onset.scheme_onsets(runs(), 0.1)}
    assert by["rope"]["onsets"] == [100_000, 200_000] and by["rope"]["median_onset"] == 100_000
    learned = by["learned"]
    assert (learned["started"], learned["observed"]) == (1, 3)
    assert learned["censored"] == [200_000, 400_000]
    # Seed 2 (censored at 200k) is not at risk at 300k: 2 at risk, 1 starts.
    assert learned["fraction_started"] == [{"tokens": 300_000, "at_risk": 2, "started": 1, "fraction": 0.5}]
    assert learned["median_onset"] == 300_000 and learned["onset_range"] == [300_000, 300_000]


def test_loss_at_matched_tokens_pairs_seeds_with_the_reference():
    steps = onset.matched_steps(runs(), fractions=(0.5, 1.0))
    assert steps == [200, 400]
    rows = {r["scheme"]: r for r in onset.loss_at_matched_tokens(runs(), "rope", steps)}
    assert rows["rope"]["cells"][1]["vs_reference"] is None
    final = rows["learned"]["cells"][1]
    assert final["mean"] == pytest.approx(5.1) and final["n"] == 2   # the running seed is left out
    diffs = [4.0 - 3.0, 6.2 - 3.1]
    assert final["vs_reference"]["diff"] == pytest.approx(sum(diffs) / 2)
    assert final["vs_reference"]["lo"] < final["vs_reference"]["diff"] < final["vs_reference"]["hi"]


def test_markdown_and_plot(tmp_path):
    result = onset.summarize_onset(runs(), reference="rope", threshold=0.1)
    text = "\n".join(report_md._onset_md(result))
    assert "| learned | 1 / 3 | 0.3M | 0.3M | 0.2M, 0.4M | — | — |" in text
    assert "| rope | 2 / 2 | 0.1M | 0.1M, 0.2M | — | — | — |" in text
    assert "(+2.050 [" in text
    figures.plot_onset({"onset": result}, tmp_path / "onset.png")
    assert (tmp_path / "onset.png").stat().st_size > 0


def test_loss_spike_is_a_jump_above_the_best_so_far():
    # Falling, then back to the unigram level at 400k, then recovering only partly.
    spiked = curve([0, 0, 0, 0, 0, 0], losses=[6.5, 6.35, 6.3, 6.95, 6.8, 6.55])
    assert onset.loss_spike(spiked) == {"step": 400, "tokens": 400_000, "rise": pytest.approx(0.65),
                                        "recovered": False}
    assert onset.loss_spike(curve([0, 0, 0], losses=[6.5, 6.9, 6.45]))["recovered"] is True
    # Noise between evaluations is not a spike; neither is a high start.
    assert onset.loss_spike(curve([0, 0, 0, 0], losses=[7.0, 6.4, 6.45, 6.41])) is None
    runs_ = [{"scheme": "learned", "seed": 0, "status": "done", "curve": spiked}]
    result = onset.summarize_onset(runs_, reference="learned", threshold=0.1)
    assert result["schemes"][0]["loss_spikes"] == [{"seed": 0, **onset.loss_spike(spiked)}]
    assert "seed 0 at 0.4M (+0.65, not recovered)" in "\n".join(report_md._onset_md(result))


def trend_runs():
    """Eight evaluations 1M tokens apart (the last quarter: the last three); the reference's loss
    falls by 0.1 per evaluation, each scheme's difference to it moves per its kind, seed 1 a
    little off seed 0."""
    every, n = 1000, 8   # 1M tokens per evaluation at TPS
    ref = [6.0 - 0.1 * i for i in range(n)]
    kinds = {"closing": lambda i, k: 2.0 - 0.10 * i + 0.01 * k,        # -1.0 nats per 10M tokens
             "level": lambda i, k: 1.0 + 0.002 * ((i + k) % 2),         # flat, up to 0.002 noise
             "widening": lambda i, k: 0.5 + 0.05 * i - 0.002 * k,
             "noisy": lambda i, k: 1.0 + (0.3 if (i + k) % 2 else -0.3) * (i - 4) / 3,
             # below the reference: pulling further ahead widens, losing its lead closes
             "ahead": lambda i, k: -0.5 - 0.1 * i + 0.01 * k,
             "catching": lambda i, k: -1.5 + 0.1 * i - 0.01 * k}
    out = [{"scheme": "rope", "seed": k, "status": "done", "curve": curve([1.0] * n, ref, every)} for k in (0, 1)]
    for name, diff in kinds.items():
        out += [{"scheme": name, "seed": k, "status": "done",
                 "curve": curve([0.0] * n, [r + diff(i, k) for i, r in enumerate(ref)], every)} for k in (0, 1)]
    out.append({"scheme": "alone", "seed": 0, "status": "done", "curve": curve([0.0] * n, ref, every)})
    return out


def test_gap_trend_says_whether_the_gap_to_the_reference_is_still_closing():
    by = {t["scheme"]: t for t in onset.gap_trend(trend_runs(), "rope")}
    assert set(by) == {"closing", "level", "widening", "noisy", "alone", "ahead", "catching"}
    assert by["ahead"]["trend"] == "widening" and by["ahead"]["closes_in_tokens"] is None
    assert by["catching"]["trend"] == "closing"
    assert by["catching"]["closes_in_tokens"] == pytest.approx(-by["catching"]["gap"] / 1.0 * 10_000_000)
    closing = by["closing"]
    assert (closing["from_step"], closing["to_step"], closing["from_tokens"]) == (6000, 8000, 6_000_000)
    assert closing["slope"]["diff"] == pytest.approx(-1.0) and closing["trend"] == "closing"
    # The mean gap at the last evaluation, 2.0 - 0.7 + 0.005, closed at 1 nat per 10M tokens.
    assert closing["gap"] == pytest.approx(1.305)
    assert closing["closes_in_tokens"] == pytest.approx(13_050_000)
    assert by["level"]["trend"] == "parallel" and by["level"]["closes_in_tokens"] is None
    assert by["widening"]["trend"] == "widening"
    assert by["noisy"]["trend"] == "unclear"
    assert by["alone"]["trend"] is None and by["alone"]["seeds"] == [0]   # one seed: no interval
    result = onset.summarize_onset(trend_runs(), reference="rope", threshold=0.1)
    text = "\n".join(report_md._onset_md(result))
    assert "| closing | 2 | +1.305 | -1.000 [-1.000, -1.000] | closing | 13.0M more tokens |" in text
    finding = findings._gap_trend_findings(result["gap_trend"], "rope")[0]
    assert "closing: closing (-1.000 [" in finding and "parallel: level" in finding and "unclear: noisy" in finding
