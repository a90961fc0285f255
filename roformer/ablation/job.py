"""The process one run of a side-by-side ablation executes in (config.parallel > 1):

    python -m roformer.ablation.job DIR/parallel/<run>.job.json

It takes its cores and the parent it must not outlive (roformer.ablation.parallel) and the
host-memory setting every command applies, before anything imports jax; then it runs the
run's stages that are not done yet into the job's own state file, which the ablation merges
into DIR/ablation_state.json when the process ends.
"""
from __future__ import annotations

import sys

from roformer.ablation import parallel
from roformer.host_memory import retain_host_memory


def main(argv: list[str]) -> int:
    parallel.enter_slot()
    retain_host_memory()   # before jax runs anything, as every command does; see host_memory.py
    if len(argv) != 2:
        print("usage: python -m roformer.ablation.job JOB.json", file=sys.stderr)
        return 2
    # Imported only now: nothing the stages import (jax among them, once a stage runs) may
    # start before the lines above.
    from roformer.ablation.stages import run_job_file

    return run_job_file(argv[1])


if __name__ == "__main__":
    sys.exit(main(sys.argv))
