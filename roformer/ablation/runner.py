"""Running an ablation: the session that runs (or resumes) every job and rewrites the report.

For every pretraining seed and every scheme in `config.schemes`: MLM pretraining (an
ordinary pretrain workdir), length-extrapolation evaluation of the pretrained model, and
GLUE fine-tuning (an ordinary GLUE workdir). With `extension.enabled`, the pretrained
models of `extension.scheme` then continue pretraining at `extension.factor` times the
length under each of `extension.methods`, evaluated at that length after every few steps.
The seeds run in turn (every scheme of seed 0 first), so an interrupted ablation already
compares all schemes; the context extension runs once every seed's pretraining is done.

Re-running skips stages that finished with the same config (roformer.ablation.stages),
resumes interrupted training from its checkpoints, and retries failed stages. Every run
reads one vocabulary, pinned in the workdir (`pin_vocabulary`). With `config.parallel` = K
> 1 (CPU hosts) the runs go K at a time, each in a process of its own
(roformer.ablation.job) with a core's share of XLA:CPU threads (roformer.ablation.parallel;
output in DIR/logs/), with the same workdirs, records and resume.
"""
from __future__ import annotations

import contextlib
import json
import logging
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import jax
import ml_collections
from jax.experimental import multihost_utils

from roformer.ablation import collect, parallel, progress, report
from roformer.ablation.plan import Plan, PlannedRun, build_plan
from roformer.ablation.stages import (PREEMPTED_EXIT, Preempted, error_name, record_done, record_failure,
                                      run_stages, trained)
from roformer.ablation.state import PINNED_TOKENIZER, AblationState, is_main_process
from roformer.ablation.validation import validate
from roformer.errors import ConfigError
from roformer.files import write_json_atomic, write_text_atomic
from roformer import workdir_kind
from roformer.workdir_lock import workdir_lock

log = logging.getLogger("roformer.ablate")

# config.parallel > 1: a run's job file and its own state (merged into DIR/ablation_state.json
# when its process ends, or by the next session if this one was killed) live here, its output
# in DIR/logs/<run>.log.
JOBS_DIR = "parallel"
LOGS_DIR = "logs"
COMPILE_CACHE_DIR = "compile_cache"      # programs the runs' processes compiled (config.compile_cache)
CONFIG_RECORD = "ablation_config.json"   # the config of the latest session, written when it starts
POLL_S = 0.2


def run_ablation(config: ml_collections.ConfigDict, workdir: str | Path) -> dict:
    """Run (or resume) the whole ablation in `workdir` and write the report; returns it.
    The plan comes first and is validated before anything is written; a workdir another
    live run is using is refused (roformer.workdir_lock); the stages' own runs lock their
    sub-workdirs."""
    plan = build_plan(config, Path(workdir).resolve())
    validate(plan)
    with workdir_lock(workdir):
        workdir_kind.claim(workdir, workdir_kind.ABLATION)   # before anything is written
        return _run_ablation(plan)


def _run_ablation(plan: Plan) -> dict:
    workdir, config = plan.workdir, plan.config
    workdir.mkdir(parents=True, exist_ok=True)
    state = AblationState(workdir)
    if is_main_process():
        workdir_kind.record(workdir, workdir_kind.ABLATION)
        write_text_atomic(workdir / CONFIG_RECORD, config.to_json_best_effort(indent=2) + "\n")

    started = time.time()
    plan.use_vocabulary(pin_vocabulary(plan))
    result = None
    with progress.reporting(plan, enabled=is_main_process()):
        try:
            # config.parallel > 1: every run in a process of its own, that many at once.
            run_all = _run_side_by_side if config.parallel > 1 else _run_in_turn
            runs = list(plan.scheme_runs)
            if config.get("vmap_seeds", 1) > 1:   # the schemes' pretraining first, seeds vmapped; the other stages below
                failed = _pretrain_vmapped(plan, state, runs)
                runs = [run for run in runs if run.name not in failed]   # retried next session, as a failed stage is
            result = run_all(plan, state, runs)
            if plan.extension_runs:   # after the comparison itself, which it builds on
                result = run_all(plan, state, list(plan.extension_runs))
        except Preempted as error:
            log.warning("%s; stopping the ablation (re-run the command to resume)", error)
            result = None   # the runs done before the preemption are in the state, not yet in a report
    log.info("ablation session took %.0f s", time.time() - started)
    return result if result is not None else write_report(plan, state)


def write_report(plan: Plan, state: AblationState) -> dict:
    """Collect the results into the report dict and (main process) write its files."""
    result = collect.build_report(plan, state)
    if is_main_process():
        report.write_report(result, plan.workdir)
    return result


def report_snapshot(config: ml_collections.ConfigDict, workdir: str | Path, out_dir: str | Path) -> dict:
    """The report of what `workdir` holds now, written into `out_dir`; returns it. Trains
    nothing and takes no lock, so it also works while the ablation is running: runs still
    training show their evaluations so far (the onset section counts them as censored)."""
    workdir = Path(workdir).resolve()
    if not (workdir / CONFIG_RECORD).is_file():
        raise ConfigError(f"{workdir} holds no ablation ({CONFIG_RECORD} is missing): give the workdir of "
                          "a `python -m roformer.ablate` run")
    plan = build_plan(config, workdir)
    validate(plan)
    state = AblationState(workdir)
    # Runs going side by side keep their records in parallel/ until they end: read them too,
    # without writing anything.
    for path in sorted((workdir / JOBS_DIR).glob("*.state.json")):
        for run, records in json.loads(path.read_text()).items():
            state.data.setdefault(run, {}).update(records)
    result = collect.build_report(plan, state)
    report.write_report(result, out_dir)
    return result


def pin_vocabulary(plan: Plan) -> str:
    """The one vocabulary every run of the ablation reads: pretrain.data.vocab when set, else
    WORKDIR/tokenizer.json, taken from a run that already trained (an older workdir) or from
    the data pipeline on first use. WordPiece training is not deterministic (hash-map order
    inside `tokenizers`, huggingface/tokenizers#1794) and its cache is keyed by the files'
    paths, sizes and mtimes, so without a pin a resumed ablation on a new machine, or after
    the text was re-copied, would give its remaining runs a different vocabulary."""
    data, workdir = plan.config.pretrain.data, plan.workdir
    if data.vocab:
        return str(data.vocab)
    pinned = workdir / PINNED_TOKENIZER
    if is_main_process() and not pinned.is_file():
        write_text_atomic(pinned, _trained_vocabulary(data, workdir))
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("ablation vocabulary pinned")
    return str(pinned)


def _trained_vocabulary(data: ml_collections.ConfigDict, workdir: Path) -> str:
    """tokenizer.json text of the first run that trained (an older workdir), else of the data
    pipeline's vocabulary for the corpus (trained and cached on first use)."""
    # The checkpoint reader and the data pipeline (orbax, tokenizers): only when pinning.
    from roformer.data import DataConfig
    from roformer.data.pipeline import corpus_tokenizer
    from roformer.workdir import PretrainWorkdir

    trained = [PretrainWorkdir(p).tokenizer_file for p in sorted((workdir / "pretrain").glob("*/seed*"))
               if PretrainWorkdir.holds_run(p)]
    trained = [f for f in trained if f.is_file()]
    if trained:
        return trained[0].read_text()
    return corpus_tokenizer(DataConfig.from_mapping(data)).tokenizer.to_str()


def _run_in_turn(plan: Plan, state: AblationState, runs: list[PlannedRun]) -> dict | None:
    result = None
    for run in runs:
        run_stages(state, plan, run)
        result = write_report(plan, state)   # readable while the next run trains
    return result


# --------------------------------------------------------------------------- vmapped seeds


def _pretrain_vmapped(plan: Plan, state: AblationState, runs: list[PlannedRun]) -> set[str]:
    """The pretrain stage of every scheme's unfinished seeds, config.vmap_seeds at a time in
    one vmapped step (roformer.train.seeds), recorded as the stage would record it; a seed
    left alone trains with the other stages. Returns the runs whose pretraining failed here;
    raises Preempted when SIGTERM stopped a group."""
    from roformer.train.seeds import train_seeds_and_evaluate   # jax: only when vmapping

    workdir = plan.workdir
    _merge_job_states(state, workdir)   # what a killed side-by-side session left
    todo: dict[str, list[PlannedRun]] = {}
    for run in runs:
        if not state.is_done(run.name, "pretrain", run.fingerprint):
            todo.setdefault(run.key, []).append(run)
    size, failed = int(plan.config.vmap_seeds), set()
    for group in (seeds[start:start + size] for seeds in todo.values() for start in range(0, len(seeds), size)):
        if len(group) < 2:
            continue
        names = [run.name for run in group]
        log.info("%s: pretraining as %d vmapped seeds", ", ".join(names), len(group))
        begun = time.time()
        try:
            outcomes = train_seeds_and_evaluate([run.train_config for run in group], [run.workdir for run in group])
        except Exception as error:  # noqa: BLE001 - recorded for every seed of the group, as a stage's
            outcomes = [error] * len(group)
        wall, preempted = time.time() - begun, False
        for run, outcome in zip(group, outcomes):
            try:
                if isinstance(outcome, Exception):
                    raise outcome
                result = trained(outcome, run.train_config)
            except Preempted:
                preempted = True
                continue
            except Exception as error:  # noqa: BLE001 - recorded, as run_stages records a failed stage
                record_failure(state, workdir, run.name, "pretrain", run.fingerprint, error)
                failed.add(run.name)
                continue
            # wall_s: the group's, as each seed's training took all of it; a seed that had
            # finished alone before (its summary has no seeds_in_step) trained on its own.
            record_done(state, workdir, run.name, "pretrain", run.fingerprint, wall,
                        {**result, "seeds_in_step": outcome.get("seeds_in_step", 1)})
        write_report(plan, state)
        if preempted:
            raise Preempted(f"{', '.join(names)} preempted")
    return failed


# --------------------------------------------------------------------------- side by side


def _run_side_by_side(plan: Plan, state: AblationState, runs: list[PlannedRun]) -> dict | None:
    """Run the runs config.parallel at a time, each in a process of its own with its share of
    the cores (roformer.ablation.parallel), in the order given; the report is rewritten as each
    ends. On SIGTERM every running run saves a checkpoint and Preempted is raised once they have."""
    workdir = plan.workdir
    _merge_job_states(state, workdir)
    slots = parallel.core_slots(int(plan.config.parallel))
    pending = _unfinished(state, runs)
    running: dict[int, tuple[Any, PlannedRun]] = {}   # slot -> (process, run)
    stop: list[str] = []                       # why no further run starts

    def preempt(reason: str) -> None:
        if not stop:
            stop.append(reason)
            for process, _ in running.values():
                process.send_signal(signal.SIGTERM)   # each saves a checkpoint and exits

    handled = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, lambda *_: preempt("SIGTERM received")) if handled else None
    result = None
    try:
        while running or (pending and not stop):
            for slot, cores in enumerate(slots):
                if slot not in running and pending and not stop:
                    run = pending.pop(0)
                    running[slot] = (_start_run(plan, state, run, cores), run)
            time.sleep(POLL_S)
            for slot, (process, run) in list(running.items()):
                if process.poll() is None:
                    continue
                del running[slot]
                _merge_job_states(state, workdir, run.name)
                if process.returncode == PREEMPTED_EXIT:
                    preempt(f"{run.name} preempted")
                elif process.returncode != 0 and not (stop and process.returncode == -signal.SIGTERM):
                    _record_crash(state, workdir, run, process.returncode)
                log.info("%s: process ended (status %d)", run.name, process.returncode)
                result = write_report(plan, state)
    finally:
        for process, run in running.values():   # only after an error here: let them save and stop
            process.terminate()
            process.wait()
            _merge_job_states(state, workdir, run.name)
        if handled:
            signal.signal(signal.SIGTERM, previous)
        with contextlib.suppress(OSError):   # left only while runs are unmerged
            (workdir / JOBS_DIR).rmdir()
    if stop:
        raise Preempted(stop[0])
    return result


def _unfinished(state: AblationState, runs: list[PlannedRun]) -> list[PlannedRun]:
    """The runs with a stage left to run (a process starts only for those)."""
    pending = []
    for run in runs:
        if all(state.is_done(run.name, stage.name, stage.fingerprint) for stage in run.stages):
            log.info("%s: already done, skipping", run.name)
        else:
            pending.append(run)
    return pending


def _start_run(plan: Plan, state: AblationState, run: PlannedRun, cores: list[int]):
    workdir, name = plan.workdir, error_name(run.name)
    jobs_dir, logs_dir = workdir / JOBS_DIR, workdir / LOGS_DIR
    jobs_dir.mkdir(exist_ok=True)
    logs_dir.mkdir(exist_ok=True)
    job_state = jobs_dir / f"{name}.state.json"
    write_json_atomic(job_state, {run.name: state.data.get(run.name, {})})
    # The process builds the plan again from this config and checks it gives these fingerprints.
    spec = {"config": plan.config.to_dict(), "workdir": str(workdir), "run": run.name,
            "vocab": run.train_config.data.vocab, "state": str(job_state),
            "fingerprints": [stage.fingerprint for stage in run.stages]}
    write_json_atomic(jobs_dir / f"{name}.job.json", spec)
    log.info("%s: starting in a process of its own (log: %s)", run.name, logs_dir / f"{name}.log")
    with open(logs_dir / f"{name}.log", "a") as out:
        return subprocess.Popen([sys.executable, "-m", "roformer.ablation.job", str(jobs_dir / f"{name}.job.json")],
                                env=parallel.child_env(cores, compile_cache=compile_cache_dir(plan.config, workdir)),
                                stdout=out, stderr=subprocess.STDOUT)


def compile_cache_dir(config, workdir: Path) -> Path | None:
    """Where the ablation's processes (the command's own and the runs') share compiled
    programs (config.compile_cache), if they do."""
    return workdir / COMPILE_CACHE_DIR if config.compile_cache else None


def _merge_job_states(state: AblationState, workdir: Path, run: str | None = None) -> None:
    """Take the records a run's process wrote (all runs' when `run` is None: what a killed
    session left) into the ablation's state, and remove its job files."""
    jobs_dir = workdir / JOBS_DIR
    names = [f"{error_name(run)}.state.json"] if run else sorted(p.name for p in jobs_dir.glob("*.state.json"))
    for name in names:
        path = jobs_dir / name
        if path.exists():
            for run_name, records in json.loads(path.read_text()).items():
                for stage, record in records.items():
                    if record != state.get(run_name, stage):
                        state.set(run_name, stage, record)
            path.unlink()
        (jobs_dir / name.replace(".state.json", ".job.json")).unlink(missing_ok=True)


def _record_crash(state: AblationState, workdir: Path, run: PlannedRun, returncode: int) -> None:
    """A run's process that died without recording its stage (killed, out of memory): the
    stage it was in is failed, so the report says so and the next session retries it."""
    for stage in run.stages:
        if state.get(run.name, stage.name).get("status") == "failed":
            return
        if not state.is_done(run.name, stage.name, stage.fingerprint):
            log_file = workdir / LOGS_DIR / f"{error_name(run.name)}.log"
            how = (f"was killed by {signal.Signals(-returncode).name}" if returncode < 0
                   else f"exited with status {returncode}")
            record_failure(state, workdir, run.name, stage.name, stage.fingerprint, RuntimeError(
                f"the run's process {how}; its output is in {log_file}"))
            return
