"""The ablation session's progress lines (roformer.ablation.progress), read from the runs'
metrics.jsonl; tests/ablation/test_ablate_parallel.py checks them in a real side-by-side session."""
import json
import logging
import time

import pytest

from roformer.ablation import plan, progress, validation
from roformer.ablation.progress import Progress, TrainingRun

pytestmark = pytest.mark.fast   # the fast lane (docs/testing.md)


def write_rows(workdir, steps, *, torn=False):
    workdir.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in steps)
    (workdir / "metrics.jsonl").write_text(text + ('{"step": 99' if torn else ""))


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_last_step_reads_the_last_complete_row_from_the_files_end(tmp_path):
    assert progress.last_step(tmp_path / "none") == 0            # not started: no file
    write_rows(tmp_path / "a", [10, 20, 30], torn=True)          # killed mid-write
    assert progress.last_step(tmp_path / "a") == 30
    # a long run: far more than the tail it reads, and an evaluation row last
    rows = [json.dumps({"step": s, "loss": 1.0, "pad": "x" * 200}) for s in range(10, 40_010, 10)]
    rows.append(json.dumps({"step": 40_000, "eval_loss": 2.0}))
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    assert (tmp_path / "b" / "metrics.jsonl").stat().st_size > 10 * progress.TAIL_BYTES
    assert progress.last_step(tmp_path / "b") == 40_000


def test_a_line_names_the_runs_that_trained_the_steps_left_and_the_time_left(tmp_path):
    runs = [TrainingRun("learned/seed0", tmp_path / "l0", 1000), TrainingRun("rope/seed0", tmp_path / "r0", 1000),
            TrainingRun("learned/seed1", tmp_path / "l1", 1000)]
    write_rows(tmp_path / "l0", [100])   # resumed: its steps before this session count as done
    clock = Clock()
    watch = Progress(runs, clock=clock)
    assert watch.first_line() == "progress: at the start, training done in 0 of 3 runs; 100 of 3,000 steps (3.3 %)"

    write_rows(tmp_path / "l0", [100, 200, 300])
    write_rows(tmp_path / "r0", [100, 200])
    clock.now += 60
    line = watch.line()
    # 300 + 200 of 3,000 steps; 400 steps in 60 s; 2,500 left at 6.67 steps/s: 6 min 15 s
    assert line == ("progress: learned/seed0 at step 300 of 1,000, rope/seed0 at step 200 of 1,000; "
                    "training done in 0 of 3 runs; 500 of 3,000 steps (16.7 %); 6.7 steps/s over the "
                    "last 1 min: about 6 min of training left (evaluations and GLUE not counted)")

    write_rows(tmp_path / "l0", [1000])
    clock.now += 7200
    line = watch.line()
    assert line.startswith("progress: learned/seed0 finished; training done in 1 of 3 runs; "
                           "1,200 of 3,000 steps (40.0 %); ")
    assert "over the last 2 h 1 min: about " in line    # the rate over both lines' counts

    # The rate reaches back three lines: a stall shows once every count in it is the same.
    for _ in range(3):
        clock.now += 7200
        line = watch.line()
    assert line == ("progress: no run trained since the last line; training done in 1 of 3 runs; "
                    "1,200 of 3,000 steps (40.0 %); no steps over the last 6 h 0 min")

    for name in ("r0", "l1"):
        write_rows(tmp_path / name, [1000])
    clock.now += 60
    assert watch.line() == ("progress: rope/seed0 finished, learned/seed1 finished; training done in 3 of 3 "
                            "runs; 3,000 of 3,000 steps (100.0 %)")


def test_training_runs_are_the_schemes_pretraining_then_the_extension(tmp_path):
    config = plan.load_config_file("ablation", "smoke")
    config.schemes, config.seeds = ("learned", "rope"), 2
    the_plan = plan.build_plan(config, tmp_path)
    runs = progress.training_runs(the_plan)
    steps = the_plan.steps
    assert runs[:4] == [TrainingRun(f"{s}/seed{k}", tmp_path / "pretrain" / s / f"seed{k}", steps)
                        for k in (0, 1) for s in ("learned", "rope")]
    methods = plan.split_list(config.extension.methods)
    assert runs[4:] == [TrainingRun(f"extension/{m}/seed{k}", tmp_path / "extension" / m / f"seed{k}",
                                    config.extension.steps)
                        for k in range(the_plan.extension_seeds) for m in methods]
    config.extension.enabled = False
    assert len(progress.training_runs(plan.build_plan(config, tmp_path))) == 4


def test_reporting_logs_lines_while_the_block_runs_and_stops_with_it(tmp_path, caplog):
    config = plan.load_config_file("ablation", "smoke")
    config.schemes, config.seeds, config.extension.enabled = ("rope",), 1, False
    config.progress_every_s = 0.05
    caplog.set_level(logging.INFO, logger="roformer.ablate")
    with progress.reporting(plan.build_plan(config, tmp_path)):
        write_rows(tmp_path / "pretrain" / "rope" / "seed0", [10])
        time.sleep(0.5)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("progress: ")]
    assert lines[0].startswith("progress: at the start, training done in 0 of 1 runs; 0 of ")
    assert any(line.startswith("progress: rope/seed0 at step 10 of ") for line in lines)
    count = len(lines)
    time.sleep(0.2)
    assert len([r for r in caplog.records if r.getMessage().startswith("progress: ")]) == count

    caplog.clear()
    config.progress_every_s = 0
    with progress.reporting(plan.build_plan(config, tmp_path)):
        time.sleep(0.2)
    assert not caplog.records


def test_validate_refuses_a_negative_progress_interval():
    config = plan.load_config_file("ablation", "smoke")
    config.progress_every_s = -1.0
    with pytest.raises(ValueError, match="config.progress_every_s="):
        validation.validate(plan.build_plan(config, "/ablation"))
