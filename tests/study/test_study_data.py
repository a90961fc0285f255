"""The study's data (roformer/study/data.py, and its pack as roformer/study/session.py makes
it): masking on the device, the order variants, the document splits and test items, and the pack."""
import json
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers.study import config
from roformer import config_files as plan
from roformer.cli import load_config
from roformer.data.masking import mask_rows_on_device
from roformer.errors import ConfigError
from roformer.study import data as study_data
from roformer.study import plan as study_plan
from roformer.study import session as study


def test_device_masking_follows_the_pipelines_rule():
    rng = np.random.default_rng(0)
    special = np.zeros(50, bool)
    special[:5] = True
    ids = rng.integers(5, 50, size=(64, 40)).astype(np.int32)
    ids[:, 0], ids[:, -1] = 2, 3          # [CLS], [SEP]
    segments = np.ones_like(ids)
    segments[:, 30:] = 0                  # padding
    out = mask_rows_on_device(jax.random.key(0), {"input_ids": jnp.asarray(ids), "positions": jnp.zeros_like(ids),
                                                   "segment_ids": jnp.asarray(segments)},
                               special=jnp.asarray(special), replacement_ids=jnp.arange(5, 50), mask_id=4,
                               mask_rate=0.15, max_predictions=7)
    positions, weights = np.asarray(out["masked_positions"]), np.asarray(out["masked_weights"])
    candidates = (~special[ids] & (segments != 0)).sum(1)
    np.testing.assert_array_equal(weights.sum(1), np.minimum(7, np.floor(candidates * 0.15 + 0.5)))
    chosen = positions[weights > 0]
    assert not special[ids[np.nonzero(weights > 0)[0], chosen]].any() and (chosen < 30).all()
    np.testing.assert_array_equal(np.asarray(out["masked_labels"])[weights > 0], ids[np.nonzero(weights > 0)[0], chosen])
    masked_ids = np.asarray(out["input_ids"])[np.nonzero(weights > 0)[0], chosen]
    assert 0.7 < (masked_ids == 4).mean() < 0.9
    rows = np.nonzero(weights > 0)[0]
    assert all(np.all(np.diff(positions[r][weights[r] > 0]) > 0) for r in set(rows))   # ascending slots


def test_order_variants_move_every_token_within_its_window_of_content_tokens():
    rng = np.random.default_rng(1)
    L = 32
    ids = rng.permutation(np.arange(10, 10 + 6 * L)).reshape(6, L).astype(np.int32)   # all distinct
    positions = np.tile(np.arange(L), (6, 1))
    ids[:, 0], ids[:, -1] = 2, 3
    segments = np.ones_like(ids)
    slots = np.stack([np.sort(rng.permutation(np.arange(1, L - 1))[:5]) for _ in range(6)]).astype(np.int32)
    batch = {"input_ids": ids, "positions": positions, "segment_ids": segments, "masked_positions": slots,
             "masked_labels": np.take_along_axis(ids, slots, 1), "masked_weights": np.ones((6, 5), np.float32)}
    variants = study_data.order_variants(batch, [2, 4, 32], 2, 3, 0, [7])
    for name, w in (("shuffle2", 2), ("shuffle4", 4), ("shuffle32", 32)):
        new = variants[name]["input_ids"]
        # windows of w tokens from the first one after [CLS]: the same tokens in each, every
        # token moved (the last window of 30 % 4 = 2 tokens too), [CLS] and [SEP] in place
        for lo in range(1, L - 1, w):
            hi = min(lo + w, L - 1)
            np.testing.assert_array_equal(np.sort(new[:, lo:hi], 1), np.sort(ids[:, lo:hi], 1))
        assert (new[:, 1:-1] != ids[:, 1:-1]).all()
        assert (new[:, 0] == 2).all() and (new[:, -1] == 3).all()
        # the predicted tokens follow their slots
        np.testing.assert_array_equal(np.take_along_axis(new, variants[name]["masked_positions"], 1),
                                      np.take_along_axis(ids, slots, 1))
    np.testing.assert_array_equal(variants["reverse"]["input_ids"][:, 1:-1], ids[:, 1:-1][:, ::-1])
    # each window length draws from its own generator: the same variant whatever else is asked
    alone = study_data.order_variants(batch, [4], 2, 3, 0, [7])
    np.testing.assert_array_equal(alone["shuffle4"]["input_ids"], variants["shuffle4"]["input_ids"])
    # a random cycle, not a fixed one: two draws of the same windows differ
    other = study_data.order_variants(batch, [32], 2, 3, 0, [8])
    assert (other["shuffle32"]["input_ids"] != variants["shuffle32"]["input_ids"]).any()


def test_order_variants_count_windows_within_each_packed_piece():
    """Two documents in a row, each from its [CLS]: a window never spans them, and a
    document's first content token moves at w=2 (windows counted from it, not from [CLS])."""
    ids = np.array([[2, 10, 11, 12, 13, 3, 2, 20, 21, 22, 3, 0]], np.int32)
    positions = np.array([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 0]])
    segments = np.array([[1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 0]])
    slots = np.array([[1, 7]], np.int32)
    batch = {"input_ids": ids, "positions": positions, "segment_ids": segments, "masked_positions": slots,
             "masked_labels": np.take_along_axis(ids, slots, 1), "masked_weights": np.ones((1, 2), np.float32)}
    new = study_data.order_variants(batch, [2], 2, 3, 0, [0])["shuffle2"]
    np.testing.assert_array_equal(new["input_ids"], [[2, 11, 10, 13, 12, 3, 2, 21, 20, 22, 3, 0]])
    np.testing.assert_array_equal(new["masked_positions"], [[2, 8]])


def test_a_pack_made_with_other_settings_is_made_again_and_one_up_to_date_is_kept(tmp_path, capsys, monkeypatch):
    path = tmp_path / "pack.npz"
    config = load_config(f"{plan.CONFIG_DIR / 'study.py'}:gpu_smoke")
    made = []
    monkeypatch.setattr(study, "study_splits", lambda config: made.append(1) or SimpleNamespace(manifest={}))
    monkeypatch.setattr(study_data, "save_pack", lambda data, where, key: np.savez(
        where, meta=np.asarray(json.dumps({"key": key, "tokenizer": "{}"}))))
    assert study_data.pack_key(path) is None
    assert "up to date" not in study.make_pack(config, path) and made == [1]
    assert study_data.pack_key(path) == study.data_key(config)
    assert "up to date" in study.make_pack(config, path) and made == [1]
    np.savez(path, meta=np.asarray(json.dumps({"key": "made before the order variants changed", "tokenizer": "{}"})))
    assert "up to date" not in study.make_pack(config, path) and made == [1, 1]
    # one of these settings made before packs held the tokenizer (which kept members need)
    np.savez(path, meta=np.asarray(json.dumps({"key": study.data_key(config)})))
    assert "up to date" not in study.make_pack(config, path) and made == [1, 1, 1]


def test_splits_are_disjoint_documents():
    hashes = np.random.default_rng(0).integers(0, 2**64, size=5000, dtype=np.uint64)
    split = study_data.split_documents(hashes, 0.08, 0.02)
    assert 0.06 < (split == 2).mean() < 0.10 and 0.01 < (split == 1).mean() < 0.03
    np.testing.assert_array_equal(split, study_data.split_documents(hashes, 0.08, 0.02))


def test_a_test_item_is_a_document_with_the_rows_most_of_whose_tokens_are_its():
    """Rows cut from one long document form one item (what the bootstrap resamples), each with
    all its mask draws; a row packed from pieces goes with its longest piece's document."""
    from roformer.data.packing import plan_rows

    doc_len = np.array([300, 40, 90, 500, 20])
    plan = plan_rows(np.arange(5), doc_len, 128, "packed")
    main = study_data.main_documents(plan)
    assert len(main) == plan.num_rows
    for row, doc in enumerate(main):
        pieces = plan.row == row
        assert plan.length[pieces][plan.doc[pieces] == doc].max() == plan.length[pieces].max()
    assert list(main).count(0) >= 2 and list(main).count(3) >= 3   # the long documents span rows
    c = config()
    data = study.study_splits(study_plan.build_plan(c))
    rows = data.manifest["test_rows"]
    items = data.test_items.reshape(c.study.test_mask_draws, rows)
    assert (items == items[0]).all()                                 # every draw of a row: one item
    assert data.manifest["test_items"] == len(np.unique(items[0])) < rows
    np.testing.assert_array_equal(np.unique(items[0]), np.arange(data.manifest["test_items"]))


def test_a_pack_gives_back_the_splits_it_was_made_from(tmp_path):
    c = config()
    data = study.study_splits(study_plan.build_plan(c))
    path = tmp_path / "study_data" / "pack.npz"   # a folder not made yet, as on a fresh checkout
    study_data.save_pack(data, path, study.data_key(c))
    c.study.data_pack = str(path)
    back = study.study_splits(study_plan.build_plan(c))
    assert list(back.variants) == list(data.variants) and back.manifest == data.manifest
    for split in ("train", "validation", "test"):
        for key, value in getattr(data, split).items():
            np.testing.assert_array_equal(getattr(back, split)[key], value)
    np.testing.assert_array_equal(back.test_items, data.test_items)
    c.study.test_fraction = 0.3   # other split settings: refused in one line
    with pytest.raises(ConfigError, match="was made with other data or split settings"):
        study.study_splits(study_plan.build_plan(c))


def test_the_pack_key_does_not_depend_on_where_the_corpus_lies(monkeypatch):
    monkeypatch.setenv("ROFORMER_SHARED_DATA", "/one/place")
    here = study.data_key(config("gpu_tiny"))
    monkeypatch.setenv("ROFORMER_SHARED_DATA", "/another/place")
    assert study.data_key(config("gpu_tiny")) == here == study.data_key(config("gpu_mini")) == study.data_key(config("gpu_tiny_long"))
    other = config("gpu_tiny")
    other.pretrain.data.vocab_size = 4000
    assert study.data_key(other) != here
