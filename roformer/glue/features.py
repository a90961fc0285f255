"""Examples -> model inputs: `[CLS] a [SEP] (b [SEP])`, token types and longest-first
truncation (the tokenizer's own template and truncation), and length-bucketed padded
batches (few distinct shapes -> few recompiles)."""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import numpy as np
from tokenizers import Tokenizer, processors

from roformer.errors import ConfigError
from roformer.glue.readers import Example


@dataclasses.dataclass(frozen=True)
class SpecialIds:
    cls_id: int
    sep_id: int
    pad_id: int


def tokenizer_special_ids(tokenizer) -> SpecialIds:
    """Ids of [CLS]/[SEP]/[PAD] from an HF `tokenizers.Tokenizer` or an object that
    exposes `cls_id`/`sep_id`/`pad_id` (roformer.data's WordPieceTokenizer)."""
    if all(hasattr(tokenizer, a) for a in ("cls_id", "sep_id", "pad_id")):
        return SpecialIds(int(tokenizer.cls_id), int(tokenizer.sep_id), int(tokenizer.pad_id))
    ids = {t: tokenizer.token_to_id(t) for t in ("[CLS]", "[SEP]", "[PAD]")}
    missing = [t for t, i in ids.items() if i is None]
    if missing:
        raise ConfigError(f"tokenizer vocabulary lacks special token(s) {missing}")
    return SpecialIds(ids["[CLS]"], ids["[SEP]"], ids["[PAD]"])


def pair_encoder(tokenizer, max_seq_len: int) -> Tokenizer:
    """A copy of `tokenizer`'s Rust tokenizer (an HF `tokenizers.Tokenizer`, or roformer.data's
    WordPieceTokenizer around one) that encodes a text or a pair as `[CLS] a [SEP] (b [SEP])`
    with token types 0/1, truncated longest first to `max_seq_len` tokens in all: what
    transformers' run_glue gets from BertTokenizerFast(truncation="longest_first") (test). A
    copy, because truncation and the template are settings of the tokenizer object, which the
    caller keeps using (and saves with the fine-tuned models) as it is."""
    special = tokenizer_special_ids(tokenizer)
    rust = getattr(tokenizer, "tokenizer", tokenizer)
    encoder = Tokenizer.from_str(rust.to_str())
    encoder.post_processor = processors.TemplateProcessing(
        single="[CLS]:0 $A:0 [SEP]:0", pair="[CLS]:0 $A:0 [SEP]:0 $B:1 [SEP]:1",
        special_tokens=[("[CLS]", special.cls_id), ("[SEP]", special.sep_id)])
    encoder.enable_truncation(max_seq_len, strategy="longest_first")
    encoder.no_padding()
    return encoder


@dataclasses.dataclass
class Features:
    """Unpadded token ids per example plus labels; batches are padded per bucket."""
    input_ids: list[np.ndarray]
    token_type_ids: list[np.ndarray]
    labels: np.ndarray            # int32 class ids or float32 scores; 0 where unlabelled
    idx: np.ndarray               # example index (submission index on test splits)

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def lengths(self) -> np.ndarray:
        return np.array([len(x) for x in self.input_ids], np.int32)

    def head(self, n: int) -> "Features":
        """The first n examples."""
        return Features(self.input_ids[:n], self.token_type_ids[:n], self.labels[:n], self.idx[:n])

    def batch(self, rows: np.ndarray, batch_size: int, length: int, pad_id: int) -> dict[str, np.ndarray]:
        """`rows` right-padded to [batch_size, length]; missing rows get weight 0 (and length 1,
        a lone padding token, so no attention row is empty) so the batch shape, and the
        compiled step, stay the same for a short last batch. `lengths` [batch_size] is the
        padding in the form attention kernels take; `attention_mask` says the same per token."""
        input_ids = np.full((batch_size, length), pad_id, np.int32)
        token_type_ids = np.zeros((batch_size, length), np.int32)
        lengths = np.ones((batch_size,), np.int32)
        for i, r in enumerate(rows):
            n = len(self.input_ids[r])
            input_ids[i, :n] = self.input_ids[r]
            token_type_ids[i, :n] = self.token_type_ids[r]
            lengths[i] = n
        labels = np.zeros((batch_size,), self.labels.dtype)
        labels[:len(rows)] = self.labels[rows]
        weights = np.zeros((batch_size,), np.float32)
        weights[:len(rows)] = 1.0
        attention_mask = (np.arange(length)[None, :] < lengths[:, None]) & (weights[:, None] > 0)
        return {"input_ids": input_ids, "token_type_ids": token_type_ids, "lengths": lengths,
                "attention_mask": attention_mask.astype(np.int32), "labels": labels, "weights": weights}


@dataclasses.dataclass(frozen=True)
class PaddedRows:
    """Every example right-padded to one length, plus a last all-padding row (length 1,
    label 0) that stands for the missing rows of a short batch: a batch is then a gather of
    rows, one NumPy operation, instead of a Python loop per row and step."""
    input_ids: np.ndarray         # [n + 1, length]
    token_type_ids: np.ndarray    # [n + 1, length]
    lengths: np.ndarray           # [n + 1]
    labels: np.ndarray            # [n + 1]
    pad_id: int

    @classmethod
    def of(cls, features: Features, length: int, pad_id: int) -> "PaddedRows":
        lengths = np.append(features.lengths, 1).astype(np.int32)
        if lengths.max(initial=0) > length:
            raise ValueError(f"an example has {lengths.max()} tokens, more than the padded length {length}")
        filled = np.arange(length)[None, :] < lengths[:-1, None]
        input_ids = np.full((len(lengths), length), pad_id, np.int32)
        token_type_ids = np.zeros((len(lengths), length), np.int32)
        if len(features):
            input_ids[:-1][filled] = np.concatenate(features.input_ids)
            token_type_ids[:-1][filled] = np.concatenate(features.token_type_ids)
        labels = np.append(features.labels, np.zeros((1,), features.labels.dtype))
        return cls(input_ids, token_type_ids, lengths, labels, pad_id)

    def stacked(self, batches: Sequence[np.ndarray], batch_size: int) -> dict[str, np.ndarray]:
        """The batches (rows each) stacked to [len(batches), batch_size, ...]: what
        `Features.batch` gives for each at the full length, missing rows included."""
        missing = len(self.lengths) - 1
        rows = np.full((len(batches), batch_size), missing, np.int64)
        for i, batch_rows in enumerate(batches):
            rows[i, :len(batch_rows)] = batch_rows
        return {"input_ids": self.input_ids[rows], "token_type_ids": self.token_type_ids[rows],
                "lengths": self.lengths[rows], "labels": self.labels[rows],
                "weights": (rows != missing).astype(np.float32)}

    def packed(self, batches: Sequence[np.ndarray], batch_size: int, rows: int, width: int) -> dict[str, np.ndarray]:
        """The batches (example rows each) packed, stacked to [len(batches), rows, width]: each
        batch's examples laid end to end in `rows` rows (`pack_rows`), each example its own
        segment (ids 1, 2, ... in a row; 0 = padding) with positions from 0, and
        `cls_index` [len(batches), batch_size], the flat index (row * width + offset) of each
        example's first token; missing examples have weight 0 and index 0."""
        steps = len(batches)
        out = {"input_ids": np.full((steps, rows, width), self.pad_id, np.int32),
               "token_type_ids": np.zeros((steps, rows, width), np.int32),
               "segment_ids": np.zeros((steps, rows, width), np.int32),
               "positions": np.zeros((steps, rows, width), np.int32),
               "cls_index": np.zeros((steps, batch_size), np.int32),
               "labels": np.zeros((steps, batch_size), self.labels.dtype),
               "weights": np.zeros((steps, batch_size), np.float32)}
        counting = np.arange(width, dtype=np.int32)
        for step, batch_rows in enumerate(batches):
            lengths = self.lengths[batch_rows]
            row_of, offset_of, used = pack_rows(lengths, width)
            if used > rows:
                raise ValueError(f"a batch needs {used} packed rows, more than {rows}")
            for i, (example, n) in enumerate(zip(batch_rows, lengths)):
                row, start = row_of[i], offset_of[i]
                span = slice(start, start + n)
                out["input_ids"][step, row, span] = self.input_ids[example, :n]
                out["token_type_ids"][step, row, span] = self.token_type_ids[example, :n]
                out["segment_ids"][step, row, span] = i + 1
                out["positions"][step, row, span] = counting[:n]
                out["cls_index"][step, i] = row * width + start
            out["labels"][step, :len(batch_rows)] = self.labels[batch_rows]
            out["weights"][step, :len(batch_rows)] = 1.0
        return out


def pack_rows(lengths: Sequence[int], width: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(row, offset) of each example packed into rows of `width` tokens, and the rows used:
    first fit, longest example first, so a batch's examples share as few rows as they can."""
    row_of, offset_of = np.zeros(len(lengths), np.int32), np.zeros(len(lengths), np.int32)
    filled: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -int(lengths[i])):
        n = int(lengths[i])
        if n > width:
            raise ValueError(f"an example of {n} tokens does not fit a row of {width}")
        row = next((r for r, used in enumerate(filled) if used + n <= width), len(filled))
        if row == len(filled):
            filled.append(0)
        row_of[i], offset_of[i] = row, filled[row]
        filled[row] += n
    return row_of, offset_of, len(filled)


def row_buckets(batch_size: int) -> tuple[int, ...]:
    """The packed row counts a program is built for: powers of two up to an eighth of the
    batch, then its multiples, then the batch (1, 2, 4, 8, 12, ..., 32 for 32): a call's
    steps run at the first that holds them all, so coarse steps at the top would waste rows."""
    step = max(1, batch_size // 8)
    small, n = [], 1
    while n < step:
        small.append(n)
        n *= 2
    return tuple(sorted({*small, *range(step, batch_size, step), batch_size}))


def featurize(examples: Sequence[Example], tokenizer, max_seq_len: int,
              regression: bool = False) -> Features:
    """Every example's model inputs, assembled and truncated by the Rust tokenizer
    (`pair_encoder`), its batch encoder on all cores."""
    if max_seq_len < 8:
        raise ConfigError(f"max_seq_len must be at least 8, got {max_seq_len}")
    encoder = pair_encoder(tokenizer, max_seq_len)
    # encode_batch_fast skips character offsets; older tokenizers lack it
    encode = getattr(encoder, "encode_batch_fast", encoder.encode_batch)
    encodings = encode([e.text_a if e.text_b is None else (e.text_a, e.text_b) for e in examples],
                       add_special_tokens=True)
    input_ids = [np.asarray(e.ids, np.int32) for e in encodings]
    token_types = [np.asarray(e.type_ids, np.int32) for e in encodings]
    dtype = np.float32 if regression else np.int32
    labels = np.array([0 if e.label is None else e.label for e in examples], dtype)
    idx = np.array([e.idx for e in examples], np.int64)
    return Features(input_ids, token_types, labels, idx)


def bucket_lengths(max_seq_len: int, smallest: int = 16) -> tuple[int, ...]:
    """Padded lengths allowed: powers of two from `smallest`, capped by max_seq_len."""
    buckets, n = [], smallest
    while n < max_seq_len:
        buckets.append(n)
        n *= 2
    return (*buckets, max_seq_len)


def bucket_for(length: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if length <= b:
            return b
    return buckets[-1]


def _padded_length(features: Features, rows: np.ndarray, buckets: tuple[int, ...]) -> int:
    return bucket_for(max(len(features.input_ids[r]) for r in rows), buckets)


def planned_train_batches(features: Features, batch_size: int, max_seq_len: int, seed: int,
                          total_steps: int) -> list[tuple[int, np.ndarray]]:
    """The (padded length, rows) of every training step, planned ahead (so every program
    a run needs can be compiled before its first step): epochs in random orders (each
    example once per epoch, from `seed`), cut at `total_steps`."""
    buckets = bucket_lengths(max_seq_len)
    rng = np.random.default_rng(seed)
    plan = []
    while len(plan) < total_steps:
        order = rng.permutation(len(features))
        for start in range(0, len(order), batch_size):
            rows = order[start:start + batch_size]
            plan.append((_padded_length(features, rows, buckets), rows))
            if len(plan) == total_steps:
                break
    return plan


def eval_batches(features: Features, batch_size: int, lengths: tuple[int, ...]) -> Iterator[tuple[int, np.ndarray]]:
    """(padded length, rows) of batches sorted by length (less padding), each padded to the
    first of `lengths` that holds it; the rows let predictions be put back in the original
    order."""
    order = np.argsort(features.lengths, kind="stable")
    for start in range(0, len(order), batch_size):
        rows = order[start:start + batch_size]
        yield _padded_length(features, rows, lengths), rows
