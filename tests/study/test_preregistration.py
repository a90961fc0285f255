"""The end-state comparison's pre-registration (roformer.study.preregistration): validation and
the report header it renders."""
import ml_collections
import pytest

from roformer.errors import ConfigError
from roformer.study import end_state
from roformer.study.preregistration import Preregistration, header_lines

GOOD = dict(equivalence_margin=0.05, equivalence_reason="about 5% in perplexity", slope_margin=0.01,
            slope_reason="a fifth of the margin per doubling", tuning_seeds=(100, 101), scored_seeds=tuple(range(8)),
            planning_seed_sds=(0.03, 0.05), planning_reason="Shaw-rope on the 2026-11-27 page")


def test_a_complete_registration_is_accepted():
    prereg = Preregistration(**GOOD)
    assert prereg.power_target == 0.8 and prereg.scored_seeds == tuple(range(8))


def test_seeds_that_both_tune_and_are_scored_are_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"seeds \[0, 1\] both tune and are scored") as error:
        Preregistration(**{**GOOD, "tuning_seeds": (0, 1, 100)})
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("change, message", [
    ({"equivalence_margin": 0.0}, "equivalence_margin=0.0 must be a number > 0"),
    ({"slope_margin": float("nan")}, "slope_margin=nan must be"),
    ({"equivalence_reason": " "}, "equivalence_reason is empty"),
    ({"slope_reason": ""}, "slope_reason is empty"),
    ({"tuning_seeds": ()}, "tuning_seeds is empty"),
    ({"scored_seeds": (1, 1, 2)}, r"scored_seeds \[1, 1, 2\] lists a seed twice"),
    ({"power_target": 1.0}, r"power_target=1.0 must be in \(0, 1\)"),
    ({"planning_seed_sds": (0.03, -1.0)}, "planning_seed_sds"),
    ({"planning_reason": ""}, "planning_reason is empty")])
def test_each_invalid_field_is_named(change, message):
    with pytest.raises(ConfigError, match=message):
        Preregistration(**{**GOOD, **change})


def test_every_problem_is_named_at_once():
    with pytest.raises(ConfigError) as error:
        Preregistration(**{**GOOD, "equivalence_margin": -1.0, "tuning_seeds": (0,)})
    assert "equivalence_margin" in str(error.value) and "seeds [0] both tune" in str(error.value)


def test_from_config_reads_text_and_sequences():
    section = ml_collections.ConfigDict({**GOOD, "tuning_seeds": "100,101", "scored_seeds": "0, 1, 2",
                                         "planning_seed_sds": "0.03,0.05"})
    prereg = Preregistration.from_config(section)
    assert prereg.tuning_seeds == (100, 101) and prereg.scored_seeds == (0, 1, 2)
    assert prereg.planning_seed_sds == (0.03, 0.05)
    assert Preregistration.from_config(dict(GOOD)) == Preregistration(**GOOD)
    with pytest.raises(ConfigError, match="study.scored_seeds='0,x'"):
        Preregistration.from_config({**GOOD, "scored_seeds": "0,x"})
    with pytest.raises(ConfigError, match="study.slope_margin, study.slope_reason not set"):
        Preregistration.from_config({k: v for k, v in GOOD.items() if not k.startswith("slope")})


def test_header_states_the_margins_reasons_seeds_and_power_table():
    lines = header_lines(Preregistration(**GOOD))
    text = "\n".join(lines)
    assert lines[0] == "## Pre-registered"
    assert "+-0.05 nats (about 5% in perplexity)" in text and "90% interval" in text
    assert "+-0.01 nats per doubling (a fifth of the margin per doubling)" in text
    assert "tuning seeds 100, 101; scored on seeds 0, 1, 2, 3, 4, 5, 6, 7 (8)" in text
    assert "Shaw-rope on the 2026-11-27 page" in text
    rows = [line for line in lines if line.startswith("| 0.0")]
    table = end_state.power_table([0.03, 0.05], 0.05)
    assert [row.split(" | ")[1:3] for row in rows] == [[str(t["equivalence"]), str(t["difference"])] for t in table]
    power8 = end_state.tost_power(8, 0.05, 0.05)
    assert rows[1].endswith(f"{power8:.2f} / {end_state.difference_power(8, 0.05, 0.05):.2f} |")


def test_header_without_planning_sds_has_no_power_table_and_says_when_seeds_run_out():
    assert not any(line.startswith("|") for line in header_lines(Preregistration(
        **{**GOOD, "planning_seed_sds": (), "planning_reason": ""})))
    tight = header_lines(Preregistration(**{**GOOD, "equivalence_margin": 0.001}), max_seeds=20)
    assert any(line.startswith("| 0.03 | > 20 | > 20 |") for line in tight)
