"""The study's report (roformer/study/report.py and `study report`): the rate it chooses,
what it says it does not show, what it refuses, and how long its writes take
(scripts/study_report_time.py)."""
import json
import sys

import pytest

from helpers import REPO_ROOT as REPO
from helpers.study import config
from roformer.errors import ConfigError
from roformer.study import records as study_records
from roformer.study import session as study


def test_the_report_time_script_writes_a_report_of_fake_records_at_a_variants_shapes(tmp_path, monkeypatch, capsys):
    """scripts/study_report_time.py (how long a call's report writes take, docs/ablation.md) at
    gpu_smoke: every scheme's grid and group beyond it, a write after each."""
    import runpy

    monkeypatch.setattr(sys, "argv", ["study_report_time.py", "gpu_smoke", "--dir", str(tmp_path / "w")])
    runpy.run_path(str(REPO / "scripts" / "study_report_time.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "6 writes:" in out and out.count("write with 3 schemes") == 4
    report = json.loads((tmp_path / "w" / "study.json").read_text())
    assert report["schemes"] == ["rope", "alibi", "sinusoidal"]
    assert len(report["budgets"][-1]["rows"]["rope"]["validation_by_rate"]) == 3   # the grid's 2 rates and 1 beyond


def test_the_report_command_refuses_a_folder_that_is_not_a_study_workdir(tmp_path):
    with pytest.raises(ConfigError, match="has no study_config.json"):
        study.write_report(tmp_path)


def test_the_report_command_refuses_records_made_before_the_preregistration(tmp_path):
    recorded = config().to_dict()
    for key in ("equivalence_margin", "tuning_seeds", "scored_seeds"):
        del recorded["study"][key]
    (tmp_path / study_records.CONFIG_RECORD).write_text(json.dumps(recorded))
    with pytest.raises(ConfigError, match="predates the pre-registration"):
        study.write_report(tmp_path)


def test_the_rate_is_chosen_on_validation_and_never_one_that_diverged():
    from roformer.study.report import choose_rate

    members = [{"seed": s, "rate": r} for r in (1e-3, 2e-3, 4e-3) for s in range(2)]
    budget = {"steps": 100, "validation_loss": [5.0, 5.2, 4.0, 4.2, 3.0, float("nan")],
              "diverged_at": [None, None, None, None, None, 40]}
    record = {"members": members, "diverged_at": [None] * 6}
    assert choose_rate(record, budget) == 1          # 4e-3 would be lowest, but one of its seeds diverged
    budget["diverged_at"][5] = None                  # the trunk diverged only after this budget's branch
    budget["validation_loss"][5] = 3.1
    assert choose_rate(record, budget) == 2
    # A record from before budgets kept their own divergences: the trunk's, by the budget's end.
    del budget["diverged_at"]
    record["diverged_at"][5] = 40
    assert choose_rate(record, budget) == 1
    record["diverged_at"][5] = 150
    assert choose_rate(record, budget) == 2


def test_the_report_says_what_it_does_not_show():
    from roformer.study.report import limits

    c = config(schemes="rope,alibi,sinusoidal")    # sinusoidal has not finished
    rows = {"rope": {"rate_at_edge": True, "diverged": []},
            "alibi": {"rate_at_edge": False, "diverged": [{"seed": 0, "rate": 30.0, "step": 4}],
                      "vs_reference": {"verdict": "undecided"}}}
    result = {"schemes": ["rope", "alibi"], "budgets": [{"steps": 20, "tokens": 2560, "rows": rows}],
              "schemes_info": {"rope": {"parameters": 1234, "onsets": [{"left_censored": True}]},
                               "alibi": {"parameters": 1234, "onsets": [{"left_censored": False}]}}}
    text = " ".join(limits(c, result, {"train_rows": 20}))   # 20 steps x batch 4 = 4 passes over 20 rows
    assert "reads the training split 4.0 times" in text and "memorised" in text
    assert "edge of the grid for rope at" in text and "'undecided' (alibi)" in text and "1 member(s) diverged" in text
    assert "marked <= (rope)" in text and "Not finished, so not compared: sinusoidal." in text
    assert "1,234 parameters" in text
    rows["rope"]["rate_at_edge"], rows["alibi"]["diverged"] = False, []
    text = " ".join(limits(c, result, {"train_rows": 800}))
    assert "0.10 of the training split's rows, each at most once" in text
    assert "edge of the grid" not in text and "diverged" not in text
    # every scheme finished: one whose grid edge was chosen waits for its rates beyond the grid
    c.study.schemes = "rope,alibi"
    rows["rope"]["rate_at_edge"] = True
    for scheme, extended in (("rope", []), ("alibi", [])):
        result["schemes_info"][scheme]["edge_rates"] = extended
    assert "rates beyond the grid of rope have not trained yet" in " ".join(limits(c, result, {"train_rows": 800}))
    result["schemes_info"]["rope"]["edge_rates"] = [3.5e-4]
    text = " ".join(limits(c, result, {"train_rows": 800}))
    assert "have not trained yet" not in text and "(and the rates beyond the grid for rope)" in text
    # every rate of a scheme had a diverged member: it is compared at one that did not train stably
    rows["alibi"].update(rate=30.0, diverged=[{"seed": 0, "rate": 30.0, "step": 4}])
    text = " ".join(limits(c, result, {"train_rows": 800}))
    assert "Every rate of alibi had a diverged member" in text and "trained stably" not in text
    rows["alibi"]["diverged"] = []
    assert "Holm" not in text
    rows["alibi"]["vs_reference"] = {"verdict": "higher", "family": "not under Holm: undecided"}
    text = " ".join(limits(c, result, {"train_rows": 800}))
    assert "the verdicts of alibi hold as single comparisons but not with all of the budget's comparisons" in text
