"""Ctrl-C (SIGINT) stops pretraining as SIGTERM does: a checkpoint at the current step, exit
status 0, no traceback; the same command resumes from it."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import MICRO_MODEL, patient

REPO = Path(__file__).resolve().parents[1]
FLAGS = {**MICRO_MODEL,
         "train.steps": 400, "train.batch_size": 8, "train.seq_len": 32, "train.warmup_steps": 2,
         "train.log_every": 1, "train.eval_every": 1000, "train.eval_batches": 1, "train.checkpoint_every": 1000,
         "train.progress_bar": False, "mesh.num_devices": 1}


def logged_step(workdir: Path) -> int:
    try:
        lines = (workdir / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    steps = [json.loads(line).get("step", 0) for line in lines if line.endswith("}")]
    return max(steps, default=0)


def test_ctrl_c_saves_a_checkpoint_and_exits_cleanly(tmp_path):
    workdir = tmp_path / "run"
    command = [sys.executable, "-m", "roformer.pretrain", "--config=configs/tiny.py", f"--workdir={workdir}",
               *(f"--config.{k}={v}" for k, v in {**FLAGS, "data.cache_dir": tmp_path / "cache"}.items())]
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.time() + patient(300)
    while logged_step(workdir) < 3:
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            pytest.fail(f"the run ended or timed out before step 3:\n{proc.communicate()[0][-3000:]}")
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    output = proc.communicate(timeout=patient(300))[0]
    assert proc.returncode == 0, output[-3000:]
    assert "Traceback" not in output and "KeyboardInterrupt" not in output
    stopped = [line for line in output.splitlines() if line.startswith("stopped at step")]
    assert stopped and "run the same command again to resume" in stopped[0]
    step = int(stopped[0].split()[3])
    assert step >= 3 and (workdir / "checkpoints" / str(step)).is_dir()
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["preempted"] is True and summary["stop_signal"] == "SIGINT"
    assert f"stopped at step {step} (SIGINT)" in stopped[0] and "(stopped: SIGINT)" in output
