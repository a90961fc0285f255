"""`train_and_evaluate(config, workdir)`: the MLM pretraining loop.

Owns the run: mesh, sharded state, data iterator, jitted steps, evaluation,
logging, checkpoints, resume, preemption (SIGTERM) and the divergence guard (a
non-finite loss, or a finite one far above its recent level: roformer.train.guard).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
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
from tqdm.auto import tqdm

from roformer.checkpoint_source import may_differ
from roformer.data import DataConfig, make_pretrain_data
from roformer.distributed import allgather_json, initialize_distributed
from roformer.errors import ConfigError
from roformer.files import write_json_atomic
from roformer.model import attention_stats
from roformer.model import ModelConfig
from roformer.train import flops, sharding, steps, warm_start
from roformer.train.checkpoint import Checkpointer
from roformer.train.config import OPTIMIZER_KEYS, TrainConfig, parse_phases, phase_schedule_factors
from roformer.train.guard import DivergenceGuard, TrainingDiverged
from roformer.train.metrics import MetricsWriter, ThroughputTimer, read_metrics
from roformer.train.optim import make_optimizer
from roformer.train.state import TrainSetup
from roformer.workdir import CHECKPOINTS, PretrainWorkdir
from roformer.workdir_lock import workdir_lock

log = logging.getLogger("roformer.train")


def build_model_config(model_section, *, vocab_size: int, pad_token_id: int = 0) -> ModelConfig:
    """ModelConfig from the `model` config section: the size preset, then every
    field that is set (None placeholders keep the preset's value). The vocabulary
    and padding id come from the data's tokenizer."""
    fields = {k: v for k, v in model_section.to_dict().items() if k != "size" and v is not None}
    return ModelConfig.from_preset(model_section.size, vocab_size=vocab_size, pad_token_id=pad_token_id,
                                   **fields)


# Model settings a resumed run may change (why: roformer.checkpoint_source.MAY_DIFFER).
RESUMABLE_ACROSS = may_differ("resume")


def check_same_model_config(saved: dict | None, current: dict, workdir: Path) -> None:
    """Refuse to resume a workdir whose checkpoints hold a different architecture.

    Fields added to ModelConfig after the checkpoint was written count as their
    defaults, and the attention kernel choice (same parameters, same math) may change."""
    if saved is None:
        return
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    saved, current = {**defaults, **ModelConfig.saved_fields(saved)}, {**defaults, **current}
    keys = sorted((set(saved) | set(current)) - set(RESUMABLE_ACROSS))
    diffs = [f"{k}: checkpoint={saved.get(k)!r} config={current.get(k)!r}"
             for k in keys if saved.get(k) != current.get(k)]
    if diffs:
        raise ConfigError(f"{workdir} holds checkpoints of a different model config; refusing to resume. "
                          "Differing keys:\n  " + "\n  ".join(diffs) +
                          "\nUse a new --workdir or restore the original model settings.")


def finished_summary(workdir: Path, latest_step: int | None, steps: int) -> dict | None:
    """The summary of a run that already reached `steps`: its newest checkpoint is at or
    past them and summary.json says it ended there, not preempted. A re-run returns it
    and leaves the workdir untouched; a larger train.steps resumes instead."""
    path = workdir / "summary.json"
    if latest_step is None or latest_step < steps or not path.is_file():
        return None
    summary = json.loads(path.read_text())
    if summary.get("final_step") != latest_step or summary.get("preempted"):
        return None   # stopped at its last step without the final eval and summary: finish them
    return summary


class StopFlag:
    """Set by SIGTERM (preemption notice) while the `with` block runs; the loop then saves
    and exits cleanly. The previous handler comes back on exit."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def __enter__(self) -> "StopFlag":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)

    def _handle(self, signum, frame) -> None:
        self.requested = True

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
            phase_cfg = ml_collections.ConfigDict(config.to_dict())
            phase_cfg.train.update(steps=phase.end, seq_len=phase.seq_len, batch_size=phase.batch_size,
                                   decay_steps=config.train.decay_steps or phases[-1].end)
            if phase.max_predictions:
                phase_cfg.data.max_predictions_per_seq = phase.max_predictions
            log.info("phase %d of %d: up to step %d at seq_len %d, batch %d", index + 1, len(phases), phase.end,
                     phase.seq_len, phase.batch_size)
            summary = _train_phase(phase_cfg, workdir)
            if summary.get("preempted"):
                break
        return summary


def _train_phase(config, workdir: Path) -> dict:
    """One phase (or a whole run without phases): setup, the step loop, the summary."""
    tc = TrainConfig.from_section(config.train)
    mesh = _make_mesh(config.mesh, tc)
    init_source = warm_start.find_init_checkpoint(tc.init_from, tc.init_step) if tc.init_from else None
    data = _make_data(config.data, tc, init_source)
    if init_source is None:
        model_cfg = build_model_config(config.model, vocab_size=data.vocab_size, pad_token_id=data.pad_id)
    else:   # the checkpoint's architecture; checked before anything is written, so a refusal leaves no files
        model_cfg = warm_start.resolve_model_config(config.model, init_source, vocab_size=data.vocab_size,
                                                    pad_token_id=data.pad_id, tokenizer_hash=data.tokenizer.hash)
    init_params = None
    if init_source is not None and not PretrainWorkdir.holds_run(workdir):   # a fresh start will use them
        init_params = warm_start.load_init_params(init_source, model_cfg, warm_start.abstract_params(model_cfg),
                                                  data.tokenizer.hash, grow_positions=tc.init_grow_positions)
    is_main = jax.process_index() == 0

    with contextlib.ExitStack() as cleanup:   # closes the progress bar, signal handler, logs, checkpoints
        checkpointer, finished = open_run(cleanup, config, workdir, tc, model_cfg, data.tokenizer, is_main=is_main)
        if finished is not None:
            return finished
        # measured outside the mesh context: a CPU peak is timed on one local device
        peak_flops = flops.device_peak_flops(jax.devices()[0], model_cfg.dtype, tc.peak_flops_per_device)
        setup = TrainSetup(model_cfg, *_optimizer(tc), mesh, seed=tc.seed,
                           dropout_rng_impl=tc.dropout_rng_impl)
        cleanup.enter_context(jax.set_mesh(mesh))
        rest = setup.init_rest()   # RNG streams only; dropout keys are re-derived every step
        state, start_step, train_iter = _restore_or_init(setup, checkpointer, data, init_source, tc, init_params)
        del init_params   # on the device now
        eval_batches = _eval_batches(data, tc, mesh)
        train_step = setup.jit_train_step(grad_accum=tc.grad_accum, debug_nan_step=tc.debug_nan_step)
        eval_step = setup.jit_eval_step()
        # Linear attention forms no probabilities to measure.
        stats_step = (setup.jit_attention_stats_step() if tc.eval_attention_stats and model_cfg.attention == "softmax"
                      else None)
        writer = cleanup.enter_context(contextlib.closing(MetricsWriter(workdir, resume_step=start_step)))
        stop = cleanup.enter_context(StopFlag())
        bar = cleanup.enter_context(tqdm(total=tc.steps, initial=start_step, desc="pretrain", unit="step",
                                         disable=not (is_main and tc.progress_bar), dynamic_ncols=True))
        step_flops = flops.train_flops_per_step(model_cfg, batch_size=tc.batch_size, seq_len=tc.seq_len,
                                                num_predictions=data.masker.max_predictions)
        timer = ThroughputTimer(tokens_per_step=tc.batch_size * tc.seq_len, flops_per_step=step_flops,
                                peak_flops=peak_flops, num_devices=jax.device_count())
        logged = _logged_history(workdir, start_step, tc.divergence_window) if is_main else None
        logged = logged if jax.process_count() == 1 else allgather_json(logged)[0]   # one guard everywhere
        guard = resumed_guard(tc, logged, start_step)
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
                              optimizer=_optimizer_settings(tc))

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
                log.warning("SIGTERM received: saved a checkpoint at step %d; exiting", step)
                break
            with timer.paused():
                if step % tc.eval_every == 0 or step == tc.steps:
                    last_eval = evaluate(step)
                if checkpoint_due and guard.suspicious and step < tc.steps:
                    log.warning("step %d: checkpoint postponed while the training loss is out of range", step)
                elif checkpoint_due:
                    save(step)
        if not preempted and step == start_step:   # nothing left to train: report eval only
            last_eval = evaluate(step)

    summary = {   # first_loss: the run's, also after a resume (read back from metrics.jsonl)
        "workdir": str(workdir), "final_step": int(step), "start_step": int(start_step),
        "preempted": preempted, "first_loss": train_log.first_loss, "final_loss": train_log.last_loss,
        **last_eval, **timer.medians(), "wall_time_s": time.perf_counter() - wall_start,
        "num_devices": jax.device_count(), "num_processes": jax.process_count(), "data": data.manifest,
    }
    if is_main:
        _write_summary(workdir, summary)
    return summary


def open_run(cleanup: contextlib.ExitStack, config, workdir: Path, tc: TrainConfig, model_cfg: ModelConfig,
             tokenizer, *, is_main: bool = True) -> tuple[Checkpointer, dict | None]:
    """The run's Checkpointer (closed by `cleanup`), after refusing a workdir of another
    architecture, and the summary of a run already finished (None otherwise; then the run's
    files are written and a changed optimizer setting is said)."""
    checkpointer = cleanup.enter_context(contextlib.closing(Checkpointer(
        workdir / CHECKPOINTS, max_to_keep=tc.keep_checkpoints, async_save=tc.async_checkpoints)))
    check_same_model_config(checkpointer.saved_model_config(), model_cfg.to_dict(), workdir)
    finished = finished_summary(workdir, checkpointer.latest_step(), tc.steps)
    if finished is not None:
        log.info("%s: already complete at step %d (train.steps=%d); nothing to do",
                 workdir, finished["final_step"], tc.steps)
        return checkpointer, finished
    if is_main:
        if checkpointer.latest_step() is not None:
            _say_changed_optimizer(checkpointer, workdir, tc, checkpointer.latest_step())
        _write_run_files(workdir, config, model_cfg, tokenizer)
    return checkpointer, None


def _write_run_files(workdir: Path, config, model_cfg: ModelConfig, tokenizer) -> None:
    """config.json (the config as run, plus the resolved ModelConfig) and the tokenizer
    (tokenizer.json + vocab.txt: fine-tuning and warm starts read it from here)."""
    workdir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(workdir / "config.json", {**config.to_dict(), "resolved_model": model_cfg.to_dict()},
                      indent=2, default=str)
    tokenizer.save(workdir)


def _optimizer_settings(tc: TrainConfig) -> dict:
    """The optimizer settings a checkpoint's state was trained with (saved with it)."""
    return {**{key: getattr(tc, key) for key in OPTIMIZER_KEYS}, "schedule_steps": tc.schedule_steps}


def _say_changed_optimizer(checkpointer: Checkpointer, workdir: Path, tc: TrainConfig, step: int) -> None:
    """One warning line when a resume changes an optimizer or schedule setting the
    checkpoint was trained with (saved with it; for older checkpoints, config.json of the
    last attempt); a phase declares its own learning rate and warmup (train.phases),
    which this does not report."""
    before = checkpointer.saved_optimizer(step)
    if before is None:
        before = PretrainWorkdir(workdir).run_config().get("train") or {}
        if "steps" in before:
            before["schedule_steps"] = before.get("decay_steps") or before["steps"]
    now = _optimizer_settings(tc)
    changes = [f"train.{key} {before[key]!r} -> {now[key]!r}" for key in OPTIMIZER_KEYS
               if key in before and before[key] != now[key]]
    if before.get("schedule_steps", now["schedule_steps"]) != now["schedule_steps"]:
        changes.append(f"learning-rate schedule length {before['schedule_steps']} -> {now['schedule_steps']} "
                       "steps (train.decay_steps keeps it)")
    if changes:
        log.warning("resuming from step %d with changed optimizer settings: %s", step, "; ".join(changes))


def resumed_guard(tc: TrainConfig, logged: dict, start_step: int) -> DivergenceGuard:
    """The divergence guard of a run (re)starting at `start_step`, with what metrics.jsonl
    logged before it (`_logged_history`)."""
    return DivergenceGuard(tc.divergence_factor, tc.divergence_patience, tc.divergence_window,
                           after_step=tc.warmup_steps, history=logged["losses"], best_eval=logged["best_eval"],
                           last_good_step=start_step, last_good_eval_step=start_step, resumed_step=start_step)


def _logged_history(workdir: Path, start_step: int, window: int) -> dict:
    """What metrics.jsonl says about the run before `start_step`: its last `window` training
    losses and best held-out loss (the divergence guard's reference) and its first loss."""
    rows = [r for r in read_metrics(workdir) if r.get("step", 0) <= start_step]
    losses = [float(r["loss"]) for r in rows if isinstance(r.get("loss"), (int, float))]
    evals = [float(r["eval_loss"]) for r in rows if isinstance(r.get("eval_loss"), (int, float))]
    finite = [x for x in losses if math.isfinite(x)]
    return {"losses": finite[-window:], "first_loss": losses[0] if losses else None,
            "best_eval": min((x for x in evals if math.isfinite(x)), default=None)}


def _write_summary(workdir: Path, summary: dict) -> None:
    write_json_atomic(workdir / "summary.json", summary, indent=2, default=str)
    print("summary: " + json.dumps({k: v for k, v in summary.items() if k != "data"}, default=str), flush=True)


def _optimizer(tc: TrainConfig):
    """(transform, schedule) of the run: one schedule over all phases, scaled where a phase
    sets its own learning rate or warmup."""
    return make_optimizer(
        learning_rate=tc.learning_rate, warmup_steps=tc.warmup_steps, total_steps=tc.schedule_steps,
        decay=tc.decay, weight_decay=tc.weight_decay, b1=tc.b1, b2=tc.b2, eps=tc.eps, clip_norm=tc.clip_norm,
        phases=phase_schedule_factors(parse_phases(tc), tc.learning_rate))


def _make_mesh(mesh_cfg, tc: TrainConfig):
    if tc.batch_size % jax.process_count():
        raise ConfigError(f"train.batch_size={tc.batch_size} must divide over {jax.process_count()} processes")
    mesh = sharding.make_mesh(mesh_cfg)
    batch_shards = mesh.shape["data"] * mesh.shape["fsdp"]
    if tc.batch_size % (batch_shards * tc.grad_accum):
        raise ConfigError(f"train.batch_size={tc.batch_size} must be divisible by mesh data*fsdp="
                          f"{batch_shards} times train.grad_accum={tc.grad_accum}")
    return mesh


def _make_data(data_cfg, tc: TrainConfig, init_source):
    data_cfg = DataConfig.from_mapping(data_cfg)
    if init_source is not None:   # the tokenizer comes with the checkpoint
        data_cfg = init_source.with_tokenizer(data_cfg)
    return make_pretrain_data(data_cfg, seq_len=tc.seq_len, batch_size=tc.batch_size // jax.process_count(),
                              seed=tc.seed, process_index=jax.process_index(), process_count=jax.process_count())


def _restore_or_init(setup: TrainSetup, checkpointer: Checkpointer, data, init_source, tc: TrainConfig,
                     init_params: dict | None = None):
    """(state, start step, train iterator) from the newest readable checkpoint, else a fresh
    state (with a warm start's parameters, `init_params` when already loaded) at step 0."""
    restored = checkpointer.restore_latest(setup.sharded_abstract_state())
    if restored is None:
        state, start_step, data_state = setup.init_state(), 0, None
        if init_source is not None:
            params = init_params if init_params is not None else warm_start.load_init_params(
                init_source, setup.model_cfg, setup.abstract_state["params"], data.tokenizer.hash,
                grow_positions=tc.init_grow_positions)
            state["params"] = jax.device_put(params, setup.state_shardings["params"])
    else:
        start_step, state, data_state = restored
        log.info("resumed from %s at step %d", checkpointer.directory, start_step)
    train_iter = data.train_iterator()
    if data_state is not None and train_iter.resume(data_state):
        log.info("step %d: phase %d begins with seq_len %d, batch %d", start_step, train_iter.phase,
                 tc.seq_len, tc.batch_size)
    return state, start_step, train_iter


def _eval_batches(data, tc: TrainConfig, mesh) -> dict[str, list]:
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
