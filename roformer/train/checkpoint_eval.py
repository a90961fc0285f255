"""The held-out MLM loss of a pretraining checkpoint, without training
(`python -m roformer.evaluate --workdir=DIR`).

The checkpoint is read through the workdir's one reader (roformer.workdir), and the
held-out batches are built by the training loop's own functions from the run's
config.json and tokenizer, so the loss of a step the run evaluated is the one it logged.
A phased run's step is evaluated with the batch shape of the phase it belongs to; every
other setting is config.json's, the run's latest attempt.
"""
from __future__ import annotations

import contextlib
import logging
import math
from pathlib import Path

import jax
import ml_collections

from roformer.errors import ConfigError
from roformer.model.attention import check_attention_impl
from roformer.train import bookkeeping, sharding
from roformer.train.config import TrainConfig, parse_phases, phase_config
from roformer.train.evaluation import eval_row, eval_totals, held_out_batches
from roformer.train.metrics import read_metrics
from roformer.train.state import TrainSetup
from roformer.workdir import PretrainWorkdir

log = logging.getLogger("roformer.train")


def step_config(run: PretrainWorkdir, step: int) -> ml_collections.ConfigDict:
    """The run's config (config.json) as it trained `step`: with train.phases, that phase's
    batch shape and masked slots; the data read with the run's own tokenizer (the one the
    workdir keeps: a warm start's, or one trained on the corpus)."""
    saved = run.run_config()
    if not saved:
        raise ConfigError(f"{run.path} has no config.json: its held-out batches cannot be rebuilt "
                          "(the run writes it at start-up)")
    config = ml_collections.ConfigDict({key: value for key, value in saved.items() if key != "resolved_model"})
    phases = parse_phases(config.train)
    phase = next((p for p in phases if step <= p.end), phases[-1])
    config = phase_config(config, phase, phases)
    run.tokenizer()   # refuses a workdir without one, in one line
    config.data.vocab = str(run.tokenizer_file)
    return config


def evaluation_mesh(batch_size: int):
    """Data parallel over this host's devices when they divide the batch, else one device."""
    devices = jax.local_devices()
    if batch_size % len(devices):
        devices = devices[:1]
    return sharding.make_mesh({"data": -1, "fsdp": 1, "tensor": 1}, devices)


def logged_eval(workdir: Path, step: int) -> dict:
    """The held-out metrics the run logged at `step` (its last evaluation there), or {}."""
    rows = [r for r in read_metrics(workdir) if r.get("step") == step and "eval_loss" in r]
    return {k: v for k, v in rows[-1].items() if k.startswith("eval_")} if rows else {}


def evaluate_checkpoint(workdir: str | Path, *, step: int = -1, eval_batches: int = 0) -> dict:
    """Held-out loss, MLM accuracy and perplexity (and with train.eval_shuffled, the
    shuffled set's and the order gap) of checkpoint `step` (newest when < 0) over the run's
    train.eval_batches held-out batches, or `eval_batches` (> 0) of them; with what the run
    logged at that step (`logged`) when it evaluated there."""
    if jax.process_count() > 1:
        raise ConfigError("evaluating a checkpoint runs in one process")
    run = PretrainWorkdir(workdir)
    step = run.resolve_step(step)
    config = step_config(run, step)
    if eval_batches > 0:
        config.train.eval_batches = eval_batches
    tc = TrainConfig.from_section(config.train)
    model_cfg, params = run.params(step)
    check_attention_impl(model_cfg)   # the run's kernel may not suit this device
    data = bookkeeping.run_data(config.data, tc, workdir=run.path)
    mesh = evaluation_mesh(tc.batch_size)
    setup = TrainSetup(model_cfg, *bookkeeping.run_optimizer(tc), mesh, seed=tc.seed)
    with contextlib.ExitStack() as stack:
        stack.enter_context(jax.set_mesh(mesh))
        params = jax.device_put(params, setup.state_shardings["params"])
        batches = held_out_batches(data, tc, mesh)
        eval_step, rest = setup.jit_eval_step(), setup.init_rest()
        row = eval_row({name: eval_totals(eval_step, params, rest, b) for name, b in batches.items()})
    if not math.isfinite(row["eval_loss"]):
        log.warning("step %d: the held-out loss is %s", step, row["eval_loss"])
    return {"workdir": str(run.path), "step": step, **row, "eval_batches": tc.eval_batches,
            "batch_size": tc.batch_size, "seq_len": tc.seq_len, "logged": logged_eval(run.path, step)}
