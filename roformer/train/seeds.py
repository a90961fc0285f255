"""`train_seeds_and_evaluate(configs, workdirs)`: several seeds of one pretraining config,
trained together in one vmapped step on one device.

A small model leaves an accelerator mostly idle, and the research loop is many small runs:
stacked on a leading axis, K seeds train in one program (docs/performance.md has what that
gains, and where it loses: XLA:CPU). Each seed stays an ordinary run: its own workdir,
initialisation, data order and masking, dropout keys, metrics.jsonl, checkpoints, divergence
guard and summary.json, as `train_and_evaluate` writes them, so every reader of a workdir
(resume, GLUE, extrapolation, the ablation report) takes it as it is. One exception: a group
whose members train at rates of their own keeps each rate in its optimizer state, so its
checkpoints resume only as the same group (a run alone refuses them in one line and leaves
them as they are); their parameters read like any run's.

The seeds go in lockstep: each segment trains the seeds at the lowest step up to the next
step another seed is at (or the end), so seeds resumed from checkpoints of different steps
(a kill between their saves) catch up before they join. A seed that diverges or whose
checkpoint save fails stops alone; the others go on without it. SIGTERM saves every seed.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from roformer.accelerator import startup_line
from roformer.data import DataConfig
from roformer.data.workers import StreamSpec, WorkerStreams
from roformer.errors import ConfigError
from roformer.machine import cores_available
from roformer.train import bookkeeping, flops, memory, optim, progress, sharding, steps
from roformer.train.checkpoint import Checkpointer
from roformer.train.config import TrainConfig, build_model_config, check_attention_setting
from roformer.train.guard import TrainingStopped
from roformer.train.evaluation import held_out_batches, held_out_rows
from roformer.train.metrics import MetricsWriter, ThroughputTimer
from roformer.train.run_log import StopFlag, TrainLog, due
from roformer.train.state import TrainSetup
from roformer import workdir_kind
from roformer.workdir_lock import workdir_lock

log = logging.getLogger("roformer.train")


def check_seed_group(configs) -> None:
    """The configs must differ in train.seed (and may in train.learning_rate: each member
    trains at its own peak rate on the shared schedule) only, and ask for nothing a vmapped
    group does not do (`seed_group_problems`); ConfigError says what."""
    if not configs:
        raise ConfigError("no seeds to train")
    seeds = [int(c.train.seed) for c in configs]
    if len(set(seeds)) != len(seeds):
        raise ConfigError(f"vmapped seeds must differ: train.seed {seeds}")

    def without_seed(config) -> dict:
        values = config.to_dict()
        values["train"] = {k: v for k, v in values["train"].items() if k not in ("seed", "learning_rate")}
        return values

    first = without_seed(configs[0])
    for config in configs[1:]:
        if without_seed(config) != first:
            raise ConfigError("vmapped seeds must share every setting but train.seed and train.learning_rate")
    problems = seed_group_problems(configs[0].train)
    if problems:
        raise ConfigError("; ".join(problems))


def seed_group_problems(train) -> list[str]:
    """What a `train` config section asks for that vmapped seeds do not do (also the
    ablation's check of `vmap_seeds`, before anything trains)."""
    problems = []
    if jax.process_count() > 1:
        problems.append(f"vmapped seeds train in one process; this job has {jax.process_count()} "
                        "(train each seed as a run of its own)")
    if str(train.get("phases") or "").strip():
        problems.append("vmapped seeds do not train in phases (train.phases); train each seed as a run of its own")
    if train.get("init_from"):
        problems.append("vmapped seeds start from their own initialisations, not a warm start (train.init_from); "
                        "warm-start each seed as a run of its own")
    if train.get("dropout_rng_impl", "threefry2x32") != "threefry2x32":
        problems.append(f"vmapped seeds draw dropout with threefry2x32 only (train.dropout_rng_impl="
                        f"{train.dropout_rng_impl!r}): vmapped, rbg keys give other bits than the run alone")
    return problems


def default_data_workers(seeds: int) -> int:
    """Batch-making processes for `seeds` streams: none on a CPU backend (its cores run the
    step), else one per seed up to the host's cores less two (the training process and its
    transfers)."""
    if jax.default_backend() == "cpu":
        return 0
    return max(1, min(seeds, cores_available() - 2))


def train_seeds_and_evaluate(configs, workdirs, *, data_workers: int | None = None) -> list[dict | TrainingStopped]:
    """Pretrain (or resume) the seeds of `configs` (equal but for train.seed), each in its
    workdir, vmapped on the first device; returns per seed its summary (as
    `train_and_evaluate`'s, with `seeds_in_step`) or the TrainingStopped that stopped it.
    Workdirs another live run is using are refused (roformer.workdir_lock).

    `data_workers`: processes that make the seeds' training batches ahead
    (roformer.data.workers; the same batches), 0 in this process; None: `default_data_workers`."""
    if len(configs) != len(workdirs):
        raise ValueError(f"{len(configs)} configs for {len(workdirs)} workdirs")
    check_seed_group(configs)
    check_attention_setting(configs[0].model)
    workdirs = [Path(w).resolve() for w in workdirs]
    if len(set(workdirs)) != len(workdirs):
        raise ConfigError("every vmapped seed needs a workdir of its own")
    with contextlib.ExitStack() as locks:
        for workdir in workdirs:
            locks.enter_context(workdir_lock(workdir))
            workdir_kind.claim(workdir, workdir_kind.PRETRAINING)
        return _train_group(configs, workdirs, data_workers)


@dataclasses.dataclass
class _Seed:
    """One seed's run: its files, data and, between segments, its own (unstacked) state."""
    index: int
    config: object
    workdir: Path
    tc: TrainConfig
    data: object
    checkpointer: Checkpointer
    state: dict | None = None
    step: int = 0
    start_step: int = 0
    train_iter: object = None
    log: TrainLog | None = None
    evaluated: dict = dataclasses.field(default_factory=dict)   # step -> held-out loss
    last_eval: dict = dataclasses.field(default_factory=dict)
    error: TrainingStopped | None = None

    def save(self, state: dict, model_cfg) -> None:
        bookkeeping.save_checkpoint(self.checkpointer, self.step, state, self.train_iter, model_cfg, self.tc,
                                    self.evaluated.get(self.step))


def _train_group(configs, workdirs: list[Path], data_workers: int | None) -> list[dict | TrainingStopped]:
    tcs = [TrainConfig.from_section(c.train) for c in configs]
    tc = tcs[0]
    if tc.batch_size % tc.grad_accum:
        raise ConfigError(f"train.batch_size={tc.batch_size} must be divisible by train.grad_accum={tc.grad_accum}")
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, devices=jax.devices()[:1])
    datas = [bookkeeping.run_data(c.data, t, workdir=w) for c, t, w in zip(configs, tcs, workdirs)]
    model_cfg = build_model_config(configs[0].model, vocab_size=datas[0].vocab_size, pad_token_id=datas[0].pad_id)
    memory.check_step_memory(model_cfg, batch_size=tc.batch_size, seq_len=tc.seq_len,
                             num_predictions=datas[0].masker.max_predictions, grad_accum=tc.grad_accum,
                             num_devices=1, seeds=len(configs))   # before any workdir is written
    log.info("%s", startup_line(model_cfg))
    results: list = [None] * len(configs)
    wall_start = time.perf_counter()

    with contextlib.ExitStack() as cleanup:
        seeds = _open_seeds(cleanup, configs, workdirs, tcs, datas, model_cfg, results)
        if not seeds:
            return results
        setup = TrainSetup(model_cfg, *_group_optimizer(tcs), mesh, seed=tc.seed, dropout_rng_impl=tc.dropout_rng_impl)
        cleanup.enter_context(jax.set_mesh(mesh))
        rest = setup.init_rest()   # RNG streams only: every step re-derives them from its seed's key
        _start_seeds(cleanup, seeds, setup, model_cfg, tc, datas[0])
        _stream_batches(cleanup, seeds, tc, data_workers)
        group = _Group(setup, model_cfg, rest, tc, held_out_batches(datas[0], tc, mesh),
                       member_rates=_member_rates(tcs))
        stop = cleanup.enter_context(StopFlag())
        bar = cleanup.enter_context(progress.progress_bar(total=tc.steps, initial=min(s.step for s in seeds),
                                                          desc=f"pretrain {len(seeds)} seeds",
                                                          enabled=tc.progress_bar))
        preempted = _train_in_lockstep(group, seeds, tc, stop, bar)

    wall = time.perf_counter() - wall_start
    for seed in seeds:
        results[seed.index] = seed.error if seed.error is not None else _summary(
            seed, len(seeds), preempted, wall, stop.signal if preempted else None)
    return results


def _open_seeds(cleanup: contextlib.ExitStack, configs, workdirs: list[Path], tcs: list[TrainConfig], datas: list,
                model_cfg, results: list) -> list[_Seed]:
    """The seeds left to train, each with its checkpointer (closed by `cleanup`); a finished
    seed's summary goes into `results` instead."""
    seeds: list[_Seed] = []
    for index, (config, workdir, t, data) in enumerate(zip(configs, workdirs, tcs, datas)):
        checkpointer, finished = bookkeeping.open_run(cleanup, workdir, t, model_cfg)
        if finished is not None:
            results[index] = finished
            continue
        seeds.append(_Seed(index, config, workdir, t, data, checkpointer))
    return seeds


def _start_seeds(cleanup: contextlib.ExitStack, seeds: list[_Seed], setup: TrainSetup, model_cfg, tc: TrainConfig,
                 data) -> None:
    """Each seed's state (restored or initialised), run files, metrics writer and log (`tc`,
    `data`: the first seed's, whose shapes every seed shares)."""
    peak_flops = flops.device_peak_flops(jax.devices()[0], model_cfg.dtype, tc.peak_flops_per_device)
    step_flops = flops.train_flops_per_step(model_cfg, batch_size=tc.batch_size, seq_len=tc.seq_len,
                                            num_predictions=data.masker.max_predictions,
                                            segmented=data.packing == "packed")
    for seed in seeds:   # every restore's checks (the corpus's, say) before any workdir is written
        seed.state, seed.start_step, seed.train_iter = bookkeeping.restore_or_init(
            setup, seed.checkpointer, seed.data, seed.tc)
        seed.step = seed.start_step
    for seed in seeds:
        bookkeeping.write_run_files(seed.workdir, seed.config, model_cfg, seed.data.tokenizer)
        writer = cleanup.enter_context(contextlib.closing(MetricsWriter(seed.workdir, resume_step=seed.start_step)))
        logged = bookkeeping.logged_history(seed.workdir, seed.start_step, tc.divergence_window)
        guard = bookkeeping.resumed_guard(tc, logged, seed.start_step)
        # Each seed's tokens/s and MFU are its own: the group's step time, one seed's tokens.
        timer = ThroughputTimer(tokens_per_step=tc.batch_size * tc.seq_len, flops_per_step=step_flops,
                                peak_flops=peak_flops, num_devices=1)
        seed.log = TrainLog(writer, timer, progress.progress_bar(total=0, desc="", enabled=False), seed.checkpointer,
                            guard, first_loss=logged["first_loss"], mark={"phase": seed.train_iter.phase,
                                                                           "seq_len": tc.seq_len})


def _stream_batches(cleanup: contextlib.ExitStack, seeds: list[_Seed], tc: TrainConfig,
                    data_workers: int | None) -> None:
    """With data workers (`default_data_workers`), each seed reads its batches from a worker
    process (the same batches) instead of making them here."""
    workers = default_data_workers(len(seeds)) if data_workers is None else min(data_workers, len(seeds))
    if workers <= 0:
        return
    streams = WorkerStreams([StreamSpec(DataConfig.from_mapping(seed.config.data), tc.seq_len, tc.batch_size,
                                        seed.tc.seed, seed.train_iter.get_state()) for seed in seeds], workers)
    cleanup.callback(streams.close)
    for index, seed in enumerate(seeds):
        seed.train_iter = _WorkerStream(streams, index, seed.train_iter.phase)
    log.info("%d seeds' batches made in %d processes", len(seeds), workers)


def _train_in_lockstep(group: _Group, seeds: list[_Seed], tc: TrainConfig, stop: StopFlag, bar) -> bool:
    """Train the seeds up to tc.steps, the lowest ones first until they join the others;
    returns whether a signal stopped them (each seed saved)."""
    preempted = False
    while not preempted:
        live = [s for s in seeds if s.error is None and s.step < tc.steps]
        if not live:
            break
        low = min(s.step for s in live)
        members = [s for s in live if s.step == low]
        end = min([s.step for s in live if s.step > low] + [tc.steps])
        preempted = group.train(members, end, stop, bar)
    if not preempted:   # nothing left to train (summary.json was missing): report the evaluation only
        untrained = [s for s in seeds if s.error is None and s.step == s.start_step]
        if untrained:
            group.evaluate(untrained, _stack([s.state for s in untrained]))
    for seed in seeds:   # the last saves' outcome, each seed's own (a failed one stops that seed only)
        if seed.error is None:
            _guarded(seed, seed.checkpointer.wait)
    return preempted


def _summary(seed: _Seed, seeds_in_step: int, preempted: bool, wall: float, stop_signal) -> dict:
    """A seed's summary.json, written and returned."""
    summary = bookkeeping.run_summary(seed.workdir, final_step=seed.step, start_step=seed.start_step,
                                      preempted=preempted, train_log=seed.log, last_eval=seed.last_eval,
                                      wall_time_s=wall, num_devices=1, num_processes=1, data=seed.data,
                                      seeds_in_step=seeds_in_step, stop_signal=stop_signal)
    bookkeeping.write_summary(seed.workdir, summary)
    return summary


class _WorkerStream:
    """One seed's batch stream made in a worker process, read as its BatchIterator."""

    def __init__(self, streams: WorkerStreams, index: int, phase: int):
        self.streams, self.index, self.phase = streams, index, phase

    def __next__(self) -> dict:
        return self.streams.take(self.index)

    def get_state(self) -> dict:
        return self.streams.state(self.index)


def _member_rates(tcs: list[TrainConfig]) -> bool:
    """Whether the group's members train at rates of their own."""
    return len({t.learning_rate for t in tcs}) > 1


def _group_optimizer(tcs: list[TrainConfig]):
    """(transform, schedule) of the group: the run's, or with members at rates of their own the
    same AdamW with its rate in the optimizer state (optim.make_member_optimizer) on the
    schedule at a peak of 1, which `_rate_step` scales by each member's rate every step. The
    group of one rate keeps the run's transform, so its checkpoints are a run's."""
    tc = tcs[0]
    if not _member_rates(tcs):
        return bookkeeping.run_optimizer(tc)
    tx = optim.make_member_optimizer(weight_decay=tc.weight_decay, b1=tc.b1, b2=tc.b2, eps=tc.eps,
                                     clip_norm=tc.clip_norm)
    return tx, optim.make_schedule(learning_rate=1.0, warmup_steps=tc.warmup_steps, total_steps=tc.schedule_steps,
                                   decay=tc.decay)


def _rate_step(setup: TrainSetup, *, grad_accum: int, debug_nan_step: int):
    """`(states, rest, batches, base_keys, rates) -> (states, metrics)`: the seeds' train step
    with each member's learning rate its rate times the schedule (`_group_optimizer`)."""
    keyed = steps.make_keyed_train_step(setup.graphdef, setup.tx, setup.schedule, grad_accum=grad_accum,
                                        debug_nan_step=debug_nan_step)

    def step(state, rest, batch, key, rate):
        learning_rate = rate * setup.schedule(state["step"])
        state = {**state, "opt_state": optim.with_learning_rate(state["opt_state"], learning_rate)}
        state, metrics = keyed(state, rest, batch, key)
        return state, {**metrics, "learning_rate": learning_rate}

    return jax.jit(jax.vmap(step, in_axes=(0, None, 0, 0, 0)), donate_argnums=0)


def _stack(trees: list) -> dict:
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *trees)


def _unstack(tree, count: int) -> list:
    return [jax.tree.map(lambda leaf, i=i: leaf[i], tree) for i in range(count)]


class _Group:
    """The compiled steps (one program per number of seeds in a segment) and the segment loop."""

    def __init__(self, setup: TrainSetup, model_cfg, rest, tc: TrainConfig, eval_batches: dict, *,
                 member_rates: bool = False):
        self.setup, self.model_cfg, self.rest, self.tc, self.eval_batches = setup, model_cfg, rest, tc, eval_batches
        self.sizes_compiled: set[int] = set()   # the numbers of seeds a train step was compiled for
        # the first call of each compiles it: announced, with its time (progress.announce_compile)
        self.member_rates = member_rates
        make_step = functools.partial(_rate_step, setup) if member_rates else setup.jit_seeds_train_step
        self.train_step = progress.announce_compile(
            make_step(grad_accum=tc.grad_accum, debug_nan_step=tc.debug_nan_step), "the seeds' train step")
        self.eval_step = progress.announce_compile(setup.jit_seeds_eval_step(), "the seeds' evaluation step")
        # Linear attention forms no probabilities to measure.
        self.stats_step = (progress.announce_compile(setup.jit_seeds_attention_stats_step(),
                                                     "the seeds' attention-statistics step")
                           if tc.eval_attention_stats and model_cfg.attention == "softmax" else None)

    def train(self, members: list[_Seed], end: int, stop: StopFlag, bar) -> bool:
        """Train `members` (all at one step) together up to step `end`, or until one of them
        stops (the rest go on in the next segment); True when SIGTERM stopped the segment."""
        tc = self.tc
        states = _stack([seed.state for seed in members])
        for seed in members:
            seed.state = None
        if len(members) not in self.sizes_compiled:   # this segment's first step compiles
            for seed in members:
                seed.log.timer.restart()
            self.sizes_compiled.add(len(members))
        keys = jnp.stack([steps.dropout_base_key(seed.tc.seed, tc.dropout_rng_impl) for seed in members])
        # Members at rates of their own (_rate_step) take them as a last argument.
        rates = (jnp.asarray([seed.tc.learning_rate for seed in members], jnp.float32),) if self.member_rates else ()
        pending: list[tuple[int, dict]] = []
        step, preempted, stopped = members[0].step, False, False
        while step < end and not stopped:
            batch = {k: jnp.asarray(np.stack(v)) for k, v in
                     _by_key([next(seed.train_iter) for seed in members]).items()}
            states, metrics = self.train_step(states, self.rest, batch, keys, *rates)
            step += 1
            for seed in members:
                seed.step = step
                seed.log.timer.step(metrics)
            pending.append((step, metrics))
            bar.update(1)
            now = due(step, tc)
            preempted = stop.should_stop(step, tc.log_every)
            if now.log or now.checkpoint or preempted:
                stopped |= self._flush(members, pending)
                pending = []
            if preempted:
                self._save(members, states)
                log.warning("%s received: saved a checkpoint of every seed at step %d; exiting", stop.signal, step)
                break
            if not (now.eval or now.checkpoint):
                continue
            jax.block_until_ready(states)   # the steps still running count as training, not pause
            with contextlib.ExitStack() as paused:
                for seed in members:
                    paused.enter_context(seed.log.timer.paused())
                if now.eval:
                    stopped |= self.evaluate(members, states)
                if now.checkpoint:
                    self._save(members, states, final=step == tc.steps)
        # Steps not logged yet (the segment ended between two logged rows) wait in each seed's
        # log for its next row, which covers them as a run's alone would.
        self._queue(members, pending)
        for seed, state in zip(members, _unstack(states, len(members))):
            seed.state = state
        return preempted

    def _queue(self, members: list[_Seed], pending: list[tuple[int, dict]]) -> None:
        """Each live seed's share of the stacked metrics of `pending` steps (one fetch), queued in its log."""
        fetched = jax.device_get([m for _, m in pending])
        for i, seed in enumerate(members):
            if seed.error is None:
                for (step, _), metrics in zip(pending, fetched):
                    seed.log.queue(step, {name: value[i] for name, value in metrics.items()})

    def _flush(self, members: list[_Seed], pending: list[tuple[int, dict]]) -> bool:
        """Each seed's metrics row up to the last of `pending` steps; True when a seed stopped."""
        self._queue(members, pending)
        stopped = False
        for seed in members:
            if seed.error is None:
                stopped |= _guarded(seed, lambda seed=seed: seed.log.flush(pending[-1][0]))
        return stopped

    def evaluate(self, members: list[_Seed], states) -> bool:
        """Every seed's held-out loss (and attention statistics) on the same batches; True
        when one stopped."""
        rows = held_out_rows(self.eval_step, self.stats_step, states["params"], self.rest, self.eval_batches,
                             members=len(members))
        stopped = False
        for seed, row in zip(members, rows):
            if seed.error is not None:
                continue
            seed.last_eval = row
            seed.log.write(seed.step, row)
            seed.evaluated[seed.step] = row["eval_loss"]
            stopped |= _guarded(seed, lambda seed=seed, row=row: seed.log.check_eval(seed.step, row["eval_loss"]))
        return stopped

    def _save(self, members: list[_Seed], states, *, final: bool = True) -> None:
        for seed, state in zip(members, _unstack(states, len(members))):
            if seed.error is not None or not seed.log.may_save(seed.step, final=final, who=f"{seed.workdir}: "):
                continue
            _guarded(seed, lambda seed=seed, state=state: seed.save(state, self.model_cfg))


def _by_key(batches: list[dict]) -> dict[str, list]:
    return {key: [batch[key] for batch in batches] for key in batches[0]}


def _guarded(seed: _Seed, call) -> bool:
    """Run `call` for one seed; a TrainingStopped (divergence, failed save) stops that seed
    alone: recorded, logged, True."""
    try:
        call()
    except TrainingStopped as error:
        seed.error = error
        log.error("%s: %s", seed.workdir, error)
        return True
    return False
