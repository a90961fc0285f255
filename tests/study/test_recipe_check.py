"""The check of the study's warmup and batch for learned positions (roformer.study.recipe_check):
its settings at equal tokens, the tuning seeds only, the pre-registered rule, the report's
paragraph; and at smoke size on the CPU, the command with the study's report reading it."""
import json
import math

import pytest

from roformer import config_files as plan
from roformer.cli import load_config
from roformer.errors import ConfigError
from roformer.study import recipe_check, report
from roformer.study.recipe_check import Setting


def _config(variant="gpu_tiny"):
    return load_config(f"{plan.CONFIG_DIR / 'study.py'}:{variant}")


def test_each_setting_trains_learned_alone_on_the_tuning_seeds_at_the_studys_tokens():
    config = _config()
    jobs = recipe_check.planned(config)
    names = [s.name for s, _ in jobs]
    assert names == ["warmup200_batch16", "warmup100_batch16", "warmup400_batch16", "warmup400_batch8",
                     "warmup100_batch32"]                       # the study's own first
    tokens = [int(b) * 16 for b in config.study.budget_steps.split(",")]
    for setting, sub in jobs:
        assert sub.study.schemes == sub.study.reference == "learned"
        # Seeds 0 and 1 (the study's tuning seeds) only: no seed the study scores trains here.
        assert sub.study.seeds == 2 and {sub.study.tuning_seeds, sub.study.scored_seeds} == {"0", "1"}
        batch = sub.pretrain.train.batch_size
        assert batch == setting.batch_size and sub.study.warmup_steps == setting.warmup_steps
        assert [int(b) * batch for b in sub.study.budget_steps.split(",")] == tokens   # equal tokens
        assert sub.study.eval_every * batch == config.study.eval_every * 16
    assert config.study.budget_steps == "500,1000,1500,2000" and config.pretrain.train.batch_size == 16   # untouched
    # The check's key: not where the data lie, not the time limit.
    setting, sub = jobs[0]
    moved = recipe_check.setting_config(config, setting)
    moved.study.time_limit_s, moved.study.data_pack = 1.0, "/elsewhere/pack.npz"
    assert recipe_check.setting_key(moved) == recipe_check.setting_key(sub)
    moved.study.warmup_steps = 300
    assert recipe_check.setting_key(moved) != recipe_check.setting_key(sub)


@pytest.mark.parametrize("keys, message", [
    ({"recipe_check.batch_sizes": "16,24"}, "batch 24 cannot take study.warmup_steps=200"),
    ({"study.tuning_seeds": "0", "study.scored_seeds": "1,2,3,4,5,6,7"}, "must be 0..k-1 with k >= 2"),
    ({"recipe_check.margin_reason": " "}, "recipe_check.margin=0.02: a number > 0 with its reason"),
    ({"recipe_check.warmup_steps": "100,x"}, "recipe_check.warmup_steps='100,x'"),
])
def test_a_check_that_cannot_run_is_one_line_before_anything_trains(keys, message):
    config = _config()
    for key, value in keys.items():
        section, name = key.split(".")
        config[section][name] = value
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        recipe_check.planned(config)


ORDER = [Setting(200, 16), Setting(100, 16), Setting(400, 16), Setting(400, 8), Setting(100, 32)]


def _results(losses):
    return {s.name: {"validation_loss": loss} for s, loss in zip(ORDER, losses)}


def test_the_studys_setting_is_kept_unless_another_is_better_by_more_than_the_margin():
    kept = recipe_check.choose(_results([5.00, 4.99, 5.01, 4.985, 5.2]), ORDER, 0.02)
    assert kept["kept"] and kept["chosen_name"] == "warmup200_batch16" and not kept["at_edge"]
    moved = recipe_check.choose(_results([5.00, 4.95, 5.01, 4.90, 5.2]), ORDER, 0.02)
    assert not moved["kept"] and moved["chosen_name"] == "warmup400_batch8"
    assert moved["gain_over_study"] == pytest.approx(0.10) and moved["at_edge"]       # the smallest batch tried
    interior = recipe_check.choose(_results([5.00, 4.97, 5.01, 5.1, 5.2]), [*ORDER[:3], Setting(50, 16)], 0.02)
    assert interior["chosen_name"] == "warmup100_batch16" and not interior["at_edge"]
    nan = recipe_check.choose(_results([math.nan, 4.9, 5.0, 5.0, 5.0]), ORDER, 0.02)
    assert nan["chosen"] is None


def test_the_report_says_which_warmup_and_batch_every_scheme_ran_with_and_whether_learneds_was_checked():
    config = _config()
    lines = "\n".join(recipe_check.recipe_lines(config, None))
    assert "Every scheme ran with warmup 200 steps and batch 16 x 128 (the reference recipe's, chosen with rope" in lines
    assert "Not checked for learned in this workdir" in lines
    check = {"scheme": "learned", "tuning_seeds": [0, 1], "margin": 0.02, "margin_reason": "why", "complete": True,
             "settings": {s.name: {"warmup_steps": s.warmup_steps, "batch_size": s.batch_size, "rate": 1.4e-3,
                                   "rate_at_edge": False, "validation_loss": v}
                          for s, v in zip(ORDER, [5.0, 4.95, 5.01, 4.90, 5.2])}}
    check["choice"] = recipe_check.choose(check["settings"], ORDER, 0.02)
    lines = "\n".join(recipe_check.recipe_lines(config, check))
    assert "Checked for learned on tuning seeds 0, 1" in lines and "| warmup400_batch8 | 400 | 8 | 0.0014 | 4.9000 |" in lines
    assert "learned does better with warmup400_batch8 (by 0.1000 nats)" in lines and "at an end of its grid" in lines


@pytest.mark.slow
def test_the_check_at_smoke_size_and_the_studys_report_reading_it(tmp_path):
    """Every setting's one-scheme study on the CPU, the result beside the study's records, a
    second call trains nothing, and the study's report carries the check's table."""
    config = _config("gpu_smoke")
    config.study.seeds, config.study.tuning_seeds, config.study.scored_seeds = 3, "0,1", "2"
    config.study.extend_edges = False
    result = recipe_check.run(config, tmp_path)
    assert result["complete"] and list(result["settings"]) == ["warmup2_batch4", "warmup4_batch4", "warmup1_batch8"]
    for name, row in result["settings"].items():
        assert math.isfinite(row["validation_loss"]) and row["tokens"] == 20 * 4 * 32
        members = json.loads((tmp_path / "recipe_check" / name / "schemes" / "learned.json").read_text())["members"]
        assert sorted({m["seed"] for m in members}) == [0, 1]
    assert result["choice"]["chosen"] is not None
    assert json.loads((tmp_path / recipe_check.RESULT).read_text()) == result
    again = recipe_check.run(config, tmp_path)              # every setting's result kept: nothing trains
    assert again["settings"] == result["settings"]
    # The study in the same workdir: its report says what the check found.
    config.study.schemes = "rope,learned"
    from roformer.study.session import run_study
    run_study(config, tmp_path)
    text = (tmp_path / report.REPORT_MD).read_text()
    assert "## Warmup and batch" in text and "Checked for learned on tuning seeds 0, 1" in text and "Result: " in text
