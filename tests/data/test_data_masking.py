"""Dynamic MLM masking: statistics on real Wikipedia batches, whole-word masking, invariants."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import wiki_cfg
from roformer.data import make_pretrain_data
from roformer.data.masking import MlmMasker

pytestmark = pytest.mark.fast   # the fast lane (docs/testing.md)

SEQ_LEN, BATCH = 128, 32


def collect(data, num_batches):
    it = data.train_iterator()
    batches = [next(it) for _ in range(num_batches)]
    return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


def originals(batch):
    ids = batch["input_ids"].copy()
    rows, slots = np.nonzero(batch["masked_weights"])
    ids[rows, batch["masked_positions"][rows, slots]] = batch["masked_labels"][rows, slots]
    return ids


def test_masking_statistics_on_wikipedia(shared_data, wiki_cache):
    data = make_pretrain_data(wiki_cfg(shared_data, wiki_cache), seq_len=SEQ_LEN, batch_size=BATCH, seed=11,
                              show_progress=False)
    batch = collect(data, 120)                                   # ~490k tokens, ~70k predictions
    special = data.tokenizer.is_special
    original = originals(batch)
    weights = batch["masked_weights"].astype(bool)
    rows = np.nonzero(weights)[0]
    positions = batch["masked_positions"][weights]
    labels = batch["masked_labels"][weights]
    candidates = (~special[original]).sum()
    rate = weights.sum() / candidates
    assert abs(rate - 0.15) < 0.005, rate
    # never a special token: not as a label, not at a masked position
    assert not special[labels].any() and not special[original[rows, positions]].any()
    assert (original[rows, positions] == labels).all()
    shown = batch["input_ids"][rows, positions]
    as_mask = np.mean(shown == data.mask_id)
    unchanged = np.mean(shown == labels)
    random = 1.0 - as_mask - unchanged
    assert abs(as_mask - 0.8) < 0.01 and abs(unchanged - 0.1) < 0.01 and abs(random - 0.1) < 0.01
    assert not special[shown[shown != data.mask_id]].any()       # random replacements are real tokens
    # tokens outside the chosen positions are untouched; padding slots are inert
    changed = batch["input_ids"] != original
    changed[rows, positions] = False
    assert not changed.any()
    assert not batch["masked_positions"][~weights].any() and not batch["masked_labels"][~weights].any()
    # positions ascending within each row, no duplicates
    for pos, w in zip(batch["masked_positions"][:200], weights[:200]):
        assert (np.diff(pos[w]) > 0).all()


def test_whole_word_masking_masks_complete_words(shared_data, wiki_cache):
    data = make_pretrain_data(wiki_cfg(shared_data, wiki_cache, whole_word_masking=True), seq_len=SEQ_LEN,
                              batch_size=BATCH, seed=5, show_progress=False)
    batch = collect(data, 30)
    original = originals(batch)
    weights = batch["masked_weights"].astype(bool)
    chosen = np.zeros_like(original, dtype=bool)
    rows = np.nonzero(weights)[0]
    chosen[rows, batch["masked_positions"][weights]] = True
    # a continuation piece is chosen exactly when the token before it is (unless it opens a
    # segment: a document split between rows may start mid-word)
    cont = data.tokenizer.is_continuation[original]
    cont[:, 1:] &= ~data.tokenizer.is_special[original[:, :-1]]
    cont[:, 0] = False
    prev_chosen = np.zeros_like(chosen)
    prev_chosen[:, 1:] = chosen[:, :-1]
    assert (chosen[cont] == prev_chosen[cont]).all()
    assert chosen[cont].sum() > 500                               # multi-piece words were masked
    rate = chosen.sum() / (~data.tokenizer.is_special[original]).sum()
    assert 0.13 < rate <= 0.15
    assert not data.tokenizer.is_special[original[chosen]].any()


def masker(vocab=50, special=(0, 1, 2, 3, 4), continuation=(), P=6, rate=0.15, whole_word=False):
    is_special = np.zeros(vocab, dtype=bool)
    is_special[list(special)] = True
    is_cont = np.zeros(vocab, dtype=bool)
    is_cont[list(continuation)] = True
    return MlmMasker(is_special=is_special, is_continuation=is_cont, mask_id=4, mask_rate=rate,
                     max_predictions=P, whole_word=whole_word)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), length=st.integers(8, 40), batch=st.integers(1, 4),
       P=st.integers(1, 12), rate=st.floats(0.05, 0.5), whole_word=st.booleans())
def test_masking_invariants(seed, length, batch, P, rate, whole_word):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 50, size=(batch, length)).astype(np.int32)
    out = masker(continuation=range(40, 50), P=P, rate=rate, whole_word=whole_word)(ids, rng)
    w = out["masked_weights"].astype(bool)
    candidates = (ids > 4).sum(axis=1)
    target = np.where(candidates > 0, np.minimum(P, np.maximum(1, np.floor(candidates * rate + 0.5))), 0)
    if whole_word:
        assert (w.sum(axis=1) <= target).all()
    else:
        assert (w.sum(axis=1) == target).all()
    assert (w[:, :-1] >= w[:, 1:]).all()                          # real slots first
    for b in range(batch):
        pos = out["masked_positions"][b][w[b]]
        assert (np.diff(pos) > 0).all() and (ids[b, pos] > 4).all()
        assert (out["masked_labels"][b][w[b]] == ids[b, pos]).all()
        keep = np.ones(length, dtype=bool)
        keep[pos] = False
        assert (out["input_ids"][b, keep] == ids[b, keep]).all()


def test_masking_is_deterministic_and_rejects_bad_settings():
    ids = np.random.default_rng(0).integers(5, 50, size=(4, 32)).astype(np.int32)
    m = masker()
    a, b = m(ids, np.random.default_rng([1, 2])), m(ids, np.random.default_rng([1, 2]))
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])
    with pytest.raises(ValueError, match="data.mask_rate=1.5"):
        masker(rate=1.5)
    with pytest.raises(ValueError, match="data.max_predictions_per_seq=0"):
        masker(P=0)
    only_special = np.zeros((2, 16), dtype=np.int32)
    assert not m(only_special, np.random.default_rng(0))["masked_weights"].any()
