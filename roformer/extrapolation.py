"""Length extrapolation: held-out MLM loss of a pretrained model at longer sequences.

Every evaluation length reads the same text: the first `max_len` tokens of the same
held-out documents (those at least that long), cut into full windows of the length
(one document per row, the pipeline's `document` packing, so positions really run up to the
length). Loss differences between lengths are then about context length, not about
which documents happened to be long enough.

Rotary models are also evaluated with the two usual length extensions applied only at
evaluation time, by overriding `ModelConfig.rope_scaling`: position interpolation
("linear", positions / factor) and NTK-aware base scaling ("ntk"), with factor =
evaluation length / pretraining length. A learned absolute table has no rows beyond
`max_position_embeddings`: those lengths are None ("n/a").
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Iterable

import jax
import ml_collections
import numpy as np
from flax import nnx

from roformer.model import ModelConfig, RoFormerForMaskedLM
from roformer.train.steps import make_eval_step, summarize_eval

ROTARY_POSITIONS = ("rope",)
SCALINGS = ("linear", "ntk")


def load_mlm_checkpoint(workdir: str | Path) -> tuple[ModelConfig, dict]:
    """(ModelConfig, MLM params as a pure dict) from the newest checkpoint of a pretrain workdir."""
    from roformer.convert import load_pretrain_workdir

    model_config, model = load_pretrain_workdir(workdir)
    return model_config, nnx.to_pure_dict(nnx.state(model, nnx.Param))


def count_params(params: dict) -> int:
    return int(sum(np.size(x) for x in jax.tree.leaves(params)))


def mlm_loss(model_config: ModelConfig, params: dict, batches: list[dict]) -> dict[str, float]:
    """Held-out MLM loss / accuracy of `params` under `model_config` over `batches`."""
    graphdef, _, rest = nnx.split(RoFormerForMaskedLM(model_config, rngs=nnx.Rngs(0)), nnx.Param, ...)
    eval_step = jax.jit(make_eval_step(graphdef))
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
    scalings = list(scalings) if model_config.position in ROTARY_POSITIONS else []
    unknown = sorted(set(scalings) - set(SCALINGS))
    if unknown:
        raise ValueError(f"extrapolation scalings {unknown}: choose from {SCALINGS}")
    lengths = sorted(batches_by_length)
    results: dict[str, list[dict | None]] = {v: [] for v in ["plain", *scalings]}
    for length in lengths:
        batches = batches_by_length[length]
        beyond_table = model_config.position == "learned" and length > model_config.max_position_embeddings
        plain = None if not batches or beyond_table else mlm_loss(model_config, params, batches)
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


def heldout_windows(data_cfg: ml_collections.ConfigDict, lengths: Iterable[int], *, num_docs: int,
                    batch_size: int, seed: int) -> dict[int, list[dict]]:
    """Masked batches per length over the same text: the first max(lengths) tokens of the
    first `num_docs` held-out documents that long, cut into full windows of each length."""
    from roformer.data import make_pretrain_data
    from roformer.data.packing import plan_rows

    lengths = sorted(lengths)
    max_len = lengths[-1]
    cfg = ml_collections.ConfigDict(data_cfg.to_dict())
    cfg.packing = "document"
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


def evaluate_workdir(workdir: str | Path, data_cfg: ml_collections.ConfigDict, *, seq_len: int,
                     factors: Iterable[int], scalings: Iterable[str] = SCALINGS, num_docs: int = 64,
                     batch_size: int = 8, seed: int = 0) -> dict:
    """Length extrapolation of a pretrain workdir's latest checkpoint, plus its parameter count."""
    model_config, params = load_mlm_checkpoint(workdir)
    batches = heldout_windows(data_cfg, [seq_len * f for f in factors], num_docs=num_docs,
                              batch_size=batch_size, seed=seed)
    return {"params": count_params(params),
            "extrapolation": evaluate(model_config, params, batches, seq_len, scalings)}
