"""`train_and_evaluate(config, workdir)`: the MLM pretraining loop.

Owns the run: mesh, sharded state, data iterator, jitted steps, evaluation,
logging, checkpoints, resume, preemption (SIGTERM) and the non-finite-loss guard.
"""
from __future__ import annotations

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

from roformer.model import ModelConfig
from roformer.train import flops, sharding, steps, warm_start
from roformer.train.checkpoint import Checkpointer
from roformer.train.distributed import initialize_distributed
from roformer.train.metrics import MetricsWriter
from roformer.train.optim import make_optimizer
from roformer.train.state import TrainSetup
from roformer.workdir_lock import workdir_lock

log = logging.getLogger("roformer.train")


def build_model_config(model_section, *, vocab_size: int, dtype: str, pad_token_id: int = 0) -> ModelConfig:
    """ModelConfig from the `model` config section: the size preset, then every
    field that is set (None placeholders keep the preset's value). The vocabulary
    comes from the data's tokenizer, the compute dtype from `train.dtype`."""
    fields = {k: v for k, v in model_section.to_dict().items() if k != "size" and v is not None}
    return ModelConfig.from_preset(model_section.size, vocab_size=vocab_size, dtype=dtype,
                                   pad_token_id=pad_token_id, **fields)


# Model settings a resumed run may change: they select kernels, not parameters.
RESUMABLE_ACROSS = ("attention_impl",)


def check_same_model_config(saved: dict | None, current: dict, workdir: Path) -> None:
    """Refuse to resume a workdir whose checkpoints hold a different architecture.

    Fields added to ModelConfig after the checkpoint was written count as their
    defaults, and the attention kernel choice (same parameters, same math) may change."""
    if saved is None:
        return
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    saved, current = {**defaults, **saved}, {**defaults, **current}
    keys = sorted((set(saved) | set(current)) - set(RESUMABLE_ACROSS))
    diffs = [f"{k}: checkpoint={saved.get(k)!r} config={current.get(k)!r}"
             for k in keys if saved.get(k) != current.get(k)]
    if diffs:
        raise ValueError(f"{workdir} holds checkpoints of a different model config; refusing to resume. "
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


class _StopFlag:
    """Set by SIGTERM (preemption notice); the loop saves and exits cleanly."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        self.requested = True

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)

    def should_stop(self, step: int, every: int) -> bool:
        """Single process: as soon as signalled. Multi-process: every `every` steps
        all processes agree (any one signalled -> all stop at the same step)."""
        if jax.process_count() == 1:
            return self.requested
        if step % every:
            return False
        flags = multihost_utils.process_allgather(np.array([self.requested], np.int32))
        return bool(np.any(flags))


def parse_phases(train_cfg) -> list[tuple[int, int, int]]:
    """(end step, seq_len, batch_size) of every phase: `train.phases`, a comma list of
    'steps:seq_len:batch_size' (e.g. BERT's '900000:128:256,100000:512:256'), or one
    phase of train.steps / train.seq_len / train.batch_size."""
    text = str(train_cfg.get("phases", "") or "").strip()
    if not text:
        return [(int(train_cfg.steps), int(train_cfg.seq_len), int(train_cfg.batch_size))]
    phases, end = [], 0
    for item in text.split(","):
        parts = [p.strip() for p in item.split(":")]
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"train.phases={text!r}: expected comma-separated 'steps:seq_len:batch_size' "
                             "items of positive integers, e.g. '900:128:32,100:512:8'")
        steps, seq_len, batch_size = map(int, parts)
        end += steps
        phases.append((end, seq_len, batch_size))
    return phases


def _checkpointed_step(workdir: Path) -> int:
    directory = workdir / "checkpoints"
    steps = [int(p.name) for p in directory.iterdir() if p.name.isdigit()] if directory.is_dir() else []
    return max(steps, default=0)


def train_and_evaluate(config, workdir: str | Path) -> dict:
    """Pretrain (or resume) with `config` in `workdir`; returns a summary dict. A workdir
    another live run is using is refused (roformer.workdir_lock).

    With `train.phases` the phases run in order in the one workdir: each resumes the
    previous one's checkpoint (model, optimizer, step) with its own batch shape, and the
    learning-rate schedule spans the whole run (train.decay_steps, default: all steps)."""
    initialize_distributed(config.distributed)   # first: the lock is process 0's
    workdir = Path(workdir).resolve()
    with workdir_lock(workdir):
        if not str(config.train.get("phases", "") or "").strip():
            return _train_phase(config, workdir)
        phases = parse_phases(config.train)
        done = _checkpointed_step(workdir)
        summary: dict = {}
        for index, (end, seq_len, batch_size) in enumerate(phases):
            if done >= end and index < len(phases) - 1:
                continue   # finished earlier; the last phase still reports
            phase_cfg = ml_collections.ConfigDict(config.to_dict())
            phase_cfg.train.update(steps=end, seq_len=seq_len, batch_size=batch_size,
                                   decay_steps=config.train.decay_steps or phases[-1][0])
            log.info("phase %d of %d: up to step %d at seq_len %d, batch %d", index + 1, len(phases), end,
                     seq_len, batch_size)
            summary = _train_phase(phase_cfg, workdir)
            if summary.get("preempted"):
                break
        return summary


def _train_phase(config, workdir: Path) -> dict:
    from roformer.data import make_pretrain_data  # the input pipeline is heavy; import on use

    tc = config.train
    is_main = jax.process_index() == 0
    if tc.batch_size % jax.process_count():
        raise ValueError(f"train.batch_size={tc.batch_size} must divide over {jax.process_count()} processes")
    mesh = sharding.make_mesh(config.mesh)
    batch_shards = mesh.shape["data"] * mesh.shape["fsdp"]
    if tc.batch_size % (batch_shards * tc.grad_accum):
        raise ValueError(f"train.batch_size={tc.batch_size} must be divisible by mesh data*fsdp="
                         f"{batch_shards} times train.grad_accum={tc.grad_accum}")

    init_source = warm_start.find_init_checkpoint(tc.init_from, tc.init_step) if tc.init_from else None
    data_cfg = config.data
    if init_source is not None and not data_cfg.vocab:   # the tokenizer comes with the checkpoint
        data_cfg = ml_collections.ConfigDict({**data_cfg.to_dict(), "vocab": str(init_source.tokenizer_file),
                                              "lowercase": init_source.lowercase})
    data = make_pretrain_data(data_cfg, seq_len=tc.seq_len,
                              batch_size=tc.batch_size // jax.process_count(), seed=tc.seed,
                              process_index=jax.process_index(), process_count=jax.process_count())
    model_cfg = build_model_config(config.model, vocab_size=data.vocab_size, dtype=tc.dtype,
                                   pad_token_id=data.pad_id)
    checkpointer = Checkpointer(workdir / "checkpoints", max_to_keep=tc.keep_checkpoints,
                                async_save=tc.async_checkpoints)
    # A refused resume or a failed restore must not leave orbax's workers running
    # (_run closes it on its own exit; close() is idempotent).
    try:
        check_same_model_config(checkpointer.saved_model_config(), model_cfg.to_dict(), workdir)
        finished = finished_summary(workdir, checkpointer.latest_step(), tc.steps)
        if finished is not None:
            log.info("%s: already complete at step %d (train.steps=%d); nothing to do",
                     workdir, finished["final_step"], tc.steps)
            checkpointer.close()
            return finished
        if is_main:
            workdir.mkdir(parents=True, exist_ok=True)
            (workdir / "config.json").write_text(json.dumps(
                {**config.to_dict(), "resolved_model": model_cfg.to_dict()}, indent=2, default=str))
            data.tokenizer.save(workdir)   # tokenizer.json + vocab.txt: fine-tuning reads them from here

        # measured outside the mesh context: a CPU peak is timed on one local device
        peak_flops = flops.device_peak_flops(jax.devices()[0], tc.dtype, tc.peak_flops_per_device)

        # --- state: restore the newest readable checkpoint, else initialise ----------
        tx, schedule = make_optimizer(tc)
        setup = TrainSetup(model_cfg, tx, schedule, mesh, seed=tc.seed,
                           dropout_rng_impl=tc.dropout_rng_impl)
        with jax.set_mesh(mesh):
            rest = setup.init_rest()   # RNG streams only; dropout keys are re-derived every step
            restored = checkpointer.restore_latest(setup.sharded_abstract_state())
            if restored is None:
                state, start_step, data_state = setup.init_state(), 0, None
                if init_source is not None:
                    params = warm_start.load_init_params(init_source, model_cfg, setup.abstract_state["params"],
                                                         data.tokenizer.hash, grow_positions=tc.init_grow_positions)
                    state["params"] = jax.device_put(params, setup.state_shardings["params"])
            else:
                start_step, state, data_state = restored
                log.info("resumed from %s at step %d", checkpointer.directory, start_step)

            train_iter = data.train_iterator()
            if data_state is not None and train_iter.resume(data_state):
                log.info("step %d: phase %d begins with seq_len %d, batch %d", start_step, train_iter.phase,
                         tc.seq_len, tc.batch_size)
            eval_sets = {"": data.eval_batches(tc.eval_batches)}
            if tc.eval_shuffled:
                eval_sets["shuffled"] = data.eval_batches(tc.eval_batches, shuffled=True)
            eval_batches = {name: [sharding.global_batch(b, mesh) for b in batches]
                            for name, batches in eval_sets.items()}

            train_step = setup.jit_train_step(grad_accum=tc.grad_accum, debug_nan_step=tc.debug_nan_step)
            eval_step = setup.jit_eval_step()
            return _run(config, workdir, mesh, model_cfg, data, checkpointer, state, rest, start_step,
                        train_iter, eval_batches, train_step, eval_step, peak_flops)
    except BaseException:
        checkpointer.close()
        raise


def _run(config, workdir, mesh, model_cfg, data, checkpointer, state, rest, start_step,
         train_iter, eval_batches, train_step, eval_step, peak) -> dict:
    tc = config.train
    is_main = jax.process_index() == 0
    writer = MetricsWriter(workdir, resume_step=start_step)
    step_flops = 0.0   # set from the first batch (its number of prediction slots)
    tokens_per_step = tc.batch_size * tc.seq_len
    stop = _StopFlag()
    stop.install()
    phase_mark = {"phase": train_iter.phase, "seq_len": tc.seq_len}   # on every metrics row
    bar = tqdm(total=tc.steps, initial=start_step, disable=not (is_main and tc.progress_bar),
               desc="pretrain", unit="step", dynamic_ncols=True)

    def evaluate(step: int) -> dict:
        row = {}
        for name, batches in eval_batches.items():
            totals = {"loss_sum": 0.0, "correct_sum": 0.0, "weight_sum": 0.0}
            for batch in batches:
                sums = jax.device_get(eval_step(state["params"], rest, batch))
                totals = {k: totals[k] + float(sums[k]) for k in totals}
            row.update(steps.summarize_eval(totals, prefix=f"eval_{name}_" if name else "eval_"))
        if "eval_shuffled_loss" in row:   # how much the model uses word order (0: not at all)
            row["eval_order_gap"] = row["eval_shuffled_loss"] - row["eval_loss"]
        writer.write(step, {**row, **phase_mark})
        return row

    def save(step: int) -> None:
        checkpointer.save(step, state, train_iter.get_state(), model_cfg.to_dict())

    pending: list[tuple[int, dict]] = []   # device metrics not yet checked/logged
    history = {"first_loss": None, "last_loss": None, "tokens_per_sec": [], "mfu": []}
    last_eval: dict = {}
    interval_start, interval_steps, paused = None, 0, 0.0   # throughput timer; paused = eval/save time
    preempted = False
    wall_start = time.perf_counter()

    def flush(step: int) -> None:
        """Fetch pending metrics, stop on a non-finite loss, log the interval mean."""
        nonlocal interval_start, interval_steps, paused
        if not pending:
            return
        fetched = [(s, jax.device_get(m)) for s, m in pending]
        pending.clear()
        for s, m in fetched:
            if not math.isfinite(float(m["loss"])):
                checkpointer.wait()
                raise FloatingPointError(
                    f"non-finite training loss {float(m['loss'])} at step {s}; stopping. The last good "
                    f"checkpoint is step {checkpointer.latest_step()} in {checkpointer.directory}")
        row = {name: float(np.mean([m[name] for _, m in fetched]))
               for name in ("loss", "mlm_accuracy", "grad_norm")}
        row["learning_rate"] = float(fetched[-1][1]["learning_rate"])
        if interval_start is not None and interval_steps > 0:
            elapsed = time.perf_counter() - interval_start - paused
            row["tokens_per_sec"] = interval_steps * tokens_per_step / elapsed
            row["mfu"] = flops.mfu(step_flops, interval_steps / elapsed, peak, jax.device_count())
            history["tokens_per_sec"].append(row["tokens_per_sec"])
            history["mfu"].append(row["mfu"])
        writer.write(step, {**row, **phase_mark})
        history["first_loss"] = history["first_loss"] if history["first_loss"] is not None else row["loss"]
        history["last_loss"] = row["loss"]
        bar.set_postfix(loss=f"{row['loss']:.3f}", acc=f"{row['mlm_accuracy']:.3f}")
        interval_start, interval_steps, paused = time.perf_counter(), 0, 0.0

    try:
        step = start_step
        if step == 0 and tc.init_from:   # the warm start's own held-out loss, before any update
            last_eval = evaluate(step)
        while step < tc.steps:
            batch = sharding.global_batch(next(train_iter), mesh)
            if not step_flops:
                step_flops = flops.train_flops_per_step(
                    model_cfg, batch_size=tc.batch_size, seq_len=tc.seq_len,
                    num_predictions=batch["masked_positions"].shape[1])
            state, metrics = train_step(state, rest, batch)
            step += 1
            pending.append((step, metrics))
            bar.update(1)
            if interval_start is None:       # time from the end of the compiling first step
                jax.block_until_ready(metrics)
                interval_start, interval_steps = time.perf_counter(), 0
            else:
                interval_steps += 1
            checkpoint_due = step % tc.checkpoint_every == 0 or step == tc.steps
            preempted = stop.should_stop(step, tc.log_every)
            if step % tc.log_every == 0 or checkpoint_due or preempted:
                flush(step)
            if preempted:
                save(step)
                log.warning("SIGTERM received: saved a checkpoint at step %d; exiting", step)
                break
            pause_start = time.perf_counter()
            if step % tc.eval_every == 0 or step == tc.steps:
                last_eval = evaluate(step)
            if checkpoint_due:
                save(step)
            paused += time.perf_counter() - pause_start
        if not preempted and step == start_step:   # nothing left to train: report eval only
            last_eval = evaluate(step)
    finally:
        bar.close()
        stop.restore()
        checkpointer.close()
        writer.close()

    summary = {
        "workdir": str(workdir), "final_step": int(step), "start_step": int(start_step),
        "preempted": preempted, "first_loss": history["first_loss"], "final_loss": history["last_loss"],
        **last_eval,
        "tokens_per_sec": float(np.median(history["tokens_per_sec"])) if history["tokens_per_sec"] else None,
        "mfu": float(np.median(history["mfu"])) if history["mfu"] else None,
        "wall_time_s": time.perf_counter() - wall_start,
        "num_devices": jax.device_count(), "num_processes": jax.process_count(),
        "data": data.manifest,
    }
    if is_main:
        (workdir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        print("summary: " + json.dumps({k: v for k, v in summary.items() if k != "data"}, default=str),
              flush=True)
    return summary
