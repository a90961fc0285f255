"""Packed batches from real Wikipedia shards: format, packing invariants, determinism, resume, splits."""
import json

import numpy as np
import pytest

from helpers import cache_entries, wiki_cfg
from roformer.data import DataConfig, make_pretrain_data
from roformer.data.packing import plan_rows
from roformer.data.pipeline import batch_format

SEQ_LEN, BATCH = 128, 16


@pytest.fixture(scope="module")
def data(shared_data, wiki_cache):
    return make_pretrain_data(wiki_cfg(shared_data, wiki_cache), seq_len=SEQ_LEN, batch_size=BATCH, seed=3,
                              show_progress=False)


def unmasked(batch):
    ids = batch["input_ids"].copy()
    rows, slots = np.nonzero(batch["masked_weights"])
    ids[rows, batch["masked_positions"][rows, slots]] = batch["masked_labels"][rows, slots]
    return ids


def test_batch_format(data):
    batch = next(data.train_iterator())
    P = round(0.15 * SEQ_LEN) + 1
    shapes = {"input_ids": (BATCH, SEQ_LEN), "token_type_ids": (BATCH, SEQ_LEN), "positions": (BATCH, SEQ_LEN),
              "segment_ids": (BATCH, SEQ_LEN), "masked_positions": (BATCH, P), "masked_labels": (BATCH, P),
              "masked_weights": (BATCH, P)}
    assert {k: v.shape for k, v in batch.items()} == shapes
    assert {k: v.dtype.name for k, v in batch.items()} == {
        **{k: "int32" for k in shapes}, "masked_weights": "float32"}
    assert not batch["token_type_ids"].any()
    assert data.manifest["train_docs"] + data.manifest["heldout_docs"] == data.manifest["num_docs"]
    assert (data.pad_id, data.cls_id, data.sep_id, data.mask_id, data.vocab_size) == (0, 101, 102, 103, 30522)
    json.dumps(data.manifest)


def check_rows(batch, cls_id, sep_id, max_segments=None):
    """Every segment is [CLS] ... [SEP] with positions 0..n-1; padding only at the end."""
    for ids, pos, seg in zip(unmasked(batch), batch["positions"], batch["segment_ids"]):
        real = seg > 0
        n_real = int(real.sum())
        assert real[:n_real].all() and not ids[n_real:].any() and not pos[n_real:].any()
        boundaries = np.flatnonzero(np.diff(seg[:n_real])) + 1
        starts = np.concatenate([[0], boundaries])
        ends = np.concatenate([boundaries, [n_real]])
        assert seg[starts].tolist() == list(range(1, len(starts) + 1))
        if max_segments:
            assert len(starts) <= max_segments
        for s, e in zip(starts, ends):
            assert ids[s] == cls_id and ids[e - 1] == sep_id and e - s >= 3
            assert pos[s:e].tolist() == list(range(e - s))
            inner = ids[s + 1:e - 1]
            assert not np.isin(inner, [cls_id, sep_id, 0]).any()


def test_packed_rows_are_well_formed_and_dense(data):
    it = data.train_iterator()
    batches = [next(it) for _ in range(8)]
    for batch in batches:
        check_rows(batch, data.cls_id, data.sep_id)
    fill = np.mean([(b["segment_ids"] > 0).mean() for b in batches])
    assert fill > 0.97                                     # packing leaves little padding
    assert max(b["segment_ids"].max() for b in batches) > 1


def test_rows_hold_exactly_the_document_tokens(data):
    plan = data.epoch_plan(0)
    rows = data.rows(plan, 0, 40)
    pieces = np.flatnonzero(plan.row < 40)
    content = rows["input_ids"][(rows["segment_ids"] > 0) & ~np.isin(rows["input_ids"], [101, 102])]
    expected = np.concatenate([data.corpus.gather(plan.doc[[p]], plan.offset[[p]], plan.length[[p]])
                               for p in pieces])
    assert content.tolist() == expected.tolist()
    # each training document is laid out completely, in pieces that tile it
    first_doc = plan.doc[0]
    mine = plan.doc == first_doc
    assert plan.offset[mine][0] == 0 and plan.length[mine].sum() == data.corpus.doc_len[first_doc]


def test_document_mode_one_document_per_row(shared_data, wiki_cache):
    data = make_pretrain_data(wiki_cfg(shared_data, wiki_cache, packing="document"), seq_len=64, batch_size=8,
                              seed=0, show_progress=False)
    it = data.train_iterator()
    for _ in range(4):
        batch = next(it)
        check_rows(batch, data.cls_id, data.sep_id, max_segments=1)
        # right padding as lengths, the form attention kernels take without a mask
        assert np.array_equal(np.arange(64)[None, :] < batch["lengths"][:, None], batch["segment_ids"] != 0)
    plan = data.epoch_plan(0)
    assert len(np.unique(plan.row)) == len(plan.row)       # one piece per row
    assert plan.length.max() == 62


def test_batch_format_is_what_the_pipeline_makes(data, shared_data, wiki_cache):
    """The config-only format a step is compiled for ahead of the data (roformer.launch_check)
    is the real batches': names, shapes and dtypes, packed and one document per row."""
    def described(batch):
        return {k: (tuple(v.shape), np.dtype(v.dtype)) for k, v in batch.items()}
    expected = batch_format(wiki_cfg(shared_data, wiki_cache), seq_len=SEQ_LEN, batch_size=BATCH)
    assert described(next(data.train_iterator())) == described(expected)
    document = wiki_cfg(shared_data, wiki_cache, packing="document", max_predictions_per_seq=7)
    rows = make_pretrain_data(document, seq_len=64, batch_size=8, seed=0, show_progress=False)
    assert described(rows.eval_batches(1)[0]) == described(batch_format(document, seq_len=64, batch_size=8))


def test_plan_splits_long_documents_and_packs_short_ones():
    doc_len = np.array([3, 300, 5, 1])
    packed = plan_rows(np.arange(4), doc_len, 32, "packed")
    assert packed.length.sum() == doc_len.sum()
    assert packed.num_rows == 11 and (packed.col + packed.length + 2 <= 32).all()
    document = plan_rows(np.arange(4), doc_len, 32, "document")
    assert document.num_rows == 1 + 10 + 1 + 1 and (document.col == 0).all()
    with pytest.raises(ValueError, match="data.packing='greedy'"):
        plan_rows(np.arange(4), doc_len, 32, "greedy")


def test_same_seed_same_batches_other_seed_differs(data, shared_data, wiki_cache):
    twin = make_pretrain_data(wiki_cfg(shared_data, wiki_cache), seq_len=SEQ_LEN, batch_size=BATCH, seed=3,
                              show_progress=False)
    other = make_pretrain_data(wiki_cfg(shared_data, wiki_cache), seq_len=SEQ_LEN, batch_size=BATCH, seed=4,
                               show_progress=False)
    a, b, c = data.train_iterator(), twin.train_iterator(), other.train_iterator()
    for _ in range(3):
        x, y, z = next(a), next(b), next(c)
        for key in x:
            np.testing.assert_array_equal(x[key], y[key])
        assert not np.array_equal(x["input_ids"], z["input_ids"])


def test_state_restores_the_exact_stream_across_epochs(shared_data, wiki_cache):
    # the small embedded corpus: an epoch is about 15 batches of 16 x 512
    cfg = DataConfig(source="embedded", vocab=str(shared_data / "vocab" / "bert-base-uncased-vocab.txt"),
                     cache_dir=str(wiki_cache), heldout_fraction=0.1)
    data = make_pretrain_data(cfg, seq_len=512, batch_size=16, seed=7, show_progress=False)
    rows_per_epoch = data.epoch_plan(0).num_rows
    steps = 2 * rows_per_epoch // 16 + 3                   # crosses two epoch boundaries
    it = data.train_iterator()
    reference, states = [], []
    for _ in range(steps):
        states.append(json.loads(json.dumps(it.get_state())))
        reference.append(next(it))
    assert it.get_state()["epoch"] == 2
    for k in (1, rows_per_epoch // 16, steps - 2):
        resumed = make_pretrain_data(cfg, seq_len=512, batch_size=16, seed=7, show_progress=False).train_iterator()
        resumed.set_state(states[k])
        for want in reference[k:k + 3]:
            got = next(resumed)
            for key in want:
                np.testing.assert_array_equal(got[key], want[key])
    with pytest.raises(ValueError, match="seed"):
        make_pretrain_data(cfg, seq_len=512, batch_size=16, seed=8, show_progress=False
                           ).train_iterator().set_state(states[1])
    with pytest.raises(ValueError, match="stream_id"):
        make_pretrain_data(cfg, seq_len=256, batch_size=16, seed=7, show_progress=False
                           ).train_iterator().set_state(states[1])


def test_processes_read_disjoint_documents(shared_data, wiki_cache, data):
    parts = [make_pretrain_data(wiki_cfg(shared_data, wiki_cache), seq_len=SEQ_LEN, batch_size=BATCH, seed=3,
                                process_index=i, process_count=3, show_progress=False) for i in range(3)]
    for epoch in (0, 1):
        docs = [set(p.epoch_plan(epoch).doc.tolist()) for p in parts]
        assert not (docs[0] & docs[1]) and not (docs[0] & docs[2]) and not (docs[1] & docs[2])
        assert set().union(*docs) == set(data.train_docs.tolist())
    first = [next(p.train_iterator())["input_ids"] for p in parts]
    assert not np.array_equal(first[0], first[1])
    with pytest.raises(ValueError, match="process_index=3"):
        make_pretrain_data(wiki_cfg(shared_data, wiki_cache), seq_len=SEQ_LEN, batch_size=BATCH, seed=3,
                           process_index=3, process_count=3, show_progress=False)


def test_heldout_split_by_document_no_leak(data, shared_data, wiki_cache):
    train, held = set(data.train_docs.tolist()), set(data.heldout_docs.tolist())
    assert not train & held and len(train | held) == data.corpus.num_docs
    assert 0.005 < len(held) / data.corpus.num_docs < 0.05    # heldout_fraction 0.02
    # no text shared either (content hashes), and train batches never touch held-out docs
    assert not set(data.corpus.doc_hash[data.train_docs].tolist()) & set(data.corpus.doc_hash[data.heldout_docs].tolist())
    for epoch in range(3):
        assert not set(data.epoch_plan(epoch).doc.tolist()) & held
    # eval batches: held-out tokens only, identical for any training seed, fixed masks
    evals = data.eval_batches(3)
    again = make_pretrain_data(wiki_cfg(shared_data, wiki_cache), seq_len=SEQ_LEN, batch_size=BATCH, seed=99,
                               show_progress=False).eval_batches(3)
    for x, y in zip(evals, again):
        for key in x:
            np.testing.assert_array_equal(x[key], y[key])
        check_rows(x, data.cls_id, data.sep_id)
    held_tokens = set(data.corpus.gather(data.heldout_docs, np.zeros(len(held), dtype=np.int64),
                                         data.corpus.doc_len[data.heldout_docs]).tolist())
    eval_ids = unmasked(evals[0])
    assert set(eval_ids[(evals[0]["segment_ids"] > 0) & (eval_ids > 103)].tolist()) <= held_tokens


def test_bad_settings_raise_clear_errors(shared_data, wiki_cache, tmp_path):
    with pytest.raises(ValueError, match="seq_len=7: must be >= 8"):
        make_pretrain_data(wiki_cfg(shared_data, wiki_cache), seq_len=7, batch_size=2, seed=0)
    with pytest.raises(ValueError, match=r"data.vocab: vocabulary file not found: .*nope\.txt"):
        make_pretrain_data(wiki_cfg(shared_data, wiki_cache, vocab=str(tmp_path / "nope.txt")), seq_len=16,
                           batch_size=2, seed=0)
    with pytest.raises(ValueError, match="matched no files"):
        make_pretrain_data(wiki_cfg(shared_data, wiki_cache, files=str(tmp_path / "*.none")), seq_len=16,
                           batch_size=2, seed=0)
    with pytest.raises(ValueError, match="data.heldout_fraction=1.5"):
        make_pretrain_data(wiki_cfg(shared_data, wiki_cache, heldout_fraction=1.5), seq_len=16, batch_size=2, seed=0,
                           show_progress=False)
    with pytest.raises(ValueError, match="data.packing='rows'"):
        make_pretrain_data(wiki_cfg(shared_data, wiki_cache, packing="rows"), seq_len=16, batch_size=2, seed=0,
                           show_progress=False)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    with pytest.raises(ValueError, match=r"corpus is empty.*empty\.txt"):
        make_pretrain_data(wiki_cfg(shared_data, wiki_cache, files=str(empty)), seq_len=16, batch_size=2, seed=0,
                           show_progress=False)


def test_one_document_corpus_is_refused_with_advice_that_helps(shared_data, tmp_path):
    """The held-out split is by document: a corpus of one long document needs splitting, and a
    larger data.heldout_fraction would not help."""
    one = tmp_path / "one.txt"
    one.write_text("\n".join(f"line {i} of one long document without blank lines." for i in range(300)) + "\n")
    for fraction in (0.02, 0.5, 0.0):
        with pytest.raises(ValueError, match=r"single document \(\d+ tokens\).*blank line") as err:
            make_pretrain_data(wiki_cfg(shared_data, tmp_path / "cache", files=str(one), heldout_fraction=fraction),
                               seq_len=16, batch_size=2, seed=0, show_progress=False)
        assert "raise data.heldout_fraction" not in str(err.value)
    # two documents train: one is held out
    one.write_text(one.read_text() + "\nand a second document.\n")
    data = make_pretrain_data(wiki_cfg(shared_data, tmp_path / "cache", files=str(one)), seq_len=16,
                              batch_size=2, seed=0, show_progress=False)
    assert (len(data.train_docs), len(data.heldout_docs)) == (1, 1) and data.eval_batches(1)
    # too few held-out documents for the processes: there a larger fraction is the advice
    one.write_text(one.read_text() + "\na third document.\n")
    # tokenized here first: a process of two that finds no cache would wait for its peer
    make_pretrain_data(wiki_cfg(shared_data, tmp_path / "cache", files=str(one), heldout_fraction=0.01),
                       seq_len=16, batch_size=2, seed=0, show_progress=False)
    data = make_pretrain_data(wiki_cfg(shared_data, tmp_path / "cache", files=str(one), heldout_fraction=0.01),
                              seq_len=16, batch_size=2, seed=0, process_index=1, process_count=2,
                              show_progress=False)
    with pytest.raises(ValueError, match=r"holds out 1 of the corpus's 3 documents, none for process 1 of 2: "
                                         r"raise data.heldout_fraction"):
        data.eval_batches(1)


def test_embedded_default_trains_its_own_vocabulary(tmp_path):
    cfg = DataConfig(source="embedded", vocab="", vocab_size=2000, cache_dir=str(tmp_path))
    data = make_pretrain_data(cfg, seq_len=64, batch_size=4, seed=0, show_progress=False)
    assert data.vocab_size <= 2000 and data.pad_id == 0 and data.mask_id == 4
    assert len(cache_entries(tmp_path / "tokenizers")) == 1
    again = make_pretrain_data(cfg, seq_len=64, batch_size=4, seed=0, show_progress=False)
    assert again.tokenizer.hash == data.tokenizer.hash                 # cached, not retrained
    check_rows(next(data.train_iterator()), data.cls_id, data.sep_id)


def test_takes_the_data_section_of_configs_base(shared_data, wiki_cache):
    import runpy

    section = runpy.run_path("configs/base.py")["get_config"]()["data"]
    assert DataConfig.from_mapping(section) == DataConfig()          # one source of the defaults
    section.update(vocab=str(shared_data / "vocab" / "bert-base-uncased-vocab.txt"), cache_dir=str(wiki_cache))
    data = make_pretrain_data(DataConfig.from_mapping(section), seq_len=32, batch_size=4, seed=0,
                              show_progress=False)
    batch = next(data.train_iterator())
    assert batch["masked_positions"].shape == (4, round(0.15 * 32) + 1)
    assert len(data.eval_batches(2)) == 2
    with pytest.raises(ValueError, match=r"data\.mask_prob \(did you mean data\.mask_rate\?\)"):
        DataConfig.from_mapping({**section.to_dict(), "mask_prob": 0.2})
    with pytest.raises(TypeError, match=r"DataConfig\.from_mapping\(config\.data\)"):
        make_pretrain_data(section, seq_len=32, batch_size=4, seed=0)


def test_state_survives_a_copied_corpus_but_not_changed_text(shared_data, tmp_path):
    """A saved stream resumes on a copy of the same text (new paths and mtimes, so a new
    token cache) and is refused once the text differs."""
    src = shared_data / "wikipedia_en" / "wiki_07"
    original, copy = tmp_path / "a", tmp_path / "b"
    for d in (original, copy):
        d.mkdir()
        (d / "wiki_07").write_bytes(src.read_bytes())

    def load(folder):
        cfg = wiki_cfg(shared_data, tmp_path / "cache", files=str(folder / "wiki_*"))
        return make_pretrain_data(cfg, seq_len=SEQ_LEN, batch_size=BATCH, seed=3, show_progress=False)

    first = load(original)
    it = first.train_iterator()
    next(it)
    state = json.loads(json.dumps(it.get_state()))
    want = next(it)
    moved = load(copy)
    assert moved.corpus.directory != first.corpus.directory   # a separate cache entry ...
    resumed = moved.train_iterator()
    resumed.set_state(state)                                  # ... but the same stream
    for key, value in next(resumed).items():
        np.testing.assert_array_equal(value, want[key])

    text = (copy / "wiki_07").read_text(encoding="utf-8")
    (copy / "wiki_07").write_text(text.replace(" the ", " a ", 1), encoding="utf-8")
    with pytest.raises(ValueError, match="stream_id"):
        load(copy).train_iterator().set_state(state)


def test_shuffled_eval_batches_permute_tokens_within_pieces_only(data):
    plain, shuffled = data.eval_batches(3), data.eval_batches(3, shuffled=True)
    moved = 0
    for a, b in zip(plain, shuffled):
        for key in ("positions", "segment_ids", "token_type_ids", "masked_labels", "masked_weights"):
            np.testing.assert_array_equal(a[key], b[key])
        special = np.isin(a["input_ids"], [data.cls_id, data.sep_id]) | (a["segment_ids"] == 0)
        np.testing.assert_array_equal(a["input_ids"][special], b["input_ids"][special])
        # Each piece holds the same multiset of tokens, masked ones included ...
        for row in range(len(a["input_ids"])):
            for seg in np.unique(a["segment_ids"][row]):
                in_piece = a["segment_ids"][row] == seg
                assert sorted(a["input_ids"][row, in_piece]) == sorted(b["input_ids"][row, in_piece])
        # ... and the same tokens are predicted: every slot follows its token.
        assert np.all(unmasked(a)[special] == unmasked(b)[special])
        rows, slots = np.nonzero(a["masked_weights"])
        np.testing.assert_array_equal(a["input_ids"][rows, a["masked_positions"][rows, slots]],
                                      b["input_ids"][rows, b["masked_positions"][rows, slots]])
        moved += int((a["input_ids"] != b["input_ids"]).sum())
    assert moved > 0.8 * sum((~np.isin(a["input_ids"], [data.cls_id, data.sep_id]) & (a["segment_ids"] != 0)).sum()
                             for a in plain)
    # Fixed like the plain batches: every run is probed on the same permutation.
    for a, b in zip(shuffled, data.eval_batches(3, shuffled=True)):
        np.testing.assert_array_equal(a["input_ids"], b["input_ids"])


def test_unigram_loss_is_the_entropy_of_training_token_frequencies(data):
    counts = np.zeros(data.vocab_size)
    for doc in data.train_docs:
        tokens = data.corpus.gather(np.array([doc]), np.array([0]), data.corpus.doc_len[[doc]])
        counts += np.bincount(tokens, minlength=data.vocab_size)
    counts[data.tokenizer.is_special] = 0
    p = counts[counts > 0] / counts.sum()
    assert data.unigram_loss() == pytest.approx(float(-(p * np.log(p)).sum()), rel=1e-9)
    assert 0 < data.unigram_loss() < np.log(data.vocab_size)
