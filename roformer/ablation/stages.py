"""The stages of one planned run, run in order and recorded.

A scheme's run has the stages config.stages names (pretrain -> extrapolation -> glue by
default), a context-extension run extension -> extension_eval; the plan
(roformer.ablation.plan) gives each its fingerprint, `STAGE_RUNNERS` its runner by name. A
stage whose record is done with the same fingerprint is skipped, a failing one is recorded
(traceback in DIR/errors/<run>.<stage>.txt) and the run's other stages still go ahead,
except after a failed first stage (training), whose model the rest need.
"""
from __future__ import annotations

import json
import logging
import time
import traceback
from pathlib import Path
from typing import Callable

import ml_collections

from roformer.ablation.plan import Plan, PlannedRun, build_plan
from roformer.ablation.state import AblationState, is_main_process
from roformer.files import write_text_atomic

log = logging.getLogger("roformer.ablate")

PREEMPTED_EXIT = 75   # a run's process saved a checkpoint on SIGTERM (EX_TEMPFAIL)


class Preempted(Exception):
    """Training saved a checkpoint on SIGTERM: stop the ablation, resume it next run."""


# --------------------------------------------------------------------------- stage runners
# Each imports its library when called: they pull in jax, flax and the data pipeline.


def _train(cfg: ml_collections.ConfigDict, workdir: Path) -> dict:
    from roformer.train import train_and_evaluate   # jax: when a stage runs

    return trained(train_and_evaluate(cfg, workdir), cfg)


def trained(summary: dict, cfg: ml_collections.ConfigDict) -> dict:
    """A training stage's result from its run's summary: Preempted when SIGTERM stopped it,
    RuntimeError when it ended short of cfg.train.steps."""
    if summary["preempted"]:
        raise Preempted(f"{summary['workdir']} preempted at step {summary['final_step']}")
    if summary["final_step"] < cfg.train.steps:
        raise RuntimeError(f"training stopped at step {summary['final_step']} of {cfg.train.steps}")
    return {"steps": summary["final_step"]}


def _run_glue(cfg: ml_collections.ConfigDict, workdir: Path) -> dict:
    from roformer.glue import run_glue   # jax: when a stage runs

    run_glue(cfg, str(workdir))
    return {}


def _run_extrapolation(plan: Plan, pretrain_cfg: ml_collections.ConfigDict, pretrain_workdir: Path) -> dict:
    # jax and the data pipeline: when a stage runs.
    from roformer.ablation import extrapolation
    from roformer.data import DataConfig

    ext = plan.config.extrapolation
    return extrapolation.evaluate_workdir(
        pretrain_workdir, DataConfig.from_mapping(pretrain_cfg.data), seq_len=pretrain_cfg.train.seq_len,
        factors=plan.factors, scalings=plan.scalings, num_docs=ext.num_docs, batch_size=ext.batch_size,
        seed=pretrain_cfg.train.seed)


def _run_extension_eval(plan: Plan, pretrain_cfg: ml_collections.ConfigDict, extension_workdir: Path) -> dict:
    """Held-out loss at factor x the length after every saved extension step, on the same
    windows as the extrapolation table (so step 0 is that table's column)."""
    # jax and the data pipeline: when a stage runs.
    from roformer.ablation import extrapolation
    from roformer.data import DataConfig

    ext = plan.config.extrapolation
    return extrapolation.evaluate_checkpoints(
        extension_workdir, DataConfig.from_mapping(pretrain_cfg.data), seq_len=pretrain_cfg.train.seq_len,
        factors=plan.factors, factor=int(plan.config.extension.factor), num_docs=ext.num_docs,
        batch_size=ext.batch_size, seed=pretrain_cfg.train.seed)


# Stage runners by the plan's stage names (roformer.ablation.plan.STAGES), looked up at call
# time, so tests can swap in fast fakes.
STAGE_RUNNERS: dict[str, Callable] = {
    "pretrain": _train, "extrapolation": _run_extrapolation, "glue": _run_glue,
    "extension": _train, "extension_eval": _run_extension_eval,
}


def stage_call(plan: Plan, run: PlannedRun, stage: str) -> dict:
    """Run one stage of `run` by its runner."""
    runner = STAGE_RUNNERS[stage]
    if stage in ("pretrain", "extension"):    # the run's training
        return runner(run.train_config, run.workdir)
    if stage == "glue":
        return runner(run.glue_config, run.glue_workdir)
    return runner(plan, run.pretrain_config, run.workdir)   # an evaluation of what trained


# --------------------------------------------------------------------------- a run's stages


def run_stages(state: AblationState, plan: Plan, run: PlannedRun) -> None:
    """Run the stages of one run that are not done yet; failures are recorded, not raised.
    A failed first stage (training) skips the rest, which need its model."""
    for index, stage in enumerate(run.stages):
        if state.is_done(run.name, stage.name, stage.fingerprint):
            log.info("%s: %s already done, skipping", run.name, stage.name)
            continue
        log.info("%s: %s starting", run.name, stage.name)
        start = time.time()
        try:
            result = stage_call(plan, run, stage.name)
        except Preempted:
            raise
        except Exception as error:  # noqa: BLE001 - recorded; the other stages and runs still go ahead
            record_failure(state, plan.workdir, run.name, stage.name, stage.fingerprint, error)
            if index == 0:
                return
            continue
        record_done(state, plan.workdir, run.name, stage.name, stage.fingerprint, time.time() - start, result)


def error_name(run: str) -> str:
    """A run's name in file names (errors/, parallel/, logs/): <scheme>.seed<k>."""
    return run.replace("/", ".")


def record_done(state: AblationState, workdir: Path, run: str, stage: str, fp: str, wall_s: float,
                result: dict) -> None:
    state.set(run, stage, {"status": "done", "fingerprint": fp, "wall_s": round(wall_s, 1), "result": result})
    if is_main_process():
        (workdir / "errors" / f"{error_name(run)}.{stage}.txt").unlink(missing_ok=True)  # an earlier failure


def record_failure(state: AblationState, workdir: Path, run: str, stage: str, fp: str,
                   error: Exception) -> None:
    log.error("%s: %s failed: %s: %s", run, stage, type(error).__name__, error)
    if is_main_process():
        errors = workdir / "errors"
        errors.mkdir(exist_ok=True)
        write_text_atomic(errors / f"{error_name(run)}.{stage}.txt",
                          "".join(traceback.format_exception(type(error), error, error.__traceback__)))
    first_line = str(error).splitlines()[0] if str(error) else ""
    state.set(run, stage, {"status": "failed", "fingerprint": fp, "error": f"{type(error).__name__}: {first_line}"})


def run_job_file(path: str | Path) -> int:
    """In a run's own process (python -m roformer.ablation.job JOB.json): the run's stages
    that are not done yet, recorded in the job's own state file. Returns the exit status."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("roformer").setLevel(logging.INFO)
    spec = json.loads(Path(path).read_text())
    plan = build_plan(ml_collections.ConfigDict(spec["config"]), Path(spec["workdir"]), spec["vocab"])
    run = plan.run(spec["run"])
    if [stage.fingerprint for stage in run.stages] != spec["fingerprints"]:
        raise RuntimeError(f"{path}: the config read back does not give the stages' fingerprints")
    try:
        run_stages(AblationState(plan.workdir, Path(spec["state"])), plan, run)
    except Preempted as error:
        log.warning("%s", error)
        return PREEMPTED_EXIT
    return 0
