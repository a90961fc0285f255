"""The train step under XLA flag sets: which compiler settings make it faster, and whether
they change its numbers.

XLA reads `XLA_FLAGS` once, when a process starts its backend, so each flag set runs the
`step` benchmark (`--step-args`, its options) in a process of its own, one after another:
first with no extra flags (the reference), then each `--flag-set`, then the reference again.
The two reference runs bracket the others: how far they differ is how far the machine drifted
meanwhile (a note gives it), which is the resolution of `x_ref`, each row's step time over
the first reference run's for the same step. On a CPU, whose rate drifts with other load,
the `mfu` column is the steadier comparison: it divides by a matmul timed in the same rounds
as the step. `loss_step1` is the loss of the first step, from the same initial parameters
and batch in every process: a flag set that changes the step's arithmetic (fast math,
another GEMM library, other fusions) changes it, and `dloss_step1` says by how much. A flag
this XLA does not know stops its process; its row says so and the other sets still run.
With `--combine-below F`, the sets whose step took less than F times the reference's are
timed once more all together, before the second reference run.

Without `--flag-set`, the platform's candidates run (`CANDIDATES`): on a GPU, settings that
fold the step's memory-bound passes into other kernels (GEMM epilogues, Triton GEMM fusions
for every GEMM, cuDNN layer norms, Triton normalisation fusions) or change how kernels are
launched; on a CPU, XLA:CPU's scheduling, vector width and math settings.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple
from types import SimpleNamespace

from roformer import cli

REFERENCE = ""
CANDIDATES = {
    "gpu": (
        "--xla_gpu_enable_cublaslt=true",
        "--xla_gpu_enable_cudnn_layer_norm=true",
        "--xla_gpu_experimental_enable_triton_softmax_priority_fusion=true",
        "--xla_gpu_experimental_enable_fusion_block_level_rewriter=true",
        "--xla_gpu_triton_gemm_any=true",
        "--xla_gpu_cudnn_gemm_fusion_level=2",
        "--xla_gpu_enable_command_buffer=",
    ),
    "cpu": (
        "--xla_cpu_enable_concurrency_optimized_scheduler=true",
        "--xla_cpu_prefer_vector_width=512",
        "--xla_cpu_enable_fast_math=true",
    ),
}
ROW_KEYS = ("size", "seq", "scheme", "dropout_rng", "hidden_dropout")   # what tells a step's rows apart
TABLE_COLUMNS = ("xla_flags", "size", "seq", "scheme", "batch", "ms_step", "tokens_s", "mfu", "x_ref",
                 "loss_step1", "dloss_step1", "error")
# The `step` benchmark's options when --step-args is not given: one small group, quick anywhere.
DEFAULT_STEP_ARGS = "--sizes tiny --seq-lens 128 --batch 16 --schemes rope --rounds 5 --iters 10"


def define_flags(command: cli.CommandFlags) -> None:
    command.define("--flag-set", repeat=True, default=None, metavar="FLAGS",
                   help="XLA flags (space-separated) to time against none; repeat for more sets, "
                        "written as --flag-set=\"--xla_...=... --xla_...\" (default: this platform's "
                        "candidates)")
    command.define("--step-args", default=DEFAULT_STEP_ARGS,
                   help="options of the step benchmark, in one string (python -m roformer.bench step "
                        f"--help); default: {DEFAULT_STEP_ARGS!r}")
    command.define("--timeout-s", type=float, default=600.0,
                   help="time limit of each flag set's process")
    command.define("--combine-below", type=float, default=0.0,
                   help="then time the sets whose every row took less than this fraction of the "
                        "reference's step time, all together, in one more process (e.g. 0.99; "
                        "0: no combination)")


class StepRun(NamedTuple):
    """One flag set's process: the step benchmark's rows and platform, or why there are none."""
    flags: str
    rows: list[dict]
    platform: str | None
    error: str | None


def run_step(flags: str, step_args: list[str], timeout_s: float) -> StepRun:
    """The step benchmark in a process of its own with `flags` added to XLA_FLAGS."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(filter(None, [env.get("XLA_FLAGS", ""), flags]))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "step.json"
        try:
            done = subprocess.run([sys.executable, "-m", "roformer.bench", "step", *step_args, "--json", str(out)],
                                  env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return StepRun(flags, [], None, f"no result within {timeout_s:g} s")
        if done.returncode != 0 or not out.exists():
            lines = [line for line in done.stderr.splitlines() if line.strip()]
            return StepRun(flags, [], None, f"exit status {done.returncode}: {lines[-1][:200] if lines else 'no message'}")
        result = json.loads(out.read_text())
        return StepRun(flags, result["rows"], result["machine"]["platform"], None)


def reference_row(row: dict, reference: dict) -> dict | None:
    """The first reference run's row for the same step as `row` (None if it has none)."""
    return reference.get(tuple(row[k] for k in ROW_KEYS))


def step_ratios(step_run: StepRun, reference: dict) -> list[float]:
    """Each of a set's rows' step time over the first reference run's (rows without one left out)."""
    pairs = [(row, reference_row(row, reference)) for row in step_run.rows]
    return [row["ms_step"] / base["ms_step"] for row, base in pairs if base is not None]


def say(step_run: StepRun) -> StepRun:
    """One line on stderr per finished set, so that a command stopped from outside (a time
    limit) still leaves in its log what each set measured."""
    figures = "; ".join(f"{row['ms_step']:.3f} ms per step, first loss {row['loss_step1']:.6f}"
                        for row in step_run.rows)
    print(f"flags {step_run.flags or '(none)'}: {step_run.error or figures}", file=sys.stderr, flush=True)
    return step_run


def run(args: SimpleNamespace) -> dict:
    # This process starts no jax backend while the steps run: on a GPU it would hold memory
    # their processes need. The platform, which picks the default candidates, is the first
    # reference process's.
    step_args = shlex.split(args.step_args)
    first = say(run_step(REFERENCE, step_args, args.timeout_s))
    sets = args.flag_set if args.flag_set is not None else list(CANDIDATES.get(first.platform or "", ()))
    reference = {tuple(row[k] for k in ROW_KEYS): row for row in first.rows}
    runs = [first]
    for index, flags in enumerate(sets):
        print(f"flag set {index + 1} of {len(sets)}: {flags}", file=sys.stderr, flush=True)
        runs.append(say(run_step(flags, step_args, args.timeout_s)))
    winners = [r.flags for r in runs[1:] if r.error is None and r.rows
               and all(ratio < args.combine_below for ratio in step_ratios(r, reference))]
    if len(winners) > 1:
        print(f"the sets faster than {args.combine_below:g}x the reference, together", file=sys.stderr, flush=True)
        runs.append(say(run_step(" ".join(winners), step_args, args.timeout_s)))
    print("the reference again", file=sys.stderr, flush=True)
    runs.append(say(run_step(REFERENCE, step_args, args.timeout_s)))
    rows, notes = [], []
    for step_run in runs:
        label = step_run.flags or "(none)"
        if step_run.error is not None:
            rows.append({"xla_flags": label, "error": step_run.error})
        for step_row in step_run.rows:
            base = reference_row(step_row, reference)
            row = {"xla_flags": label, **step_row}
            if base is not None:
                row["x_ref"] = step_row["ms_step"] / base["ms_step"]
                row["dloss_step1"] = step_row["loss_step1"] - base["loss_step1"]
            rows.append(row)
    last = runs[-1]
    if first.error is None and last.error is None:
        drift = step_ratios(last, reference)
        notes.append("the reference ran first and last; its last run took "
                     + ", ".join(f"{d:.3f}x" for d in drift) + " the first's step time (the machine's "
                     "drift over the runs: x_ref differences within it are not resolved)")
    else:
        notes.append("a reference run failed, so x_ref is missing where it has no row to compare with"
                     + ("; without the first one's platform, no candidate set ran"
                        if first.error is not None and args.flag_set is None else ""))
    notes.append(f"every flag set ran `python -m roformer.bench step {args.step_args}` in a process of its own, "
                 "one after another, with the flags added to XLA_FLAGS"
                 + (f" (already set: {os.environ['XLA_FLAGS']!r})" if os.environ.get("XLA_FLAGS") else ""))
    return {"rows": rows, "columns": TABLE_COLUMNS, "notes": notes,
            "settings": {k: v for k, v in vars(args).items() if k != "json"}}
