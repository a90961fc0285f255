"""Length extrapolation: held-out MLM loss of a pretrained model at longer sequences (the
ablation's extrapolation and extension_eval stages).

Every evaluation length reads the same text: the first `max_len` tokens of the same
held-out documents (those at least that long), cut into full windows of the length
(one document per row, the pipeline's `document` packing, so positions really run up to the
length). Loss differences between lengths are then about context length, not about
which documents happened to be long enough.

Schemes that honour RoPE scaling (`PositionScheme.rope_scaling`) are also evaluated with
the usual length extensions applied only at evaluation time, by overriding
`ModelConfig.rope_scaling`: position interpolation ("linear", positions / factor),
NTK-aware base scaling ("ntk") and YaRN ("yarn"), with factor = evaluation length /
pretraining length. Past a scheme's `max_length` (a learned absolute table's rows) the
loss is None ("n/a").
"""
from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

import jax
import numpy as np
from flax import nnx

from roformer.errors import ConfigError
from roformer.model import ModelConfig, RoFormerForMaskedLM
from roformer.model.positions import POSITION_SCHEMES
from roformer.train.steps import make_eval_step, summarize_eval
from roformer.workdir import PretrainWorkdir

if TYPE_CHECKING:
    from roformer.data import DataConfig

SCALINGS = ("linear", "ntk", "yarn")


def count_params(params: dict) -> int:
    return int(sum(np.size(x) for x in jax.tree.leaves(params)))


@functools.lru_cache(maxsize=16)
def _eval_step(model_config: ModelConfig):
    """Jitted eval step and RNG state of one architecture, reused across checkpoints."""
    graphdef, _, rest = nnx.split(RoFormerForMaskedLM(model_config, rngs=nnx.Rngs(0)), nnx.Param, ...)
    return jax.jit(make_eval_step(graphdef)), rest


def mlm_loss(model_config: ModelConfig, params: dict, batches: list[dict]) -> dict[str, float]:
    """Held-out MLM loss / accuracy of `params` under `model_config` over `batches` (at least one:
    a mean over no predictions is not 0)."""
    if not batches:
        raise ValueError("no held-out windows to evaluate")
    eval_step, rest = _eval_step(model_config)
    totals = {"loss_sum": 0.0, "correct_sum": 0.0, "weight_sum": 0.0}
    for batch in batches:
        sums = eval_step(params, rest, batch)
        for key in totals:
            totals[key] += float(sums[key])
    return summarize_eval(totals)


def scaled_config(model_config: ModelConfig, scaling: str, factor: float, original_len: int) -> ModelConfig:
    """The same architecture with eval-time RoPE length scaling (no parameter changes)."""
    return dataclasses.replace(model_config, rope_scaling=scaling, rope_scaling_factor=float(factor),
                               rope_original_max_len=original_len)


def evaluate(model_config: ModelConfig, params: dict, batches_by_length: dict[int, list[dict]],
             seq_len: int, scalings: Iterable[str] = SCALINGS) -> dict:
    """Loss per evaluation length for the plain model and, for rotary, each scaling.

    Returns {"lengths": [...], "rows": [...] (windows evaluated), "loss": {"plain": [...],
    "linear": [...], ...}, "accuracy": {...}} with None where not applicable (learned table
    too short, no held-out document long enough).
    """
    unknown = sorted(set(scalings) - set(SCALINGS))
    if unknown:
        raise ConfigError(f"extrapolation scalings {unknown}: choose from {SCALINGS}")
    scheme = POSITION_SCHEMES[model_config.position]
    scalings = list(scalings) if scheme.rope_scaling else []
    max_length = scheme.max_length(model_config)
    lengths = sorted(batches_by_length)
    results: dict[str, list[dict | None]] = {v: [] for v in ["plain", *scalings]}
    for length in lengths:
        batches = batches_by_length[length]
        beyond = max_length is not None and length > max_length
        plain = None if not batches or beyond else mlm_loss(model_config, params, batches)
        results["plain"].append(plain)
        factor = length / seq_len
        for scaling in scalings:
            if plain is None or factor <= 1:  # a factor of 1 is the plain model
                results[scaling].append(plain)
            else:
                results[scaling].append(
                    mlm_loss(scaled_config(model_config, scaling, factor, seq_len), params, batches))
    def pick(key):
        return {v: [None if r is None else r[key] for r in rs] for v, rs in results.items()}

    return {"lengths": lengths, "rows": [sum(len(b["input_ids"]) for b in batches_by_length[n]) for n in lengths],
            "loss": pick("eval_loss"), "accuracy": pick("eval_mlm_accuracy")}


def window_rows(doc: np.ndarray, offset: np.ndarray, length: np.ndarray, window: int, max_len: int) -> np.ndarray:
    """Indices of the pieces that are full `window`-token windows inside a document's first
    `max_len` tokens (each piece holds `window - 2` tokens plus its [CLS]/[SEP])."""
    return np.flatnonzero((length == window - 2) & (offset + length <= max_len - 2))


def heldout_windows(run: PretrainWorkdir, data_cfg: DataConfig, lengths: Iterable[int], *, num_docs: int,
                    batch_size: int, seed: int, max_len: int | None = None) -> dict[int, list[dict]]:
    """Masked batches per length over the same text, tokenized with `run`'s tokenizer: the
    first `max_len` (default max(lengths)) tokens of the first `num_docs` held-out documents
    of `data_cfg`'s corpus that long, cut into full windows of each length."""
    # The data pipeline (tokenizers, token shards): only when windows are built.
    from roformer.data import make_pretrain_data
    from roformer.data.packing import plan_rows

    lengths = sorted(lengths)
    max_len = max_len or lengths[-1]
    cfg = dataclasses.replace(data_cfg, packing="document", vocab=str(run.tokenizer_file))
    out = {}
    for window in lengths:
        # One PretrainData per length: its masker sizes the masked-prediction slots to it.
        data = make_pretrain_data(cfg, seq_len=window, batch_size=batch_size, seed=seed, show_progress=False)
        docs = data.heldout_docs[data.corpus.doc_len[data.heldout_docs] >= max_len - 2][:num_docs]
        if len(docs) == 0:
            out[window] = []
            continue
        plan = plan_rows(docs, data.corpus.doc_len, window, "document")
        rows = data.rows(plan, 0, plan.num_rows)
        picked = plan.row[window_rows(plan.doc, plan.offset, plan.length, window, max_len)]
        batches = []
        for b, start in enumerate(range(0, len(picked), batch_size)):
            index = picked[start:start + batch_size]
            batches.append(data.make_batch({k: v[index] for k, v in rows.items()},
                                           np.random.default_rng([seed, window, b])))
        out[window] = batches
    return out


def evaluate_workdir(workdir: str | Path, data_cfg: DataConfig, *, seq_len: int,
                     factors: Iterable[int], scalings: Iterable[str] = SCALINGS, num_docs: int = 64,
                     batch_size: int = 8, seed: int = 0) -> dict:
    """Length extrapolation of a pretrain workdir's latest checkpoint, plus its parameter count."""
    run = PretrainWorkdir(workdir)
    model_config, params = run.params()
    batches = heldout_windows(run, data_cfg, [seq_len * f for f in factors], num_docs=num_docs,
                              batch_size=batch_size, seed=seed)
    return {"params": count_params(params),
            "extrapolation": evaluate(model_config, params, batches, seq_len, scalings)}


def evaluate_checkpoints(workdir: str | Path, data_cfg: DataConfig, *, seq_len: int,
                         factors: Iterable[int], factor: int, num_docs: int = 64, batch_size: int = 8,
                         seed: int = 0) -> dict:
    """Held-out loss at `factor` x `seq_len` of every checkpoint of a warm-started run (a
    context-extension stage), and of its starting point (step 0: the `train.init_from`
    parameters under this run's model config). The windows are those of the extrapolation
    table for `factors` (same documents, same masks), so step 0 equals its column."""
    run = PretrainWorkdir(workdir)
    init_from = run.run_config().get("train", {}).get("init_from")
    if not init_from:
        raise ConfigError(f"{workdir} was not warm-started (no train.init_from in its config.json)")
    length = seq_len * factor
    batches = heldout_windows(run, data_cfg, [length], num_docs=num_docs, batch_size=batch_size, seed=seed,
                              max_len=seq_len * max(factors))[length]
    model_config = run.model_config()
    points = [(0, PretrainWorkdir(init_from).params()[1])]
    points += [(step, run.params(step)[1]) for step in run.steps()]
    # No held-out document reaches `length`: n/a at every step, as in the extrapolation table.
    results = [mlm_loss(model_config, params, batches) if batches else None for _, params in points]
    return {"length": length, "steps": [step for step, _ in points],
            "loss": [r and r["eval_loss"] for r in results], "accuracy": [r and r["eval_mlm_accuracy"] for r in results]}
