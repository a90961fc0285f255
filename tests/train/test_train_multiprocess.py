"""Two local processes x 4 CPU devices build the data cache, train through jax.distributed,
checkpoint and restore."""
import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from roformer.train import read_metrics

from helpers import cache_entries, patient


REPO = Path(__file__).resolve().parents[2]

# Each process: train 4 steps (checkpoint at 2 and 4), then a second call resumes at 4.
DRIVER = textwrap.dedent("""
    import json, sys
    from roformer.configs import tiny
    from roformer.train import train_and_evaluate
    port, process_id, workdir, cache = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    config = tiny.get_config()
    config.model.update(hidden_size=32, intermediate_size=64, num_heads=2)
    config.data.update(cache_dir=cache, vocab_size=500)
    config.train.update(steps=4, decay_steps=6, batch_size=16, seq_len=32, warmup_steps=1, log_every=1,
                        eval_every=4, eval_batches=1, checkpoint_every=2, progress_bar=False)
    config.mesh.update(data=-1, fsdp=2)
    config.distributed.update(coordinator_address=f"localhost:{port}", num_processes=2,
                              process_id=process_id)
    first = train_and_evaluate(config, workdir)
    config.train.steps = 6
    second = train_and_evaluate(config, workdir)
    import jax
    print("RESULT " + json.dumps({"devices": jax.device_count(), "local": jax.local_device_count(),
                                  "first": first["final_step"], "start": second["start_step"],
                                  "final": second["final_step"], "loss": second["final_loss"]}))
""")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_two_processes_train_checkpoint_restore(tmp_path):
    cache = tmp_path / "cache"     # the processes build it together: process 0 the shards (one part)
    # the resume call re-jits the same programs (same decay_steps): a persistent cache
    # skips recompiling them
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
           "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax_cache"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    port, workdir = _free_port(), tmp_path / "run"
    procs = [subprocess.Popen([sys.executable, "-c", DRIVER, str(port), str(i), str(workdir), str(cache)],
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    # Alone on an idle machine the two take about 80 s; under load, far longer (patient).
    outputs, deadline = [], time.monotonic() + patient(480)
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail("multi-process run timed out")
    for proc, out in zip(procs, outputs):
        assert proc.returncode == 0, out[-3000:]
    results = [json.loads(line.split("RESULT ", 1)[1]) for out in outputs
               for line in out.splitlines() if line.startswith("RESULT ")]
    assert len(results) == 2
    for r in results:
        assert (r["devices"], r["local"]) == (8, 4)
        assert (r["first"], r["start"], r["final"]) == (4, 4, 6)
    assert results[0]["loss"] == results[1]["loss"]          # one global computation
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["2", "4", "6"]
    (entry,) = cache_entries(cache / "shards")
    assert json.loads((entry / "build.json").read_text())["processes"] == 2
    rows = read_metrics(workdir)                               # written by process 0 only
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5, 6]
