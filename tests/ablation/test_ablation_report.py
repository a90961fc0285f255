"""The report's statistics, words and tables (roformer.ablation.summary, findings, report_md
and formats), on hand-made run rows."""

import pytest

from roformer.ablation import formats, report_md, summary


pytestmark = pytest.mark.fast   # the fast lane (docs/testing.md)

def _run(scheme, seed, loss, gaps, status="done", tokens_per_step=1_000_000):
    """A per-(scheme, seed) report row as roformer.ablate builds it, evaluated at steps 1, 2, 3."""
    curve = [{"step": step, "tokens": step * tokens_per_step, "eval_loss": loss + 0.5 * (3 - step),
              "eval_mlm_accuracy": 0.2, "eval_order_gap": gap} for step, gap in zip((1, 2, 3), gaps)]
    return {"scheme": scheme, "seed": seed, "status": status, "eval_loss": loss, "eval_mlm_accuracy": 0.2,
            "eval_order_gap": gaps[-1], "train_loss": loss, "tokens_per_sec": 1000.0, "curve": curve,
            "params": 1000, "extrapolation": None, "glue": None}


def test_findings_say_which_differences_exceed_the_seed_spread_and_who_ignores_word_order():
    runs = []
    for k in range(3):
        runs += [_run("rope", k, [7.0, 7.2, 7.1][k], [0.05, 0.3, 0.6]),
                 _run("learned", k, [7.5, 7.8, 7.6][k], [0.02, 0.15, 0.4]),        # worse, beyond the spread
                 _run("sinusoidal", k, [7.1, 7.1, 7.2][k], [0.01, 0.05, 0.2 + 0.1 * k]),   # within it
                 _run("none", k, [6.5, 6.6, 6.6][k], [0.0, 0.01, [0.0, 0.01, 0.02][k]])]  # better; ignores order
    result = summary.summarize({"seeds": 3}, runs, [], reference="rope", baseline="learned", order_threshold=0.1)
    findings = result["findings"]

    def finding(start):
        found = [f for f in findings if f.startswith(start)]
        assert len(found) == 1, (start, findings)
        return found[0]

    worse = finding("Held-out MLM loss higher than rope by more than the seed spread")
    assert "learned (+0.533 [" in worse and "sinusoidal" not in worse and "none" not in worse
    better = finding("Held-out MLM loss lower than rope beyond the seed spread")
    assert "none (-0.533 [" in better and "learned" not in better
    same = finding("Not distinguishable from rope (interval includes 0; paired over 3 seeds unless noted)")
    assert "sinusoidal (+0.033 [" in same and same.endswith("~).")
    assert "learned" not in same and "none" not in same
    uses = finding("Word order (shuffling each document's tokens raises a run's held-out loss by >= 0.1 nats")
    assert "rope: median onset 2.00M tokens (3 of 3 seeds started" in uses
    assert "learned: median onset 2.00M tokens (3 of 3" in uses
    assert "sinusoidal: median onset 3.00M tokens (3 of 3" in uses and "none" not in uses
    ignores = finding("Ignore word order through the whole budget (gap < 0.1 nats at every evaluation")
    assert "none (final gap 0.010 ± 0.010 nats)" in ignores
    assert not any(name in ignores for name in ("rope", "learned", "sinusoidal"))
    assert not any(f.startswith("Only one seed") for f in findings)
    rows = {r["scheme"]: r for r in result["schemes"]}
    assert rows["none"]["order_onset_tokens"] is None and rows["learned"]["order_onset_tokens"] == 2_000_000
    assert result["convergence"]["seeds"] == [0, 1, 2]
    assert "| 2.00M (3/3) |" in report_md.to_markdown(result) and "| none (0/3) |" in report_md.to_markdown(result)

    # A higher threshold: learned's gap (0.4 at the end) no longer counts as using word order.
    strict = summary.summarize({"seeds": 3}, runs, [], reference="rope", baseline="learned",
                              order_threshold=0.5)["findings"]
    ignores = next(f for f in strict if f.startswith("Ignore word order"))
    assert "gap < 0.5 nats" in ignores and "learned (final gap 0.400" in ignores and "rope" not in ignores

    # One seed: the comparison has no interval yet, and says so.
    one = summary.summarize({"seeds": 1}, [r for r in runs if r["seed"] == 0], [], reference="rope",
                           baseline="learned")
    assert "Only one seed finished for rope: differences have no interval yet." in one["findings"]
    assert "(+0.500 (one seed))" in report_md.to_markdown(one)
    convergence = next(f for f in one["findings"] if f.startswith("Convergence"))
    assert convergence.startswith("Convergence (RoFormer Fig. 3): one seed in common, no interval yet; "
                                  "learned - rope held-out loss is +0.500 at 3.00M tokens")
    assert "does not reproduce" not in convergence
    assert not any(f.startswith("Not distinguishable") for f in one["findings"])
    # An unfinished seed: a scheme with one seed in common is listed as such, not as
    # "not distinguishable" at the reference's seed count.
    partial_runs = [r for r in runs if (r["seed"] < 2 or r["scheme"] == "rope")
                    and not (r["scheme"] == "none" and r["seed"] == 1)]
    partial = summary.summarize({"seeds": 3}, partial_runs, [], reference="rope", baseline="learned")
    assert any(f.startswith("One seed in common with rope so far, no interval yet: none (")
                                    for f in partial["findings"])
    assert not any(f.startswith("Not distinguishable") and "none" in f for f in partial["findings"])
    # learned has 2 seeds in common with rope's 3: its pairing says so.
    assert any("learned (+" in f and ", 2 common seeds)" in f for f in partial["findings"])


def test_report_helpers():
    schemes = [{"scheme": "a", "tokens_per_sec": {"mean": 100.0, "std": None, "n": 1}},
               {"scheme": "b", "tokens_per_sec": {"mean": 50.0, "std": None, "n": 1}},
               {"scheme": "c", "tokens_per_sec": None}]
    summary._add_relative_step_time(schemes)
    assert [s["step_time_rel"] for s in schemes] == [1.0, 2.0, None]

    runs = [_run("a", 0, 3.0, [0.2, 0.2, 0.2]),
            {"scheme": "c", "seed": 0, "status": "failed", "failed_stage": "pretrain", "error": "RuntimeError: boom"}]
    result = summary.summarize({}, runs, [], reference="a")
    md = report_md.to_markdown(result)
    assert "| a | done |" in md and "| c | failed | n/a |" in md and "- c seed 0 pretrain: RuntimeError: boom" in md


def test_convergence_table_shows_at_most_twelve_evaluations_and_the_first_separated_one():
    points = [{"step": k, "tokens": k * 1_000_000, "diff": 0.1, "lo": 0.0, "hi": 0.2, "exceeds": k >= 40}
              for k in range(1, 81)]
    shown = report_md._convergence_points(points)
    assert shown[0]["step"] == 1 and shown[-1]["step"] == 80
    assert 40 in [p["step"] for p in shown] and len(shown) == 13   # 12 evenly spaced + the first separated
    assert report_md._convergence_points(points[:12]) == points[:12]
    md = "\n".join(report_md._convergence_md({"baseline": "learned", "reference": "rope", "seeds": [0, 1],
                                           "at_step": points}))
    assert "13 of 80 evaluations, all of them in ablation.json" in md
    assert md.splitlines()[-1].count("|") == 14 + 1   # "Δ loss" and 13 cells


def test_a_run_short_of_the_unigram_loss_has_a_banner_and_no_findings_in_its_markdown():
    runs = [_run(scheme, k, loss + k, [0.0, 0.5, 1.0]) for k in range(2) for scheme, loss in (("rope", 7.0),
                                                                                               ("learned", 9.0))]
    short = summary.summarize({"seeds": 2, "unigram_loss": 6.5}, runs, [], reference="rope", baseline="learned")
    assert summary.short_of_unigram(short) and short["findings"]   # ablation.json keeps them
    text = report_md.to_markdown(short)
    assert "No findings: a pipeline check" in text and "6.500 nats" in text and "## Findings" not in text
    learned = summary.summarize({"seeds": 2, "unigram_loss": 8.0}, runs, [], reference="rope", baseline="learned")
    assert not summary.short_of_unigram(learned)
    assert "## Findings" in report_md.to_markdown(learned) and "No findings" not in report_md.to_markdown(learned)


def test_token_counts_of_a_short_run_are_distinct():
    assert [formats.mtokens(n) for n in (None, 640, 20_480, 40_960, 3e5, 1.3e7)] == [
        "—", "640", "20k", "41k", "0.3M", "13.0M"]


def test_a_scheme_starts_using_order_by_its_runs_not_by_its_mean_gap():
    """One seed's jump lifts the mean gap over the threshold before the others start: the onset
    is the median over runs. A scheme that started in fewer than half its runs is said so,
    whether its mean gap crossed the threshold or not; "ignores word order" means no run
    crossed. The convergence share says how many seeds it is over."""
    runs = []
    for k in range(3):
        runs += [_run("rope", k, 7.0 + 0.1 * k, [0.3, 0.6, 0.9]),
                 _run("early", k, 7.5 + 0.1 * k, [[0.35, 0.0, 0.0][k], [0.4, 0.0, 0.12][k], [0.5, 0.12, 0.12][k]]),
                 _run("one", k, 7.6 + 0.1 * k, [[0.0, 0.0, 0.35][k], 0.0, [0.0, 0.0, 0.35][k]]),
                 _run("quiet", k, 7.7 + 0.1 * k, [0.0, 0.0, [0.0, 0.0, 0.25][k]]),
                 _run("none", k, 7.8 + 0.1 * k, [0.0, 0.0, 0.0])]
    result = summary.summarize({"seeds": 3}, runs, [], reference="rope", baseline="early", order_threshold=0.1)
    rows = {r["scheme"]: r for r in result["schemes"]}
    # early: the mean gap crosses at 1M tokens (one seed), the runs at 1M, 2M, 3M: median 2M.
    assert rows["early"]["order_onset_tokens"] == 2_000_000
    some = next(f for f in result["findings"] if f.startswith("Word order in fewer than half the seeds"))
    assert "one (1 of 3 seeds started, the first at 1.00M tokens" in some   # its mean crossed at 1M
    assert "quiet (1 of 3 seeds started, the first at 3.00M tokens" in some  # its mean never did
    never = next(f for f in result["findings"] if f.startswith("Ignore word order"))
    assert never.split("): ", 1)[1] == "none (final gap 0.000 ± 0.000 nats)."   # only none
    assert "| none (1/3) |" in report_md.to_markdown(result)
    # rope reaches early's final loss in every seed here; with one seed that does not, it says so.
    convergence = summary.convergence([r for r in runs if r["scheme"] in ("rope", "early")], "rope", "early")
    convergence["budget_share_values"][1] = None
    from roformer.ablation import findings
    assert " in 2 of 3 seeds after " in findings._convergence_finding(convergence)
