"""Packing documents into fixed-length `[CLS] ... [SEP]` rows.

A plan lists *pieces*: a run of one document's tokens placed at a column of a row,
wrapped in its own [CLS]/[SEP]. Two modes:
  packed    pieces of several documents share a row (segment ids 1..n, positions
            restarting at 0 per piece, so rotary/relative schemes see true offsets);
            a document longer than the room left is split, and the rest continues
            in the next row
  document  one piece per row; long documents are split over several rows, the last
            row padded
The plan is a small array table computed once per epoch (one Python step per
piece); building a batch of rows from it is vectorised numpy.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from roformer.data.shards import TokenCorpus
from roformer.errors import ConfigError

PACKINGS = ("packed", "document")
# Packed mode starts a new row rather than leave a piece shorter than this
# (including its [CLS]/[SEP]) at the end of one.
MIN_PIECE = 8


@dataclasses.dataclass(frozen=True)
class PackPlan:
    """Pieces sorted by row; `num_rows` rows of length `seq_len`."""

    seq_len: int
    num_rows: int
    row: np.ndarray      # int64 [pieces]
    col: np.ndarray      # int32 [pieces]  column of the piece's [CLS]
    doc: np.ndarray      # int64 [pieces]  document index in the corpus
    offset: np.ndarray   # int64 [pieces]  first token inside the document
    length: np.ndarray   # int64 [pieces]  tokens, excluding [CLS]/[SEP]


def plan_rows(doc_order: np.ndarray, doc_len: np.ndarray, seq_len: int, packing: str) -> PackPlan:
    """Lays out the documents, in the given order, into rows."""
    if packing not in PACKINGS:
        raise ConfigError(f"data.packing={packing!r}: expected one of {PACKINGS}")
    room = seq_len - 2
    rows, cols, docs, offsets, lengths = [], [], [], [], []
    row, col = 0, 0
    packed = packing == "packed"
    for doc, n in zip(doc_order.tolist(), doc_len[doc_order].tolist()):
        offset = 0
        while offset < n:
            if not packed or seq_len - col < MIN_PIECE:
                if col:
                    row, col = row + 1, 0
            take = min(n - offset, seq_len - col - 2 if packed else room)
            rows.append(row)
            cols.append(col)
            docs.append(doc)
            offsets.append(offset)
            lengths.append(take)
            offset += take
            col += take + 2
            if col >= seq_len:
                row, col = row + 1, 0
    num_rows = row + (1 if col else 0)
    return PackPlan(seq_len, num_rows, np.array(rows, dtype=np.int64), np.array(cols, dtype=np.int32),
                    np.array(docs, dtype=np.int64), np.array(offsets, dtype=np.int64),
                    np.array(lengths, dtype=np.int64))


def build_rows(plan: PackPlan, corpus: TokenCorpus, lo: int, hi: int, *, cls_id: int, sep_id: int,
               pad_id: int) -> dict[str, np.ndarray]:
    """input_ids / positions / segment_ids [hi - lo, seq_len] of plan rows lo..hi-1."""
    L = plan.seq_len
    first, last = np.searchsorted(plan.row, [lo, hi])
    row, col = plan.row[first:last] - lo, plan.col[first:last].astype(np.int64)
    length = plan.length[first:last]
    num = hi - lo
    input_ids = np.full(num * L, pad_id, dtype=np.int32)
    positions = np.zeros(num * L, dtype=np.int32)
    segment_ids = np.zeros(num * L, dtype=np.int32)
    start = row * L + col                        # flat index of each piece's [CLS]
    span = length + 2
    # Every slot a piece covers: its flat index and its offset from the piece start.
    span_start = np.cumsum(span) - span
    within = np.arange(int(span.sum()), dtype=np.int64) - np.repeat(span_start, span)
    flat = np.repeat(start, span) + within
    positions[flat] = within
    # Segment id = 1 + rank of the piece within its row.
    row_first_piece = np.searchsorted(row, row)  # row is sorted: index of the row's first piece
    segment = np.arange(len(row)) - row_first_piece + 1
    segment_ids[flat] = np.repeat(segment, span).astype(np.int32)
    tokens = corpus.gather(plan.doc[first:last], plan.offset[first:last], length)
    content = np.ones(len(flat), dtype=bool)
    content[span_start] = False
    content[span_start + span - 1] = False
    input_ids[flat[content]] = tokens
    input_ids[start] = cls_id
    input_ids[start + span - 1] = sep_id
    shape = (num, L)
    return {"input_ids": input_ids.reshape(shape), "positions": positions.reshape(shape),
            "segment_ids": segment_ids.reshape(shape)}
