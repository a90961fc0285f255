"""The stages of one run, run in order and recorded.

A scheme's run has the stages pretrain -> extrapolation -> glue, a context-extension run
extension -> extension_eval. Each stage is (name, fingerprint, call); a stage whose record
is done with the same fingerprint is skipped, a failing one is recorded (traceback in
DIR/errors/<run>.<stage>.txt) and the run's other stages still go ahead, except after a
failed first stage (training), whose model the rest need.
"""
from __future__ import annotations

import json
import logging
import time
import traceback
from pathlib import Path
from typing import Callable

import ml_collections

from roformer.ablation.plan import (Job, extension_pretrain_config, extension_workdir, fingerprint,
                                    pretrain_workdir, scheme_glue_config, scheme_pretrain_config, split_list)
from roformer.ablation.state import AblationState, is_main_process
from roformer.files import write_text_atomic

log = logging.getLogger("roformer.ablate")

Stage = tuple[str, str, Callable[[], dict]]   # (stage, fingerprint, call)
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


def _run_extrapolation(config: ml_collections.ConfigDict, pretrain_cfg: ml_collections.ConfigDict,
                       pretrain_workdir: Path) -> dict:
    # jax and the data pipeline: when a stage runs.
    from roformer.ablation import extrapolation
    from roformer.data import DataConfig

    ext = config.extrapolation
    return extrapolation.evaluate_workdir(
        pretrain_workdir, DataConfig.from_mapping(pretrain_cfg.data), seq_len=pretrain_cfg.train.seq_len,
        factors=[int(f) for f in split_list(ext.factors)], scalings=split_list(ext.scalings),
        num_docs=ext.num_docs, batch_size=ext.batch_size, seed=pretrain_cfg.train.seed)


def _run_extension_eval(config: ml_collections.ConfigDict, pretrain_cfg: ml_collections.ConfigDict,
                        extension_workdir: Path) -> dict:
    """Held-out loss at factor x the length after every saved extension step, on the same
    windows as the extrapolation table (so step 0 is that table's column)."""
    # jax and the data pipeline: when a stage runs.
    from roformer.ablation import extrapolation
    from roformer.data import DataConfig

    ext = config.extrapolation
    return extrapolation.evaluate_checkpoints(
        extension_workdir, DataConfig.from_mapping(pretrain_cfg.data), seq_len=pretrain_cfg.train.seq_len,
        factors=[int(f) for f in split_list(ext.factors)], factor=int(config.extension.factor),
        num_docs=ext.num_docs, batch_size=ext.batch_size, seed=pretrain_cfg.train.seed)


# Stage runners are looked up here at call time, so tests can swap in fast fakes.
STAGE_RUNNERS: dict[str, Callable] = {
    "pretrain": _train, "extrapolation": _run_extrapolation, "glue": _run_glue,
    "extension": _train, "extension_eval": _run_extension_eval,
}


# --------------------------------------------------------------------------- a run's stages


def scheme_pretrain(config, workdir: Path, scheme: str, seed: int, vocab: str
                    ) -> tuple[ml_collections.ConfigDict, Path, str]:
    """A scheme's pretraining run: its config (reading the pinned vocabulary), workdir and
    fingerprint."""
    pretrain_cfg = scheme_pretrain_config(config, scheme, seed)
    # The pinned vocabulary is a property of the workdir, not of the config: fingerprints
    # stay those of the config as written, so moving the workdir resumes it.
    fp = fingerprint(pretrain_cfg)
    pretrain_cfg.data.vocab = vocab
    return pretrain_cfg, pretrain_workdir(workdir, scheme, seed), fp


def scheme_stages(config, workdir: Path, scheme: str, seed: int, vocab: str) -> list[Stage]:
    """(stage, fingerprint, call) for one scheme and seed."""
    pretrain_cfg, pretrain_dir, fp = scheme_pretrain(config, workdir, scheme, seed, vocab)
    stages = [
        ("pretrain", fp, lambda: STAGE_RUNNERS["pretrain"](pretrain_cfg, pretrain_dir)),
        ("extrapolation", fingerprint(fp, config.extrapolation),
         lambda: STAGE_RUNNERS["extrapolation"](config, pretrain_cfg, pretrain_dir)),
    ]
    if split_list(config.glue.task):
        stages.append(("glue", fingerprint(fp, config.glue), lambda: STAGE_RUNNERS["glue"](
            scheme_glue_config(config, pretrain_dir), workdir / "glue" / scheme / f"seed{seed}")))
    return stages


def extension_stages(config, workdir: Path, method: str, seed: int, vocab: str) -> list[Stage]:
    source = pretrain_workdir(workdir, config.extension.scheme, seed)
    ext_cfg = extension_pretrain_config(config, method, seed, source)
    pretrain_cfg = scheme_pretrain_config(config, config.extension.scheme, seed)
    ext_dir = extension_workdir(workdir, method, seed)
    fp = fingerprint(fingerprint(pretrain_cfg), ext_cfg)
    ext_cfg.data.vocab = pretrain_cfg.data.vocab = vocab
    return [
        ("extension", fp, lambda: STAGE_RUNNERS["extension"](ext_cfg, ext_dir)),
        ("extension_eval", fingerprint(fp, config.extrapolation),
         lambda: STAGE_RUNNERS["extension_eval"](config, pretrain_cfg, ext_dir)),
    ]


def job_stages(config, workdir: Path, job: Job, vocab: str) -> list[Stage]:
    make = scheme_stages if job.kind == "scheme" else extension_stages
    return make(config, workdir, job.key, job.seed, vocab)


def run_stages(state: AblationState, workdir: Path, run: str, stages: list[Stage]) -> None:
    """Run the stages of one run that are not done yet; failures are recorded, not raised.
    A failed first stage (training) skips the rest, which need its model."""
    for index, (stage, fp, call) in enumerate(stages):
        if state.is_done(run, stage, fp):
            log.info("%s: %s already done, skipping", run, stage)
            continue
        log.info("%s: %s starting", run, stage)
        start = time.time()
        try:
            result = call()
        except Preempted:
            raise
        except Exception as error:  # noqa: BLE001 - recorded; the other stages and runs still go ahead
            record_failure(state, workdir, run, stage, fp, error)
            if index == 0:
                return
            continue
        record_done(state, workdir, run, stage, fp, time.time() - start, result)


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
    config = ml_collections.ConfigDict(spec["config"])
    workdir, job = Path(spec["workdir"]), Job(*spec["job"])
    stages = job_stages(config, workdir, job, spec["vocab"])
    if [fp for _, fp, _ in stages] != spec["fingerprints"]:
        raise RuntimeError(f"{path}: the config read back does not give the stages' fingerprints")
    try:
        run_stages(AblationState(workdir, Path(spec["state"])), workdir, job.run, stages)
    except Preempted as error:
        log.warning("%s", error)
        return PREEMPTED_EXIT
    return 0
