"""Held-out evaluation, the same under every training driver: the held-out batches on the mesh,
the sums of an evaluation step over them (one model, or vmapped members on a leading axis), the
metrics row they make, and a row's attention statistics; per-row sums over rows held on the
host, in padded chunks with a few in flight (the study's groups).
"""
from __future__ import annotations

import jax
import numpy as np

from roformer.model import attention_stats
from roformer.train import sharding, steps
from roformer.train.config import TrainConfig


def held_out_batches(data, tc: TrainConfig, mesh) -> dict[str, list]:
    """The held-out batches on the mesh: "" plain, "shuffled" with each document's tokens shuffled."""
    eval_sets = {"": data.eval_batches(tc.eval_batches)}
    if tc.eval_shuffled:
        eval_sets["shuffled"] = data.eval_batches(tc.eval_batches, shuffled=True)
    return {name: [sharding.global_batch(b, mesh) for b in batches] for name, batches in eval_sets.items()}


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


def held_out_rows(eval_step, stats_step, params, rest, batches: dict[str, list], members: int = 0) -> list[dict]:
    """The metrics rows of `params` on the held-out `batches` (held_out_batches): one row, or
    with `members` > 0 one per member of a vmapped group (the steps' outputs then have a
    leading member axis). With a `stats_step`, each row holds the attention statistics of the
    first plain batch too."""
    totals = {name: eval_totals(eval_step, params, rest, group) for name, group in batches.items()}
    if not members:
        rows = [eval_row(totals)]
    else:
        rows = [eval_row({name: {k: v[i] for k, v in sums.items()} for name, sums in totals.items()})
                for i in range(members)]
    if stats_step is not None:
        stats = jax.device_get(stats_step(params, rest, batches[""][0]))
        for i, row in enumerate(rows):
            row.update(attention_stats.as_metrics(jax.tree.map(lambda leaf, i=i: leaf[i], stats) if members else stats))
    return rows


def padded_chunks(rows: dict[str, np.ndarray], size: int):
    """`rows` in chunks of `size` rows, the last padded with copies of its last row at weight 0;
    yields (chunk, real rows)."""
    total = len(rows["input_ids"])
    for lo in range(0, total, size):
        chunk = {k: v[lo:lo + size] for k, v in rows.items()}
        pad = size - len(chunk["input_ids"])
        if pad:
            chunk = {k: np.concatenate([v, np.repeat(v[-1:], pad, 0) * (0 if k == "masked_weights" else 1)])
                     for k, v in chunk.items()}
        yield chunk, size - pad


def row_sums(evaluate_rows, params, rest, rows: dict[str, np.ndarray], size: int, *,
             in_flight: int) -> tuple[dict[str, np.ndarray], int]:
    """`evaluate_rows(params, rest, chunk)`'s per-row sums ([members, rows] each) over `rows`, in
    chunks of `size` (the last padded, its padding dropped), and the rows evaluated per member
    padding included. `in_flight` chunks are dispatched before any is read back: the device
    does not wait on the host, and no more than that many chunks' outputs are held at once."""
    pending, fetched, evaluated = [], [], 0
    for chunk, keep in padded_chunks(rows, size):
        pending.append((evaluate_rows(params, rest, chunk), keep))
        evaluated += len(chunk["input_ids"])
        if len(pending) == in_flight:
            fetched += [(jax.device_get(sums), keep) for sums, keep in pending]
            pending = []
    fetched += [(jax.device_get(sums), keep) for sums, keep in pending]
    keys = fetched[0][0].keys()
    return {k: np.concatenate([np.asarray(sums[k])[:, :keep] for sums, keep in fetched], axis=1) for k in keys}, evaluated
