"""GLUE featurisation (against transformers' BERT tokenizer on real rows), length
buckets and batches, and the leaderboard submission files."""
import zipfile

import numpy as np
import pytest

from helpers import needs_transformers
from roformer.data.tokenizer import load_tokenizer
from roformer.glue.features import bucket_lengths, eval_batches, featurize, pair_encoder, planned_train_batches
from roformer.glue.readers import Example, read_split
from roformer.glue.submission import SUBMISSION_FILES, write_predictions, zip_submission
from roformer.glue.tasks import TASKS

pytestmark = pytest.mark.fast   # the fast lane (docs/testing.md)


@pytest.fixture(scope="module")
def vocab(shared_data):
    return str(shared_data / "vocab" / "bert-base-uncased-vocab.txt")


@pytest.fixture(scope="module")
def tokenizer(vocab):
    return load_tokenizer(vocab)


@needs_transformers
@pytest.mark.parametrize("task", ["mrpc", "stsb", "sst2", "wnli"])
def test_features_equal_transformers_bert_tokenizer(shared_data, vocab, tokenizer, task):
    """[CLS] a [SEP] b [SEP], token types and longest-first truncation, id for id."""
    from transformers import BertTokenizer

    hf = BertTokenizer(vocab, do_lower_case=True)
    examples = read_split(TASKS[task], "validation", data_dir=shared_data / "glue")[:120]
    for max_len in (9, 24, 33, 128):
        feats = featurize(examples, tokenizer, max_len)
        for e, ids, types in zip(examples, feats.input_ids, feats.token_type_ids):
            want = hf(e.text_a, e.text_b, truncation="longest_first", max_length=max_len)
            assert ids.tolist() == want["input_ids"], (task, max_len, e)
            assert types.tolist() == want["token_type_ids"], (task, max_len, e)


def python_features(examples, tokenizer, max_seq_len):
    """GLUE's features as they were assembled in Python before the tokenizer's own template
    and truncation did it: the reference the Rust path must equal."""
    def truncated(a, b, budget):    # longest first: cut the longer; halves when both are long
        if b is None:
            return a[:budget], None
        if len(a) + len(b) <= budget:
            return a, b
        if len(a) > len(b):
            keep_b = min(len(b), budget // 2)
            return a[:budget - keep_b], b[:keep_b]
        keep_a = min(len(a), budget // 2)
        return a[:keep_a], b[:budget - keep_a]

    ids, types = [], []
    for e in examples:
        a = tokenizer.encode_ids([e.text_a])[0]
        b = None if e.text_b is None else tokenizer.encode_ids([e.text_b])[0]
        a, b = truncated(a, b, max_seq_len - (2 if b is None else 3))
        seq = [tokenizer.cls_id, *a, tokenizer.sep_id] + ([] if b is None else [*b, tokenizer.sep_id])
        ids.append(seq)
        types.append([0] * (len(a) + 2) + ([] if b is None else [1] * (len(b) + 1)))
    return ids, types


@pytest.mark.parametrize("task, split", [("cola", "validation"), ("sst2", "validation"), ("mrpc", "train"),
                                         ("stsb", "validation"), ("qnli", "validation"), ("wnli", "train")])
def test_the_tokenizers_template_and_truncation_give_the_python_assembled_features(shared_data, tokenizer,
                                                                                  task, split):
    """On real rows of single-sentence and pair tasks, at lengths that cut most pairs (both
    halves, or only the longer text) and at one that cuts few: the same ids and token types."""
    examples = read_split(TASKS[task], split, data_dir=shared_data / "glue")[:300]
    for max_len in (8, 17, 40, 128):
        want_ids, want_types = python_features(examples, tokenizer, max_len)
        feats = featurize(examples, tokenizer, max_len)
        assert [x.tolist() for x in feats.input_ids] == want_ids, (task, max_len)
        assert [x.tolist() for x in feats.token_type_ids] == want_types, (task, max_len)
    full = python_features(examples, tokenizer, 512)[0]
    assert sum(len(ids) > 17 for ids in full) > 10       # rows 17 had to cut were among them
    if task == "qnli":
        assert sum(len(ids) > 40 for ids in full) > 50      # and many long pairs: both texts cut


def test_the_pair_encoder_leaves_the_callers_tokenizer_as_it_was(tokenizer):
    """Truncation and the template are set on a copy: the tokenizer a run saves with its
    models encodes at full length as before."""
    text = " ".join(["word"] * 50)
    before = tokenizer.tokenizer.to_str()
    assert len(pair_encoder(tokenizer, 16).encode(text, text).ids) == 16
    assert tokenizer.tokenizer.to_str() == before
    assert len(tokenizer.encode(text).ids) == 52


def test_buckets_and_batches(tokenizer):
    examples = [Example(i, "word " * n, "other " * (n // 2) if i % 2 else None, i % 3)
                for i, n in enumerate([1, 3, 9, 20, 40, 70, 2, 5, 11, 90])]
    feats = featurize(examples, tokenizer, 64)
    assert bucket_lengths(64) == (16, 32, 64) and bucket_lengths(128) == (16, 32, 64, 128)
    assert feats.lengths.max() == 64  # truncated to max_seq_len
    seen = []
    plan = planned_train_batches(feats, 4, 64, seed=0, total_steps=3)   # one epoch of 10 rows
    for length, rows in plan:
        batch = feats.batch(rows, 4, length, tokenizer.pad_id)
        assert batch["input_ids"].shape == (4, length) and length in (16, 32, 64)
        assert length == bucket_lengths(64)[np.searchsorted(bucket_lengths(64), feats.lengths[rows].max())]
        real = batch["weights"] > 0
        assert np.all(batch["attention_mask"][~real] == 0) and np.all(batch["lengths"] >= 1)
        assert np.array_equal(batch["attention_mask"] == 1, batch["input_ids"] != 0)
        assert np.array_equal(batch["lengths"][real], batch["attention_mask"][real].sum(axis=1))
        seen += batch["labels"][real].tolist()
    assert sorted(seen) == sorted(feats.labels.tolist())  # one epoch = every example once
    assert len(planned_train_batches(feats, 4, 64, seed=0, total_steps=7)) == 7   # into a third epoch
    rows_seen = []
    for length, rows in eval_batches(feats, 4, bucket_lengths(64)):
        batch = feats.batch(rows, 4, length, tokenizer.pad_id)
        for i, r in enumerate(rows):
            n = len(feats.input_ids[r])
            assert batch["input_ids"][i, :n].tolist() == feats.input_ids[r].tolist()
        rows_seen += rows.tolist()
    assert sorted(rows_seen) == list(range(len(feats)))


def test_submission_files(tmp_path):
    out = tmp_path / "submission"
    idx = np.array([2, 0, 1])
    write_predictions(out, TASKS["mnli"], "test_matched", idx, np.array([2, 0, 1]))
    write_predictions(out, TASKS["ax"], "test", idx, np.array([1, 1, 0]))
    write_predictions(out, TASKS["rte"], "test", idx, np.array([1, 0, 0]))
    write_predictions(out, TASKS["stsb"], "test", idx, np.array([5.7, -0.2, 2.34567]))
    write_predictions(out, TASKS["cola"], "test", idx, np.array([1, 0, 1]))
    read = lambda name: (out / name).read_text().splitlines()  # noqa: E731
    assert read("MNLI-m.tsv") == ["index\tprediction", "0\tentailment", "1\tneutral",
                                  "2\tcontradiction"]
    assert read("AX.tsv")[1:] == ["0\tneutral", "1\tentailment", "2\tneutral"]
    assert read("RTE.tsv")[1:] == ["0\tentailment", "1\tentailment", "2\tnot_entailment"]
    assert read("STS-B.tsv")[1:] == ["0\t0.000", "1\t2.346", "2\t5.000"]
    assert read("CoLA.tsv")[1:] == ["0\t0", "1\t1", "2\t1"]
    zip_path = zip_submission(out, tmp_path / "submission.zip")
    with zipfile.ZipFile(zip_path) as zf:
        assert sorted(zf.namelist()) == sorted(["MNLI-m.tsv", "AX.tsv", "RTE.tsv", "STS-B.tsv",
                                                "CoLA.tsv"])
        assert zf.read("RTE.tsv").decode().startswith("index\tprediction\n")
    assert set(SUBMISSION_FILES) >= {"MNLI-mm.tsv", "QQP.tsv", "WNLI.tsv", "SST-2.tsv"}


def test_the_submission_says_which_files_an_earlier_run_left(tmp_path, caplog):
    """A second run into the same workdir zips the first run's files too (another model's
    predictions): the summary and a warning name them."""
    import os
    import time

    from roformer.glue.submission import finish_submission

    out = tmp_path / "submission"
    idx = np.array([0, 1])
    write_predictions(out, TASKS["wnli"], "test", idx, np.array([1, 0]))       # the earlier run's
    os.utime(out / "WNLI.tsv", (time.time() - 600, time.time() - 600))
    started = time.time()
    write_predictions(out, TASKS["cola"], "test", idx, np.array([1, 0]))       # this run's
    summary = finish_submission(out, tmp_path / "submission.zip", started)
    assert summary["from_earlier_runs"] == ["WNLI.tsv"]
    assert "WNLI.tsv" not in summary["missing_files"] and "SST-2.tsv" in summary["missing_files"]
    with zipfile.ZipFile(summary["zip"]) as zf:
        assert sorted(zf.namelist()) == ["CoLA.tsv", "WNLI.tsv"]
    assert "holds WNLI.tsv from an earlier run" in caplog.text


def test_stacked_padded_rows_are_the_batches_at_the_longest_length():
    from roformer.glue.features import Features, PaddedRows

    rng = np.random.default_rng(0)
    ids = [rng.integers(5, 50, n).astype(np.int32) for n in (3, 17, 9, 32, 5)]
    feats = Features(ids, [np.arange(len(x)) % 2 for x in ids], np.arange(5, dtype=np.float32) / 4, np.arange(5))
    padded = PaddedRows.of(feats, 32, pad_id=7)
    batches = [np.array([4, 1, 0]), np.array([3]), np.array([], np.int64)]   # full, short, empty (no step)
    stacked = padded.stacked(batches, batch_size=3)
    assert stacked["input_ids"].shape == (3, 3, 32) and stacked["weights"].shape == (3, 3)
    for i, rows in enumerate(batches):
        for length in (16, 32):
            if len(rows) and max(len(ids[r]) for r in rows) > length:
                continue
            want = feats.batch(rows, 3, length, pad_id=7)
            assert stacked["input_ids"][i, :, length:].tolist() == np.full((3, 32 - length), 7).tolist()
            for key in ("input_ids", "token_type_ids"):
                np.testing.assert_array_equal(stacked[key][i, :, :length], want[key])
            for key in ("lengths", "labels", "weights"):
                np.testing.assert_array_equal(stacked[key][i], want[key])
                assert stacked[key].dtype == want[key].dtype
    with pytest.raises(ValueError, match="more than the padded length"):
        PaddedRows.of(feats, 16, pad_id=0)


def test_packed_rows_hold_each_example_whole_in_its_own_segment_from_position_zero():
    from roformer.glue.features import Features, PaddedRows, pack_rows, row_buckets

    rng = np.random.default_rng(0)
    ids = [rng.integers(5, 50, n).astype(np.int32) for n in (3, 17, 9, 32, 5, 29)]
    feats = Features(ids, [np.arange(len(x)) % 2 for x in ids], np.arange(6, dtype=np.int32), np.arange(6))
    padded = PaddedRows.of(feats, 32, pad_id=7)
    # first fit, longest first: 32 | 29 | 17 + 9 + 5, then 3 in the first row with room (29's)
    row, offset, used = pack_rows(feats.lengths[[0, 1, 2, 3, 4, 5]], 32)
    assert used == 3 and row.tolist() == [1, 2, 2, 0, 2, 1] and offset.tolist() == [29, 0, 17, 0, 26, 0]
    batches = [np.array([0, 1, 2, 3, 4, 5]), np.array([2]), np.array([], np.int64)]   # full, short, a padding step
    packed = padded.packed(batches, batch_size=6, rows=4, width=32)
    assert packed["input_ids"].shape == (3, 4, 32) and packed["cls_index"].shape == (3, 6)
    for step, examples in enumerate(batches):
        seen = 0
        for i, example in enumerate(examples):
            n, start = len(ids[example]), packed["cls_index"][step, i]
            r, o = divmod(int(start), 32)
            np.testing.assert_array_equal(packed["input_ids"][step, r, o:o + n], ids[example])
            np.testing.assert_array_equal(packed["token_type_ids"][step, r, o:o + n], np.arange(n) % 2)
            np.testing.assert_array_equal(packed["positions"][step, r, o:o + n], np.arange(n))
            assert (packed["segment_ids"][step, r, o:o + n] == i + 1).all()
            seen += n
        assert (packed["segment_ids"][step] > 0).sum() == seen                  # the rest is padding
        assert (packed["input_ids"][step][packed["segment_ids"][step] == 0] == 7).all()
        np.testing.assert_array_equal(packed["weights"][step], np.arange(6) < len(examples))
        np.testing.assert_array_equal(packed["labels"][step, :len(examples)], feats.labels[examples])
    with pytest.raises(ValueError, match="packed rows"):
        padded.packed(batches, batch_size=6, rows=2, width=32)
    assert row_buckets(32) == (1, 2, 4, 8, 12, 16, 20, 24, 28, 32)
    assert row_buckets(8) == tuple(range(1, 9)) and row_buckets(20) == (1, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20)
