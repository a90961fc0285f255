"""A pretraining run's bookkeeping, the same under both drivers (one run: roformer.train.loop;
vmapped seeds: roformer.train.seeds): open the run in its workdir (refuse another
architecture, return a finished run's summary), the run's data and optimizer,
restore-or-init of its state, the run's files (config.json and the tokenizer, written only
once every check that can refuse the run has passed), what metrics.jsonl logged before a
resume, and the summary it ends with.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import time
from pathlib import Path

import jax

from roformer import workdir_kind
from roformer.checkpoint_source import may_differ
from roformer.data import DataConfig, make_pretrain_data
from roformer.distributed import allgather_json
from roformer.errors import ConfigError
from roformer.files import write_json_atomic
from roformer.model import ModelConfig
from roformer.train import progress, warm_start
from roformer.train.checkpoint import Checkpointer
from roformer.train.config import OPTIMIZER_KEYS, TrainConfig, parse_phases, phase_schedule_factors
from roformer.train.guard import DivergenceGuard
from roformer.train.metrics import check_metrics_file, read_metrics
from roformer.train.optim import make_optimizer
from roformer.train.state import TrainSetup
from roformer.workdir import CHECKPOINTS, PretrainWorkdir

log = logging.getLogger("roformer.train")

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


def open_run(cleanup: contextlib.ExitStack, workdir: Path, tc: TrainConfig, model_cfg: ModelConfig, *,
             is_main: bool = True) -> tuple[Checkpointer, dict | None]:
    """The run's Checkpointer (closed by `cleanup`), after refusing a workdir of another
    architecture, and the summary of a run already finished (None otherwise; then a changed
    optimizer setting is said). Writes nothing: the run's files wait for `write_run_files`,
    after the restore has checked the corpus too."""
    check_metrics_file(workdir)
    checkpointer = cleanup.enter_context(contextlib.closing(Checkpointer(
        workdir / CHECKPOINTS, max_to_keep=tc.keep_checkpoints, async_save=tc.async_checkpoints)))
    check_same_model_config(checkpointer.saved_model_config(), model_cfg.to_dict(), workdir)
    finished = finished_summary(workdir, checkpointer.latest_step(), tc.steps)
    if finished is not None:
        log.info("%s: already complete at step %d (train.steps=%d); nothing to do",
                 workdir, finished["final_step"], tc.steps)
        return checkpointer, finished
    if is_main and checkpointer.latest_step() is not None:
        _say_changed_optimizer(checkpointer, workdir, tc, checkpointer.latest_step())
    return checkpointer, None


def write_run_files(workdir: Path, config, model_cfg: ModelConfig, tokenizer) -> None:
    """config.json (the config as run, plus the resolved ModelConfig) and the tokenizer
    (tokenizer.json + vocab.txt: fine-tuning and warm starts read it from here). Called once
    the run can no longer be refused, so a refused run leaves the files of the checkpoints
    beside them."""
    workdir.mkdir(parents=True, exist_ok=True)
    workdir_kind.record(workdir, workdir_kind.PRETRAINING)
    write_json_atomic(workdir / "config.json", {**config.to_dict(), "resolved_model": model_cfg.to_dict()},
                      indent=2, default=str)
    tokenizer.save(workdir)


def optimizer_settings(tc: TrainConfig) -> dict:
    """The optimizer settings a checkpoint's state was trained with (saved with it)."""
    return {**{key: getattr(tc, key) for key in OPTIMIZER_KEYS}, "schedule_steps": tc.schedule_steps}


def save_checkpoint(checkpointer: Checkpointer, step: int, state: dict, train_iter, model_cfg: ModelConfig,
                    tc: TrainConfig, eval_loss: float | None = None) -> None:
    """Save a run's checkpoint at `step`: its state, its data position, its model and optimizer
    settings, and the held-out loss evaluated at that step (which keeps the best one)."""
    checkpointer.save(step, state, train_iter.get_state(), model_cfg.to_dict(),
                      metrics=None if eval_loss is None else {"eval_loss": eval_loss},
                      optimizer=optimizer_settings(tc))


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
    now = optimizer_settings(tc)
    changes = [f"train.{key} {before[key]!r} -> {now[key]!r}" for key in OPTIMIZER_KEYS
               if key in before and before[key] != now[key]]
    if before.get("schedule_steps", now["schedule_steps"]) != now["schedule_steps"]:
        changes.append(f"learning-rate schedule length {before['schedule_steps']} -> {now['schedule_steps']} "
                       "steps (train.decay_steps keeps it)")
    if changes:
        log.warning("resuming from step %d with changed optimizer settings: %s", step, "; ".join(changes))


def run_optimizer(tc: TrainConfig):
    """(transform, schedule) of the run: one schedule over all phases, scaled where a phase
    sets its own learning rate or warmup."""
    return make_optimizer(
        learning_rate=tc.learning_rate, warmup_steps=tc.warmup_steps, total_steps=tc.schedule_steps,
        decay=tc.decay, weight_decay=tc.weight_decay, b1=tc.b1, b2=tc.b2, eps=tc.eps, clip_norm=tc.clip_norm,
        phases=phase_schedule_factors(parse_phases(tc), tc.learning_rate))


# The data settings that made the run's trained tokenizer: a resume keeps that tokenizer (the
# workdir's copy), so a new value would change nothing but what config.json says.
TOKENIZER_KEYS = ("vocab_size", "lowercase")


def check_same_tokenizer_settings(data_cfg: DataConfig, run: PretrainWorkdir) -> None:
    """Refuse, in one line, a resume that changes a setting of the tokenizer the run trained
    (TOKENIZER_KEYS), by the run's config.json."""
    section = run.run_config().get("data")
    if not isinstance(section, dict):   # no config.json to compare with (it is written at start-up)
        return
    saved = {**dataclasses.asdict(DataConfig()), **section}
    changed = [f"data.{key}={getattr(data_cfg, key)!r} (the run's is {saved[key]!r})" for key in TOKENIZER_KEYS
               if saved[key] != getattr(data_cfg, key)]
    if changed:
        raise ConfigError(f"{run.path} resumes with the tokenizer it trained, which {' and '.join(changed)} would not "
                          "change: drop the override, or train another tokenizer in a new --workdir")


def run_data(data_cfg, tc: TrainConfig, init_source=None, workdir: Path | None = None):
    """The run's data (this process's share of each batch), with the tokenizer of the
    checkpoint a warm start comes from (`init_source`), or of the run in `workdir` when it
    holds one (a resume, or evaluating its checkpoints) and data.vocab is empty: a tokenizer
    trained again would differ (training is not deterministic), and a new cache entry is
    trained whenever the corpus files are copied or touched. Every process must hold the
    same tokenizer; one line refuses the run when they do not."""
    data_cfg = DataConfig.from_mapping(data_cfg)
    if init_source is not None:   # the tokenizer comes with the checkpoint
        data_cfg = init_source.with_tokenizer(data_cfg)
    elif workdir is not None and not data_cfg.vocab and PretrainWorkdir.holds_run(workdir) \
            and PretrainWorkdir(workdir).tokenizer_file.is_file():
        check_same_tokenizer_settings(data_cfg, PretrainWorkdir(workdir))
        data_cfg = dataclasses.replace(data_cfg, vocab=str(PretrainWorkdir(workdir).tokenizer_file))
    data = make_pretrain_data(data_cfg, seq_len=tc.seq_len, batch_size=tc.batch_size // jax.process_count(),
                              seed=tc.seed, process_index=jax.process_index(), process_count=jax.process_count())
    if jax.process_count() > 1:
        hashes = allgather_json(data.tokenizer.hash)
        if len(set(hashes)) > 1:
            raise ConfigError(f"the {len(hashes)} processes hold {len(set(hashes))} different tokenizers (each trained "
                              "its own in a cache of its own, and training is not deterministic): give every process "
                              "the same data.vocab (a vocab.txt or tokenizer.json), or a data.cache_dir they share")
    return data


def restore_or_init(setup: TrainSetup, checkpointer: Checkpointer, data, tc: TrainConfig, *, init_source=None,
                    init_params: dict | None = None):
    """(state, start step, train iterator) from the newest readable checkpoint, else a fresh
    state of seed `tc.seed` (with a warm start's parameters, `init_params` when already
    loaded) at step 0."""
    restored = checkpointer.restore_latest(setup.sharded_abstract_state())
    if restored is None:
        log.info("initialising the model ...")
        start = time.perf_counter()
        state, start_step, data_state = setup.init_state(seed=tc.seed), 0, None
        log.info("initialised the model in %.1fs", time.perf_counter() - start)
        if init_source is not None:
            params = init_params if init_params is not None else warm_start.load_init_params(
                init_source, setup.model_cfg, setup.abstract_state["params"], data.tokenizer.hash,
                grow_positions=tc.init_grow_positions)
            state["params"] = jax.device_put(params, setup.state_shardings["params"])
    else:
        start_step, state, data_state = restored
        log.info("resumed from %s at step %d", checkpointer.directory, start_step)
        if data_state is None:   # saved without it, or its item damaged (a step without checksums)
            log.warning("the checkpoint at step %d holds no data-iterator state for process %d: the data order "
                        "starts again at the corpus's first row, so the batches of steps 1-%d come again",
                        start_step, jax.process_index(), start_step)
    train_iter = data.train_iterator()
    if data_state is not None and train_iter.resume(data_state):
        log.info("step %d: phase %d begins with seq_len %d, batch %d", start_step, train_iter.phase,
                 tc.seq_len, tc.batch_size)
    return state, start_step, train_iter


def logged_history(workdir: Path, start_step: int, window: int) -> dict:
    """What metrics.jsonl says about the run before `start_step`: its last `window` training
    losses and best held-out loss (the divergence guard's reference) and its first loss."""
    rows = [r for r in read_metrics(workdir) if r.get("step", 0) <= start_step]
    losses = [(int(r["step"]), float(r["loss"])) for r in rows if isinstance(r.get("loss"), (int, float))]
    evals = [float(r["eval_loss"]) for r in rows if isinstance(r.get("eval_loss"), (int, float))]
    return {"losses": [[step, x] for step, x in losses if math.isfinite(x)],
            "first_loss": losses[0][1] if losses else None,
            "best_eval": min((x for x in evals if math.isfinite(x)), default=None)}


def resumed_guard(tc: TrainConfig, logged: dict, start_step: int) -> DivergenceGuard:
    """The divergence guard of a run (re)starting at `start_step`, with what metrics.jsonl
    logged before it (`logged_history`) replayed through it: its reference is the logged losses
    it judged in range, and a streak of out-of-range rows the run stopped in counts on."""
    guard = DivergenceGuard(tc.divergence_factor, tc.divergence_patience, tc.divergence_window,
                            after_step=tc.warmup_steps, best_eval=logged["best_eval"])
    for step, loss in logged["losses"]:
        guard.check_loss(step, loss)
    guard.last_good_step = guard.last_good_eval_step = guard.resumed_step = start_step
    return guard


def run_summary(workdir: Path, *, final_step: int, start_step: int, preempted: bool, train_log, last_eval: dict,
                wall_time_s: float, num_devices: int, num_processes: int, data, **extra) -> dict:
    """The summary a run ends with (summary.json): its steps, first loss (the run's, also
    after a resume: read back from metrics.jsonl) and last one, last evaluation, throughput
    medians, time, devices and data manifest."""
    return {
        "workdir": str(workdir), "final_step": int(final_step), "start_step": int(start_step),
        "preempted": preempted, "first_loss": train_log.first_loss, "final_loss": train_log.last_loss,
        **last_eval, **train_log.timer.medians(), "wall_time_s": wall_time_s,
        "num_devices": num_devices, "num_processes": num_processes, **extra, "data": data.manifest,
    }


def write_summary(workdir: Path, summary: dict) -> None:
    """summary.json, and one short line of it on stdout (progress.summary_line)."""
    write_json_atomic(workdir / "summary.json", summary, indent=2, default=str)
    print(progress.summary_line(summary), flush=True)
