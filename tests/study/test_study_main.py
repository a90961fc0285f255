"""The study's command (`python -m roformer.study`, roformer/study/__main__.py): its exit
status when its time limit stops it."""
import json
import os
import subprocess
import sys

from helpers import REPO_ROOT as REPO
from roformer.study import session as study


def test_a_study_stopped_by_its_time_limit_exits_with_its_own_status(tmp_path):
    """`python -m roformer.study` on a gpu_smoke study whose time limit leaves schemes untrained
    exits 3 (PARTIAL_EXIT) with a line naming them; the same command with room for the rest
    exits 0. The first scheme sets the forecast, so the limit stops the study after it. The
    finished report leads with the pre-registration, then M(T), and scores gpu_smoke's scored
    seed only (its tuning seed chose the rate)."""
    command = [sys.executable, "-m", "roformer.study", "--config=configs/study.py:gpu_smoke",
               f"--workdir={tmp_path}", "--config.study.schemes=rope,none",
               "--config.study.learning_rates=2e-3", "--config.study.compile_ahead=0",
               "--config.study.extend_edges=False"]
    env = {**os.environ, "ROFORMER_CACHE": str(tmp_path / "cache")}
    first = subprocess.run(command + ["--config.study.time_limit_s=1"], env=env, capture_output=True,
                           text=True, cwd=REPO, timeout=600)
    assert first.returncode == study.PARTIAL_EXIT, first.stdout[-2000:] + first.stderr[-2000:]
    assert "partial: the schemes none not trained yet" in first.stdout
    again = subprocess.run(command, env=env, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert "partial:" not in again.stdout and " members, from " in again.stdout + again.stderr
    md = (tmp_path / "study.md").read_text()
    headings = [line for line in md.splitlines() if line.startswith("## ")]
    assert headings[:3] == ["## Pre-registered", "## Compute multiplier M(T) against rope", "## End state against rope"]
    assert not any(ch.isdigit() for ch in md[:md.index("## Pre-registered")])
    assert "| none | " in md and "- none vs rope: " in md
    result = json.loads((tmp_path / "study.json").read_text())
    assert result["end_state"]["scored_seeds"] == [1] and result["end_state"]["tuning_seeds"] == [0]
    assert all(len(b["rows"][s]["test_loss_per_seed"]) == 1 for b in result["budgets"] for s in ("rope", "none"))
    assert result["end_state"]["uses_order"]["none"] is False
