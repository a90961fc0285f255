"""`train_and_evaluate(config, workdir)`: the MLM pretraining loop.

Owns the run: mesh, sharded state, data iterator, jitted steps, evaluation,
logging, checkpoints, resume, preemption (SIGTERM, Ctrl-C) and the divergence guard (a
non-finite loss, or a finite one far above its recent level: roformer.train.guard).
What a run reads and writes in its workdir is roformer.train.bookkeeping's (checkpoint
saving included), its log and stop flag roformer.train.run_log's and its held-out
evaluation roformer.train.evaluation's, each shared with the vmapped seeds
(roformer.train.seeds): the drivers differ in what they step.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from pathlib import Path

import jax

from roformer.accelerator import startup_line
from roformer.distributed import allgather_json, initialize_distributed
from roformer.model.attention import check_attention_impl
from roformer.train import bookkeeping, compiled, flops, memory, profiling, progress, sharding, warm_start
from roformer.train.config import (TrainConfig, build_model_config, check_attention_setting, parse_phases,
                                   phase_config)
from roformer.train.evaluation import held_out_batches, held_out_rows
from roformer.train.guard import stop_reason_kept
from roformer.train.metrics import MetricsWriter, ThroughputTimer
from roformer.train.run_log import StopFlag, TrainLog, due
from roformer.train.state import TrainSetup
from roformer.workdir import PretrainWorkdir
from roformer import workdir_kind
from roformer.workdir_lock import workdir_lock

log = logging.getLogger("roformer.train")


def train_and_evaluate(config, workdir: str | Path) -> dict:
    """Pretrain (or resume) with `config` in `workdir`; returns a summary dict. A workdir
    another live run is using is refused (roformer.workdir_lock).

    With `train.phases` the phases run in order in the one workdir: each resumes the
    previous one's checkpoint (model, optimizer, step) with its own batch shape (and
    masked slots), and the learning-rate schedule spans the whole run (train.decay_steps,
    default: all steps); a phase may scale it (lr=) and warm up again (warmup=)."""
    initialize_distributed(config.distributed)   # first: the lock is process 0's
    workdir = Path(workdir).resolve()
    with workdir_lock(workdir):
        workdir_kind.claim(workdir, workdir_kind.PRETRAINING)   # before anything is written
        if not str(config.train.phases or "").strip():
            return _train_phase(config, workdir)
        phases = parse_phases(config.train)
        done = max(PretrainWorkdir(workdir).steps(), default=0) if PretrainWorkdir.holds_run(workdir) else 0
        summary: dict = {}
        for index, phase in enumerate(phases):
            if done >= phase.end and index < len(phases) - 1:
                continue   # finished earlier; the last phase still reports
            phase_cfg = phase_config(config, phase, phases)
            log.info("phase %d of %d: up to step %d at seq_len %d, batch %d", index + 1, len(phases), phase.end,
                     phase.seq_len, phase.batch_size)
            summary = _train_phase(phase_cfg, workdir)
            if summary.get("preempted"):
                break
        return summary


@dataclasses.dataclass
class _PhaseInputs:
    """What a phase trains, read and checked before anything is written to the workdir."""
    tc: TrainConfig
    mesh: object
    init_source: object      # the warm start's checkpoint, or None
    data: object
    model_cfg: object
    init_params: dict | None   # a fresh warm start's parameters, until they are on the device
    checked: tuple | None = None   # (setup, train step) the fit check before the data compiled


@dataclasses.dataclass
class _Phase:
    """A phase's running parts, made by `_start_phase` and stepped by `_step_loop`."""
    tc: TrainConfig
    mesh: object
    model_cfg: object
    checkpointer: object
    state: dict
    rest: dict
    start_step: int
    train_iter: object
    train_step: object
    eval_step: object
    stats_step: object
    eval_batches: object
    train_log: TrainLog
    timer: ThroughputTimer
    stop: StopFlag
    profiler: object
    evaluated: dict = dataclasses.field(default_factory=dict)   # step -> held-out loss, for its checkpoint

    def evaluate(self, step: int) -> dict:
        row, = held_out_rows(self.eval_step, self.stats_step, self.state["params"], self.rest, self.eval_batches)
        self.train_log.write(step, row)
        self.evaluated.update({step: row["eval_loss"]})
        self.train_log.check_eval(step, row["eval_loss"])
        return row

    def save(self, step: int) -> None:
        bookkeeping.save_checkpoint(self.checkpointer, step, self.state, self.train_iter, self.model_cfg, self.tc,
                                    self.evaluated.get(step))


def _train_phase(config, workdir: Path) -> dict:
    """One phase (or a whole run without phases): setup, the step loop, the summary."""
    inputs = _phase_inputs(config, workdir)
    tc, mesh, data, is_main = inputs.tc, inputs.mesh, inputs.data, jax.process_index() == 0
    # closes the progress bar, signal handler, logs, checkpoints; a stop's own line outlives what closing them meets
    with stop_reason_kept(), contextlib.ExitStack() as cleanup:
        cleanup.callback(data.close)   # a cache still building for this run stops with it
        checkpointer, finished = bookkeeping.open_run(cleanup, workdir, tc, inputs.model_cfg, is_main=is_main)
        if finished is not None:
            return finished
        phase = _start_phase(cleanup, config, workdir, inputs, checkpointer, is_main)
        wall_start = time.perf_counter()
        step, preempted, last_eval = _step_loop(phase)

    summary = bookkeeping.run_summary(workdir, final_step=step, start_step=phase.start_step, preempted=preempted,
                                      train_log=phase.train_log, last_eval=last_eval,
                                      wall_time_s=time.perf_counter() - wall_start, num_devices=mesh.devices.size,
                                      num_processes=jax.process_count(), data=data,
                                      stop_signal=phase.stop.signal if preempted else None)
    if is_main:
        bookkeeping.write_summary(workdir, summary)
    return summary


def _phase_inputs(config, workdir: Path) -> _PhaseInputs:
    """The phase's settings, mesh, data and model, each checked before anything is written:
    a refusal leaves no files."""
    tc = TrainConfig.from_section(config.train)
    mesh = _make_mesh(config.mesh, tc)
    init_source = warm_start.find_init_checkpoint(tc.init_from, tc.init_step) if tc.init_from else None
    if init_source is None:   # this config's architecture (a warm start's is the checkpoint's: checked below)
        check_attention_setting(config.model)
    checked = None if init_source is not None else _refuse_unfit_before_data(config, tc, mesh)
    data = bookkeeping.run_data(config.data, tc, init_source, workdir=workdir)
    if init_source is None:
        model_cfg = build_model_config(config.model, vocab_size=data.vocab_size, pad_token_id=data.pad_id)
    else:   # the checkpoint's architecture; checked before anything is written, so a refusal leaves no files
        model_cfg = warm_start.resolve_model_config(config.model, init_source, vocab_size=data.vocab_size,
                                                    pad_token_id=data.pad_id, tokenizer_hash=data.tokenizer.hash)
        check_attention_impl(model_cfg)   # before anything is written to the workdir
    # a batch that cannot fit: refused in one line now, not by the OOM killer after the workdir is written
    memory.check_step_memory(model_cfg, batch_size=tc.batch_size, seq_len=tc.seq_len,
                             num_predictions=data.masker.max_predictions, grad_accum=tc.grad_accum,
                             num_devices=mesh.devices.size, num_processes=jax.process_count())
    if jax.process_index() == 0:
        log.info("%s", startup_line(model_cfg))
    init_params = None
    if init_source is not None and not PretrainWorkdir.holds_run(workdir):   # a fresh start will use them
        init_params = warm_start.load_init_params(init_source, model_cfg, warm_start.abstract_params(model_cfg),
                                                  data.tokenizer.hash, grow_positions=tc.init_grow_positions)
    return _PhaseInputs(tc, mesh, init_source, data, model_cfg, init_params, checked)


def _start_phase(cleanup: contextlib.ExitStack, config, workdir: Path, inputs: _PhaseInputs, checkpointer,
                 is_main: bool) -> _Phase:
    """The compiled steps, the state (restored or initialised), the held-out batches and the
    run's log, profiler and stop flag, each closed by `cleanup`."""
    tc, mesh, data, model_cfg = inputs.tc, inputs.mesh, inputs.data, inputs.model_cfg
    # the device kind's (None on a CPU: MFU is not reported there)
    peak_flops = flops.device_peak_flops(jax.devices()[0], model_cfg.dtype, tc.peak_flops_per_device)
    if inputs.checked is not None and inputs.checked[0].model_cfg == model_cfg:   # the data's model is the one checked
        setup, train_jit = inputs.checked
    else:   # a warm start's model, or a tokenizer of another size than data.vocab_size: checked now
        setup, train_jit = _checked_train_step(config, tc, mesh, model_cfg)
    inputs.checked = None
    cleanup.enter_context(jax.set_mesh(mesh))   # after the setup: its abstract model is traced without a mesh
    rest = setup.init_rest()   # RNG streams only; dropout keys are re-derived every step
    state, start_step, train_iter = bookkeeping.restore_or_init(
        setup, checkpointer, data, tc, init_source=inputs.init_source, init_params=inputs.init_params)
    inputs.init_params = None   # on the device now
    if is_main:   # after every check that can refuse the run (the corpus's, at the restore)
        bookkeeping.write_run_files(workdir, config, model_cfg, data.tokenizer)
    eval_batches = held_out_batches(data, tc, mesh)
    # the first call of each compiles it: announced, with its time (progress.announce_compile)
    train_step = progress.announce_compile(train_jit, "the train step", enabled=is_main)
    eval_step = progress.announce_compile(setup.jit_eval_step(), "the evaluation step", enabled=is_main)
    # Linear attention forms no probabilities to measure.
    stats_step = (progress.announce_compile(setup.jit_attention_stats_step(), "the attention-statistics step",
                                            enabled=is_main)
                  if tc.eval_attention_stats and model_cfg.attention == "softmax" else None)
    writer = cleanup.enter_context(contextlib.closing(MetricsWriter(workdir, resume_step=start_step)))
    stop = cleanup.enter_context(StopFlag())
    profiler = cleanup.enter_context(profiling.StepProfiler(tc.profile_steps, workdir / "tensorboard",
                                                            enabled=is_main))
    bar = cleanup.enter_context(progress.progress_bar(total=tc.steps, initial=start_step, desc="pretrain",
                                                      enabled=is_main and tc.progress_bar))
    step_flops = flops.train_flops_per_step(model_cfg, batch_size=tc.batch_size, seq_len=tc.seq_len,
                                            num_predictions=data.masker.max_predictions,
                                            segmented=data.packing == "packed")
    timer = ThroughputTimer(tokens_per_step=tc.batch_size * tc.seq_len, flops_per_step=step_flops,
                            peak_flops=peak_flops, num_devices=mesh.devices.size)   # the devices it runs on
    logged = bookkeeping.logged_history(workdir, start_step, tc.divergence_window) if is_main else None
    logged = logged if jax.process_count() == 1 else allgather_json(logged)[0]   # one guard everywhere
    guard = bookkeeping.resumed_guard(tc, logged, start_step)
    train_log = TrainLog(writer, timer, bar, checkpointer, guard, first_loss=logged["first_loss"],
                         mark={"phase": train_iter.phase, "seq_len": tc.seq_len})   # on every metrics row
    return _Phase(tc, mesh, model_cfg, checkpointer, state, rest, start_step, train_iter, train_step, eval_step,
                  stats_step, eval_batches, train_log, timer, stop, profiler)


def _step_loop(phase: _Phase) -> tuple[int, bool, dict]:
    """Train up to tc.steps with the log, evaluation and checkpoints due at each step; stops
    at a signal (after saving). Returns (the last step, whether a signal stopped it, the last
    evaluation)."""
    tc, mesh, train_log, stop = phase.tc, phase.mesh, phase.train_log, phase.stop
    step, preempted, last_eval = phase.start_step, False, {}
    if step == 0 and tc.init_from:   # the warm start's own held-out loss, before any update
        last_eval = phase.evaluate(step)
    while step < tc.steps:
        phase.profiler.before(step + 1)
        phase.state, metrics = phase.train_step(phase.state, phase.rest,
                                                sharding.global_batch(next(phase.train_iter), mesh))
        step += 1
        phase.profiler.after(step, phase.state)
        train_log.add(step, metrics)
        now = due(step, tc)
        preempted = stop.should_stop(step, tc.log_every)
        if now.log or now.checkpoint or preempted:
            train_log.flush(step)
        if preempted:
            phase.save(step)
            log.warning("%s received: saved a checkpoint at step %d; exiting", stop.signal, step)
            break
        if not (now.eval or now.checkpoint):
            continue
        with phase.timer.paused(ready=phase.state):
            if now.eval:
                last_eval = phase.evaluate(step)
            if now.checkpoint and train_log.may_save(step, final=step == tc.steps):
                phase.save(step)
    if not preempted and step == phase.start_step:   # nothing left to train: report eval only
        last_eval = phase.evaluate(step)
    return step, preempted, last_eval


def _checked_train_step(config, tc: TrainConfig, mesh, model_cfg):
    """(the setup, its jitted train step) for `model_cfg`. On a device that reports its
    memory, the step is compiled first and refused in one line when it cannot fit; the
    program compiled for the check is then the one the loop runs."""
    setup = TrainSetup(model_cfg, *bookkeeping.run_optimizer(tc), mesh, seed=tc.seed,
                       dropout_rng_impl=tc.dropout_rng_impl)
    train_jit = setup.jit_train_step(grad_accum=tc.grad_accum, debug_nan_step=tc.debug_nan_step)
    state_structs = setup.sharded_abstract_state()
    with jax.set_mesh(mesh):
        compiled.refuse_unfit_step(
            train_jit, (state_structs, setup.sharded_abstract_rest(),
                        compiled.step_batch(config.data, tc.seq_len, tc.batch_size, mesh)),
            fsdp=mesh.shape["fsdp"], state_bytes=compiled.device_bytes(state_structs), remat=model_cfg.remat)
    return setup, train_jit


def _refuse_unfit_before_data(config, tc: TrainConfig, mesh):
    """The fit check of a fresh run, before its data pipeline starts (a cache build on every
    host) or any checkpoint is read: the config's model with data.vocab's size (a given
    vocabulary file) or data.vocab_size (the size the tokenizer is trained to) compiled for
    this device. Returns (setup, train step) for the loop to keep when the data's tokenizer
    gives the same model, or None where the device reports no memory (a CPU), so nothing is
    compiled twice."""
    if not compiled.device_memory_limit():
        return None
    from roformer.data.tokenizer import load_tokenizer

    vocab_size = (load_tokenizer(config.data.vocab, lowercase=config.data.lowercase).vocab_size if config.data.vocab
                  else int(config.data.vocab_size))
    return _checked_train_step(config, tc, mesh, build_model_config(config.model, vocab_size=vocab_size))


def _make_mesh(mesh_cfg, tc: TrainConfig):
    mesh = sharding.make_mesh(mesh_cfg)
    layout = sharding.process_layout(mesh, tc.batch_size, tc.grad_accum, processes=jax.process_count())
    if jax.process_count() > 1 and jax.process_index() == 0:
        log.info("%s", layout.describe())
    return mesh


