"""`train_and_evaluate(config, workdir)`: the MLM pretraining loop.

Owns the run: mesh, sharded state, data iterator, jitted steps, evaluation,
logging, checkpoints, resume, preemption (SIGTERM, Ctrl-C) and the divergence guard (a
non-finite loss, or a finite one far above its recent level: roformer.train.guard).
What a run reads and writes in its workdir is roformer.train.bookkeeping's, shared with
the vmapped seeds (roformer.train.seeds).
"""
from __future__ import annotations

import contextlib
import logging
import math
import signal
import threading
import time
from pathlib import Path

import jax
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

from roformer.accelerator import startup_line
from roformer.distributed import allgather_json, initialize_distributed
from roformer.model import attention_stats
from roformer.model import ModelConfig
from roformer.model.attention import check_attention_impl
from roformer.train import bookkeeping, compiled, flops, progress, sharding, steps, warm_start
from roformer.train.checkpoint import Checkpointer
from roformer.train.config import TrainConfig, parse_phases
from roformer.train.guard import DivergenceGuard, TrainingDiverged
from roformer.train.metrics import MetricsWriter, ThroughputTimer
from roformer.train.state import TrainSetup
from roformer.workdir import PretrainWorkdir
from roformer.workdir_lock import workdir_lock

log = logging.getLogger("roformer.train")


def build_model_config(model_section, *, vocab_size: int, pad_token_id: int = 0) -> ModelConfig:
    """ModelConfig from the `model` config section: the size preset, then every
    field that is set (None placeholders keep the preset's value). The vocabulary
    and padding id come from the data's tokenizer."""
    fields = {k: v for k, v in model_section.to_dict().items() if k != "size" and v is not None}
    return ModelConfig.from_preset(model_section.size, vocab_size=vocab_size, pad_token_id=pad_token_id,
                                   **fields)


def check_attention_setting(model_section) -> None:
    """Refuse an attention_impl the model of this `model` config section cannot run on this
    device (attention.check_attention_impl) from the config alone, so before any data is
    tokenized or file written; the vocabulary, which the data decides, does not enter it."""
    check_attention_impl(build_model_config(model_section, vocab_size=ModelConfig.vocab_size))


class StopFlag:
    """Set by SIGTERM (preemption notice) or SIGINT (Ctrl-C) while the `with` block runs; the
    loop then saves and exits cleanly. A second Ctrl-C interrupts at once (KeyboardInterrupt).
    The previous handlers come back on exit."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.requested = False
        self.signal = ""   # the name of the signal that asked to stop
        self._previous: dict = {}

    def __enter__(self) -> "StopFlag":
        if threading.current_thread() is threading.main_thread():
            self._previous = {signum: signal.signal(signum, self._handle) for signum in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)

    def _handle(self, signum, frame) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        self.signal = signal.Signals(signum).name

    def should_stop(self, step: int, every: int) -> bool:
        """Single process: as soon as signalled. Multi-process: every `every` steps
        all processes agree (any one signalled -> all stop at the same step)."""
        if jax.process_count() == 1:
            return self.requested
        if step % every:
            return False
        flags = multihost_utils.process_allgather(np.array([self.requested], np.int32))
        return bool(np.any(flags))


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


def phase_config(config, phase, phases: list) -> ml_collections.ConfigDict:
    """The config `phase` (one of `phases`, train.phases parsed) trains with: its steps, batch
    shape and masked slots, with the learning-rate schedule over all phases."""
    phase_cfg = ml_collections.ConfigDict(config.to_dict())
    phase_cfg.train.update(steps=phase.end, seq_len=phase.seq_len, batch_size=phase.batch_size,
                           decay_steps=config.train.decay_steps or phases[-1].end)
    if phase.max_predictions:
        phase_cfg.data.max_predictions_per_seq = phase.max_predictions
    return phase_cfg


def _train_phase(config, workdir: Path) -> dict:
    """One phase (or a whole run without phases): setup, the step loop, the summary."""
    tc = TrainConfig.from_section(config.train)
    mesh = _make_mesh(config.mesh, tc)
    init_source = warm_start.find_init_checkpoint(tc.init_from, tc.init_step) if tc.init_from else None
    if init_source is None:   # this config's architecture (a warm start's is the checkpoint's: checked below)
        check_attention_setting(config.model)
    data = bookkeeping.run_data(config.data, tc, init_source, workdir=workdir)
    if init_source is None:
        model_cfg = build_model_config(config.model, vocab_size=data.vocab_size, pad_token_id=data.pad_id)
    else:   # the checkpoint's architecture; checked before anything is written, so a refusal leaves no files
        model_cfg = warm_start.resolve_model_config(config.model, init_source, vocab_size=data.vocab_size,
                                                    pad_token_id=data.pad_id, tokenizer_hash=data.tokenizer.hash)
        check_attention_impl(model_cfg)   # before anything is written to the workdir
    if jax.process_index() == 0:
        log.info("%s", startup_line(model_cfg))
    init_params = None
    if init_source is not None and not PretrainWorkdir.holds_run(workdir):   # a fresh start will use them
        init_params = warm_start.load_init_params(init_source, model_cfg, warm_start.abstract_params(model_cfg),
                                                  data.tokenizer.hash, grow_positions=tc.init_grow_positions)
    is_main = jax.process_index() == 0

    with contextlib.ExitStack() as cleanup:   # closes the progress bar, signal handler, logs, checkpoints
        checkpointer, finished = bookkeeping.open_run(cleanup, workdir, tc, model_cfg, is_main=is_main)
        if finished is not None:
            return finished
        # the device kind's (None on a CPU: MFU is not reported there)
        peak_flops = flops.device_peak_flops(jax.devices()[0], model_cfg.dtype, tc.peak_flops_per_device)
        setup = TrainSetup(model_cfg, *bookkeeping.run_optimizer(tc), mesh, seed=tc.seed,
                           dropout_rng_impl=tc.dropout_rng_impl)
        cleanup.enter_context(jax.set_mesh(mesh))
        train_jit = setup.jit_train_step(grad_accum=tc.grad_accum, debug_nan_step=tc.debug_nan_step)
        # On a device that reports its memory, a step that cannot fit is refused in one line before the
        # state is made; the program compiled for the check is the one the loop runs.
        state_structs = setup.sharded_abstract_state()
        compiled.refuse_unfit_step(
            train_jit, (state_structs, setup.sharded_abstract_rest(),
                        compiled.step_batch(config.data, tc.seq_len, tc.batch_size, mesh)),
            fsdp=mesh.shape["fsdp"], state_bytes=compiled.device_bytes(state_structs))
        rest = setup.init_rest()   # RNG streams only; dropout keys are re-derived every step
        state, start_step, train_iter = bookkeeping.restore_or_init(
            setup, checkpointer, data, tc, init_source=init_source, init_params=init_params)
        del init_params   # on the device now
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
        evaluated: dict = {}   # step -> held-out loss, for the checkpoint saved at that step

        def evaluate(step: int) -> dict:
            row = _evaluate(eval_step, state["params"], rest, eval_batches)
            if stats_step is not None:
                row.update(attention_stats.as_metrics(jax.device_get(
                    stats_step(state["params"], rest, eval_batches[""][0]))))
            train_log.write(step, row)
            evaluated.update({step: row["eval_loss"]})
            train_log.check_eval(step, row["eval_loss"])
            return row

        def save(step: int) -> None:
            metrics = {"eval_loss": evaluated[step]} if step in evaluated else None
            checkpointer.save(step, state, train_iter.get_state(), model_cfg.to_dict(), metrics=metrics,
                              optimizer=bookkeeping.optimizer_settings(tc))

        wall_start, step, preempted, last_eval = time.perf_counter(), start_step, False, {}
        if step == 0 and tc.init_from:   # the warm start's own held-out loss, before any update
            last_eval = evaluate(step)
        while step < tc.steps:
            state, metrics = train_step(state, rest, sharding.global_batch(next(train_iter), mesh))
            step += 1
            train_log.add(step, metrics)
            checkpoint_due = step % tc.checkpoint_every == 0 or step == tc.steps
            preempted = stop.should_stop(step, tc.log_every)
            if step % tc.log_every == 0 or checkpoint_due or preempted:
                train_log.flush(step)
            if preempted:
                save(step)
                log.warning("%s received: saved a checkpoint at step %d; exiting", stop.signal, step)
                break
            eval_due = step % tc.eval_every == 0 or step == tc.steps
            if not (eval_due or checkpoint_due):
                continue
            with timer.paused(ready=state):
                if eval_due:
                    last_eval = evaluate(step)
                if checkpoint_due and guard.suspicious and step < tc.steps:
                    log.warning("step %d: checkpoint skipped while the training loss is out of range", step)
                elif checkpoint_due:
                    save(step)
        if not preempted and step == start_step:   # nothing left to train: report eval only
            last_eval = evaluate(step)

    summary = bookkeeping.run_summary(workdir, final_step=step, start_step=start_step, preempted=preempted,
                                      train_log=train_log, last_eval=last_eval,
                                      wall_time_s=time.perf_counter() - wall_start, num_devices=mesh.devices.size,
                                      num_processes=jax.process_count(), data=data)
    if is_main:
        bookkeeping.write_summary(workdir, summary)
    return summary


def _make_mesh(mesh_cfg, tc: TrainConfig):
    mesh = sharding.make_mesh(mesh_cfg)
    layout = sharding.process_layout(mesh, tc.batch_size, tc.grad_accum, processes=jax.process_count())
    if jax.process_count() > 1 and jax.process_index() == 0:
        log.info("%s", layout.describe())
    return mesh


def held_out_batches(data, tc: TrainConfig, mesh) -> dict[str, list]:
    """The held-out batches on the mesh: "" plain, "shuffled" with each document's tokens shuffled."""
    eval_sets = {"": data.eval_batches(tc.eval_batches)}
    if tc.eval_shuffled:
        eval_sets["shuffled"] = data.eval_batches(tc.eval_batches, shuffled=True)
    return {name: [sharding.global_batch(b, mesh) for b in batches] for name, batches in eval_sets.items()}


def _evaluate(eval_step, params, rest, eval_batches: dict[str, list]) -> dict:
    return eval_row({name: eval_totals(eval_step, params, rest, batches) for name, batches in eval_batches.items()})


def eval_totals(eval_step, params, rest, batches: list) -> dict[str, np.ndarray]:
    """The loss, correct and weight sums of `eval_step` over `batches`, added up in float64
    (with any leading axis the step's outputs have: vmapped seeds)."""
    totals = None
    for batch in batches:
        sums = {k: np.asarray(v, np.float64) for k, v in jax.device_get(eval_step(params, rest, batch)).items()}
        totals = sums if totals is None else {k: totals[k] + sums[k] for k in totals}
    return totals


def eval_row(totals: dict[str, dict]) -> dict:
    """The metrics row of held-out sums per evaluation set ("" plain, "shuffled")."""
    row = {}
    for name, sums in totals.items():
        row.update(steps.summarize_eval(sums, prefix=f"eval_{name}_" if name else "eval_"))
    if "eval_shuffled_loss" in row:   # how much the model uses word order (0: not at all)
        row["eval_order_gap"] = row["eval_shuffled_loss"] - row["eval_loss"]
    return row


class TrainLog:
    """Training metrics on their way to the log: kept on device until a row is due, then
    fetched, checked for a non-finite loss, averaged over the interval and written with
    the throughput and the phase mark."""

    def __init__(self, writer: MetricsWriter, timer: ThroughputTimer, bar, checkpointer: Checkpointer,
                 guard: DivergenceGuard, *, mark: dict, first_loss: float | None = None):
        self.writer, self.timer, self.bar, self.checkpointer, self.mark = writer, timer, bar, checkpointer, mark
        self.guard = guard
        self.pending: list[tuple[int, dict]] = []
        self.first_loss: float | None = first_loss   # the run's, when resumed
        self.last_loss: float | None = None

    def add(self, step: int, metrics: dict) -> None:
        self.queue(step, metrics)
        self.bar.update(1)
        self.timer.step(metrics)

    def queue(self, step: int, metrics: dict) -> None:
        """Keep a step's metrics (device or host values) for the next `flush`."""
        self.pending.append((step, metrics))

    def write(self, step: int, row: dict) -> None:
        self.writer.write(step, {**row, **self.mark})

    def check_eval(self, step: int, loss: float) -> None:
        """Give the guard a held-out loss; one out of range stops the run (`stop`)."""
        reason = self.guard.check_eval(step, loss)
        if reason:
            self.stop(reason, step, min(self.guard.last_good_eval_step, self.guard.good_checkpoint_step()),
                      guard_check=math.isfinite(loss))

    def flush(self, step: int) -> None:
        if not self.pending:
            return
        fetched = [(s, jax.device_get(m)) for s, m in self.pending]
        self.pending.clear()
        for s, m in fetched:
            if not math.isfinite(float(m["loss"])):
                # the loss at step s is that of the parameters after step s - 1
                self.stop(f"non-finite training loss {float(m['loss'])}", s,
                          min(self.guard.good_checkpoint_step(), s - 2))
        row = {name: float(np.mean([m[name] for _, m in fetched])) for name in ("loss", "mlm_accuracy", "grad_norm")}
        row["learning_rate"] = float(fetched[-1][1]["learning_rate"])
        self.write(step, {**row, **self.timer.read()})
        self.checkpointer.check()   # a save that failed since the last row stops the run here
        reason = self.guard.check_loss(step, row["loss"], [(s, float(m["loss"])) for s, m in fetched])
        if reason:
            self.stop(reason, step, self.guard.good_checkpoint_step(), guard_check=True)
        if self.guard.suspicious:
            log.warning("step %d: training loss %.4g is above %g x its recent median (%d of "
                        "train.divergence_patience=%d)", step, row["loss"], self.guard.factor, self.guard.strikes,
                        self.guard.patience)
        self.first_loss = self.first_loss if self.first_loss is not None else row["loss"]
        self.last_loss = row["loss"]
        self.bar.set_postfix(loss=f"{row['loss']:.3f}", acc=f"{row['mlm_accuracy']:.3f}")

    def stop(self, reason: str, step: int, good_step: int, *, guard_check: bool = False) -> None:
        """Stop the run for a diverged loss: checkpoints saved after `good_step` (the newest
        step whose loss was in range) are moved to diverged_checkpoints/, so the same
        command resumes from the last good one; raises TrainingDiverged, one line."""
        self.bar.close()
        self.checkpointer.wait()
        later = self.checkpointer.steps_after(good_step)
        aside = self.checkpointer.set_aside(later, "diverged_checkpoints") if later else None
        latest, best = self.checkpointer.latest_step(), self.checkpointer.best_step()
        if latest is None:
            where = "No checkpoint was saved before it; a new run starts from step 0"
        else:
            where = (f"The last good checkpoint is step {latest} in {self.checkpointer.directory}"
                     + (f" (later ones moved to {aside})" if aside else "")
                     + (f"; the lowest held-out loss is step {best}'s" if best not in (None, latest) else "")
                     + "; the same command resumes from it, e.g. with a lower train.learning_rate")
        off = " (train.divergence_factor=0 turns this check off)" if guard_check else ""
        raise TrainingDiverged(f"training diverged at step {step}: {reason}; stopping. {where}{off}")
