"""The GPU comparison's data: one corpus split three ways, held as arrays on the device.

Documents go to the test, validation or training split by their content hash (as the
pretraining pipeline's held-out split: duplicated texts stay on one side), so the rate
chosen on validation never sees the test text. Training rows are packed once; each member
reads them in the order of its seed (a permutation per pass) and masks them on the device
with keys from its seed and step, so no host work paces a step and every member of one
seed, whatever its learning rate, sees the same batches. Validation and test rows are
masked once on the host (the pipeline's MlmMasker), the same for every member and scheme;
the test rows are masked `test_mask_draws` times, and a test item (what the bootstrap
resamples) is a document with every row whose most tokens are its, each with all its draws:
rows cut from one document are not independent, so resampling rows would understate the
test set's error.

The order-horizon variants of the validation rows move the tokens of every piece (one
document's run in a row) within windows of w of its tokens, each token to another place, or
reverse them; [CLS], [SEP], padding, positions and the predicted tokens stay, only their
order changes.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from roformer.data import DataConfig, prepare_corpus
from roformer.data.masking import MlmMasker, mask_rows_on_device
from roformer.data.packing import build_rows, plan_rows
from roformer.data.pipeline import EVAL_SEED
from roformer.errors import ConfigError

ROW_KEYS = ("input_ids", "positions", "segment_ids")


@dataclasses.dataclass
class StudyData:
    vocab_size: int
    pad_id: int
    mask_id: int
    special: np.ndarray          # bool [vocab]: never a masking candidate
    max_predictions: int
    mask_rate: float
    train: dict                  # ROW_KEYS -> int32 [N, L], unmasked
    validation: dict             # masked batch [V, L] (+ masked_* [V, P])
    variants: dict               # name -> masked batch [R, L]: the order-horizon rows
    test: dict                   # masked batch [T * draws, L]
    test_items: np.ndarray       # int [T * draws]: the item (document) each test row belongs to
    manifest: dict
    # The tokenizer (its tokenizers JSON), saved beside each member the study keeps for the
    # downstream arm (roformer.study.kept): GLUE text is tokenized as the corpus was. "": a pack
    # made before packs held it.
    tokenizer_json: str = ""

    @property
    def train_tokens(self) -> int:
        return int((self.train["segment_ids"] != 0).sum())

    @property
    def test_predictions(self) -> int:
        return int(self.test["masked_weights"].sum())


def split_documents(doc_hash: np.ndarray, test_fraction: float, validation_fraction: float) -> np.ndarray:
    """0 train, 1 validation, 2 test per document, from the same content-hash unit as the
    pipeline's held-out split (roformer.data.pipeline.heldout_documents)."""
    if not (0 < test_fraction and 0 < validation_fraction and test_fraction + validation_fraction < 0.5):
        raise ConfigError(f"study test_fraction={test_fraction} and validation_fraction={validation_fraction}: "
                          "each must be > 0, together below 0.5")
    unit = (doc_hash >> np.uint64(11)).astype(np.float64) * 2.0**-53
    return np.where(unit < test_fraction, 2, np.where(unit < test_fraction + validation_fraction, 1, 0))


def build(data_cfg: DataConfig, *, seq_len: int, test_fraction: float, validation_fraction: float,
          validation_rows: int, variant_rows: int, windows: list[int], test_mask_draws: int,
          max_test_rows: int = 0, show_progress: bool = False) -> StudyData:
    """The three splits of `data_cfg`'s corpus (tokenizer trained or read as the pipeline does)."""
    tokenizer, corpus = prepare_corpus(data_cfg, show_progress=show_progress)
    split = split_documents(corpus.doc_hash, test_fraction, validation_fraction)
    ids = dict(cls_id=tokenizer.cls_id, sep_id=tokenizer.sep_id, pad_id=tokenizer.pad_id)

    def rows(which: int) -> tuple[dict, np.ndarray]:
        """The split's rows, and per row the document with the most of its tokens."""
        docs = np.flatnonzero(split == which)
        plan = plan_rows(docs, corpus.doc_len, seq_len, data_cfg.packing)
        return build_rows(plan, corpus, 0, plan.num_rows, **ids), main_documents(plan)

    max_predictions = data_cfg.max_predictions_per_seq or round(data_cfg.mask_rate * seq_len) + 1
    special = np.asarray(tokenizer.is_special, bool)
    masker = MlmMasker(is_special=special, is_continuation=tokenizer.is_continuation, mask_id=tokenizer.mask_id,
                       mask_rate=data_cfg.mask_rate, max_predictions=max_predictions)
    (train, _), (held, _), (test_rows, test_docs) = rows(0), rows(1), rows(2)
    if len(held["input_ids"]) < validation_rows:
        raise ConfigError(f"the validation split has {len(held['input_ids'])} rows, fewer than study.validation_rows="
                          f"{validation_rows}: raise study.validation_fraction")
    held = {k: v[:validation_rows] for k, v in held.items()}
    validation = _masked(held, masker, [EVAL_SEED, 1])
    spectrum = {k: v[:variant_rows] for k, v in validation.items()}
    variants = order_variants(spectrum, windows, tokenizer.cls_id, tokenizer.sep_id, tokenizer.pad_id,
                              [EVAL_SEED, 2])
    if max_test_rows:
        test_rows = {k: v[:max_test_rows] for k, v in test_rows.items()}
        test_docs = test_docs[:max_test_rows]
    draws = [_masked(test_rows, masker, [EVAL_SEED, 3, d]) for d in range(test_mask_draws)]
    test = {k: np.concatenate([d[k] for d in draws]) for k in draws[0]}
    items = np.tile(np.unique(test_docs, return_inverse=True)[1].reshape(-1), test_mask_draws)
    manifest = {"num_docs": corpus.num_docs, "num_tokens": corpus.num_tokens, "vocab_size": tokenizer.vocab_size,
                "tokenizer_hash": tokenizer.hash, "train_rows": len(train["input_ids"]),
                "validation_rows": validation_rows, "test_rows": len(test_rows["input_ids"]),
                "test_mask_draws": test_mask_draws, "test_items": int(items.max()) + 1 if len(items) else 0,
                "test_item": TEST_ITEM, "seq_len": seq_len, "order_variants": ORDER_VARIANTS,
                "docs_per_split": {name: int((split == i).sum()) for i, name in enumerate(("train", "validation", "test"))}}
    out = StudyData(tokenizer.vocab_size, tokenizer.pad_id, tokenizer.mask_id, special, max_predictions,
                    data_cfg.mask_rate, train, validation, variants, test, items, manifest,
                    tokenizer.tokenizer.to_str())
    manifest.update(train_tokens=out.train_tokens, test_predictions=out.test_predictions,
                    validation_predictions=int(validation["masked_weights"].sum()))
    return out


def _masked(rows: dict, masker: MlmMasker, seed: list) -> dict:
    masked = masker(rows["input_ids"], np.random.default_rng(seed))
    return {"input_ids": masked["input_ids"], "token_type_ids": np.zeros_like(rows["input_ids"]),
            "positions": rows["positions"], "segment_ids": rows["segment_ids"],
            "masked_positions": masked["masked_positions"], "masked_labels": masked["masked_labels"],
            "masked_weights": masked["masked_weights"]}


# --------------------------------------------------------------------------- order horizon


# How order_variants moves tokens; part of a pack's key and of the data manifest, so packs and
# records made with another form are made again rather than mixed with these.
ORDER_VARIANTS = "windows of each piece's tokens, each window one random cycle"
# What a test item is (part of the pack key: a pack of rows as items is made again).
TEST_ITEM = "a document with the rows whose most tokens are its"


def main_documents(plan) -> np.ndarray:
    """Per row of `plan` (a PackPlan), the document with the most tokens in it (the first such
    piece on a tie)."""
    order = np.lexsort((-plan.length, plan.row))   # by row, then longest piece first (stable)
    rows = plan.row[order]
    first = order[np.r_[True, rows[1:] != rows[:-1]]]
    return plan.doc[first]


def order_variants(batch: dict, windows: list[int], cls_id: int, sep_id: int, pad_id: int,
                   seed: list[int]) -> dict[str, dict]:
    """{"shuffle<w>": the batch with each piece's tokens moved within windows of w of its
    tokens, for every w, "reverse": each piece's tokens in reverse order}.

    A window is w consecutive tokens of a piece, counted from its first token ([CLS], [SEP]
    and padding stay where they are and are not counted), and its tokens go round one random
    cycle: every token of a window of two or more moves. A uniform shuffle would leave a
    token in place with probability 1/w (half the pairs at w=2), so the small windows would
    measure a weaker perturbation than the large ones. Each w draws from its own generator
    (`seed` + [w]): its variant does not depend on which other windows are asked for."""
    ids, segments = batch["input_ids"], batch["segment_ids"]
    B, L = ids.shape
    movable = (segments != 0) & (ids != cls_id) & (ids != sep_id) & (ids != pad_id)
    piece = np.arange(B)[:, None] * (L + 1) + segments
    rank = _rank_in_group(movable, piece)
    out = {}
    for w in windows:
        group = piece * (L + 1) + rank // int(w)
        key = np.random.default_rng([*seed, int(w)]).random((B, L))
        out[f"shuffle{w}"] = _permuted(batch, movable, group, key, cycle=True)
    flat = np.arange(B * L, dtype=np.float64).reshape(B, L)
    out["reverse"] = _permuted(batch, movable, piece, -flat)
    return out


def _rank_in_group(movable: np.ndarray, group: np.ndarray) -> np.ndarray:
    """int [B, L]: each movable slot's index among its group's movable slots, left to right
    (0 elsewhere)."""
    flat = np.flatnonzero(movable)
    order = flat[np.lexsort((flat, group.ravel()[flat]))]
    rank = np.zeros(movable.size, np.int64)
    rank[order] = np.arange(len(order)) - _group_starts(group.ravel()[order])
    return rank.reshape(movable.shape)


def _group_starts(g: np.ndarray) -> np.ndarray:
    """For each element of `g` (group labels, each group's run contiguous), the index of its
    group's first element."""
    index = np.arange(len(g))
    return np.maximum.accumulate(np.where(np.r_[True, g[1:] != g[:-1]], index, 0))


def _permuted(batch: dict, movable: np.ndarray, group: np.ndarray, key: np.ndarray, cycle: bool = False) -> dict:
    """The batch with the movable tokens of each group put in the order of `key` (ascending),
    or with `cycle`, each moved to the slot of the next one in `key` order (the last to the
    first's); the masked slots follow their tokens."""
    ids = batch["input_ids"]
    B, L = ids.shape
    slots = np.flatnonzero(movable)
    g = group.ravel()[slots]
    in_key_order = slots[np.lexsort((key.ravel()[slots], g))]
    if cycle:
        g = group.ravel()[in_key_order]
        last = np.r_[g[1:] != g[:-1], True]
        sources = in_key_order
        targets = in_key_order[np.where(last, _group_starts(g), np.arange(len(g)) + 1)]
    else:
        targets = slots[np.lexsort((slots, g))]                 # each group's slots, left to right
        sources = in_key_order                                  # its tokens in `key` order
    new_ids = ids.ravel().copy()
    new_ids[targets] = ids.ravel()[sources]
    moved_to = np.tile(np.arange(L), B)
    moved_to[sources] = targets % L
    masked = np.take_along_axis(moved_to.reshape(B, L), batch["masked_positions"].astype(np.int64), axis=1)
    return {**batch, "input_ids": new_ids.reshape(B, L), "masked_positions": masked.astype(np.int32)}


# --------------------------------------------------------------------------- on the device


def pass_orders(seeds: list[int], num_rows: int, passes: int) -> np.ndarray:
    """int32 [len(seeds), passes, num_rows]: each seed's row order in each pass over the data."""
    return np.stack([np.stack([np.random.default_rng([seed, p]).permutation(num_rows) for p in range(passes)])
                     for seed in seeds]).astype(np.int32)


def passes_needed(steps: int, batch_size: int, num_rows: int) -> int:
    return max(1, math.ceil(steps * batch_size / num_rows))


def device_batch(train: dict, orders: jax.Array, seed_index, seed_key: jax.Array, step, *, batch_size: int,
                 special: jax.Array, replacement_ids: jax.Array, mask_id: int, mask_rate: float,
                 max_predictions: int) -> dict:
    """One member's training batch at `step` (traced): rows step*B .. step*B+B-1 of its seed's
    pass orders, masked as MlmMasker masks (the same rule, the device's random bits)."""
    num_rows = train["input_ids"].shape[0]
    k = step * batch_size + jnp.arange(batch_size)
    passes = orders.shape[1]
    index = orders[seed_index, (k // num_rows) % passes, k % num_rows]
    rows = {name: train[name][index] for name in ROW_KEYS}
    return mask_rows_on_device(jax.random.fold_in(seed_key, step), rows, special=special, replacement_ids=replacement_ids,
                     mask_id=mask_id, mask_rate=mask_rate, max_predictions=max_predictions)


# --------------------------------------------------------------------------- a pack of the splits


def save_pack(data: StudyData, path, key: str) -> None:
    """Every array of `data` in one compressed .npz (token ids as uint16 where they fit), with
    `key` (the settings that made it, roformer.study.session.data_key): a machine without the
    corpus (a GPU machine without the shared data) reads the splits from it instead of tokenizing text it lacks."""
    import io
    import json

    from roformer.files import write_bytes_atomic

    def small(name: str, array: np.ndarray) -> np.ndarray:
        if array.dtype.kind in "iu" and name != "test_items" and array.size and 0 <= array.min() and array.max() < 2**16:
            return array.astype(np.uint16)
        return array

    arrays = {"special": data.special, "test_items": data.test_items}
    for split in ("train", "validation", "test"):
        arrays.update({f"{split}/{k}": small(k, v) for k, v in getattr(data, split).items()})
    for name, batch in data.variants.items():
        arrays.update({f"variants/{name}/{k}": small(k, v) for k, v in batch.items()})
    meta = {"key": key, "manifest": data.manifest, "vocab_size": data.vocab_size, "pad_id": data.pad_id,
            "mask_id": data.mask_id, "max_predictions": data.max_predictions, "mask_rate": data.mask_rate,
            "variants": list(data.variants), "tokenizer": data.tokenizer_json}
    buffer = io.BytesIO()
    np.savez_compressed(buffer, meta=np.asarray(json.dumps(meta)), **arrays)
    Path(path).parent.mkdir(parents=True, exist_ok=True)   # the pack's folder may not exist yet
    write_bytes_atomic(path, buffer.getvalue())


def pack_key(path) -> str | None:
    """The key a pack at `path` was made with; None when there is no readable pack there, or
    one made before packs held the tokenizer (made again: the study keeps it with its members)."""
    import json

    try:
        with np.load(path) as pack:
            meta = json.loads(str(pack["meta"]))
            return meta["key"] if meta.get("tokenizer") else None
    except (OSError, ValueError, KeyError):
        return None


def load_pack(path, key: str) -> StudyData:
    """The splits `save_pack` wrote; ConfigError when they were made with other settings."""
    import json

    with np.load(path) as pack:
        meta = json.loads(str(pack["meta"]))
        if meta["key"] != key:
            raise ConfigError(f"study.data_pack={str(path)!r} was made with other data or split settings "
                              f"(key {meta['key']}, this config's {key}): make it again with "
                              "`python -m roformer.study pack --config=configs/study.py:VARIANT PATH`")
        arrays = {name: pack[name] for name in pack.files if name != "meta"}

    def part(prefix: str) -> dict:
        return {name[len(prefix):]: (v.astype(np.float32) if name.endswith("masked_weights") else v.astype(np.int32))
                for name, v in arrays.items() if name.startswith(prefix)}

    names = meta["variants"]   # in the order they were made: windows ascending, then reverse
    return StudyData(meta["vocab_size"], meta["pad_id"], meta["mask_id"], arrays["special"].astype(bool),
                     meta["max_predictions"], meta["mask_rate"], part("train/"), part("validation/"),
                     {name: part(f"variants/{name}/") for name in names}, part("test/"),
                     arrays["test_items"].astype(np.int64), meta["manifest"], meta.get("tokenizer", ""))
