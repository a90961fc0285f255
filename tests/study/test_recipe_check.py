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
    config.study.extend_edges, config.recipe_check.warmup_steps = False, "2"   # other warmups: tested above
    result = recipe_check.run(config, tmp_path)
    assert result["complete"] and list(result["settings"]) == ["warmup2_batch4", "warmup1_batch8"]
    for name, row in result["settings"].items():
        assert math.isfinite(row["validation_loss"]) and row["tokens"] == 20 * 4 * 32
        members = json.loads((tmp_path / "recipe_check" / name / "schemes" / "learned.json").read_text())["members"]
        assert sorted({m["seed"] for m in members}) == [0, 1]
    assert result["choice"]["chosen"] is not None
    assert json.loads((tmp_path / recipe_check.RESULT).read_text()) == result
    again = recipe_check.run(config, tmp_path)              # every setting's result kept: nothing trains
    assert again["settings"] == result["settings"]
    # The study in the same workdir (one scheme, for time): its report says what the check found.
    config.study.schemes = config.study.reference = "learned"
    from roformer.study.session import run_study
    run_study(config, tmp_path)
    text = (tmp_path / report.REPORT_MD).read_text()
    assert "## Warmup and batch" in text and "Checked for learned on tuning seeds 0, 1" in text and "Result: " in text


def _script(tmp_path, variant, env, work_name="work"):
    """scripts/gpu_comparison.sh with a stand-in interpreter that records each command; its study
    leaves a config and one record, its recipe check a result and RECIPE_EXIT."""
    import subprocess
    from pathlib import Path

    work = tmp_path / work_name
    stub = tmp_path / "python"
    stub.write_text(f"""#!/bin/sh
echo "$@" >> {tmp_path / "calls"}
case "$*" in
  *"roformer.study recipe"*) echo {{}} > {work / "recipe_check.json"}; exit ${{RECIPE_EXIT:-0}} ;;
  *"roformer.study --config"*) test -f {work / "recipe_check.json"} && echo "recipe check put back" >> {tmp_path / "calls"}
                      mkdir -p {work / "schemes"}; echo {{}} > {work / "study_config.json"}
                      echo {{}} > {work / "schemes" / "rope.json"}; exit 0 ;;
esac
""")
    stub.chmod(0o755)
    (tmp_path / "pack.npz").write_bytes(b"")
    (tmp_path / "calls").unlink(missing_ok=True)
    repo = Path(__file__).resolve().parents[2]
    result = subprocess.run(["bash", str(repo / "scripts/gpu_comparison.sh"), str(tmp_path / "out"), variant],
                            env={"PATH": "/usr/bin:/bin", "PYTHON": str(stub), "STUDY_DATA": str(tmp_path / "pack.npz"),
                                 "STUDY_WORKDIR": str(work), **env}, capture_output=True, text=True, cwd=repo)
    calls = (tmp_path / "calls").read_text().splitlines() if (tmp_path / "calls").is_file() else []
    return result, [" ".join(c.split(" ")[1:3]) for c in calls if c.startswith("-m ")]


def test_the_device_script_runs_the_end_state_variant_and_the_recipe_check_after_the_study(tmp_path):
    import tarfile

    result, calls = _script(tmp_path, "gpu_tiny_end", {"RECIPE_CHECK": "1"})
    assert result.returncode == 0, result.stderr
    assert calls == ["roformer.study --config=configs/study.py:gpu_tiny_end", "roformer.study recipe",
                     "roformer.study report"]                   # the report again, with the check
    with tarfile.open(tmp_path / "out" / "records.tar.gz") as archive:
        assert "recipe_check.json" in archive.getnames()
    # On a fresh machine the check's result comes back from RESUME_FROM before the study runs.
    (tmp_path / "kept.tar.gz").write_bytes((tmp_path / "out" / "records.tar.gz").read_bytes())
    _script(tmp_path, "gpu_tiny_end", {"RESUME_FROM": str(tmp_path / "kept.tar.gz")}, work_name="fresh")
    assert "recipe check put back" in (tmp_path / "calls").read_text()
    # Stopped by its time limit: partial, the same command resumes it.
    result, calls = _script(tmp_path, "gpu_tiny_end", {"RECIPE_CHECK": "1", "RECIPE_EXIT": "3"})
    assert result.returncode == 3 and "partial" in (tmp_path / "out" / "log.txt").read_text()
    # Without RECIPE_CHECK the script is the study alone.
    result, calls = _script(tmp_path, "gpu_tiny", {})
    assert result.returncode == 0 and calls == ["roformer.study --config=configs/study.py:gpu_tiny"]
