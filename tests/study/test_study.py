"""The accelerator comparison (roformer.study, study_plan, study_train): its checks,
data, statistics and, at smoke size, the whole command (scripts/gpu_comparison.sh)."""
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from roformer import config_files as plan
from roformer.cli import load_config
from roformer.data.masking import mask_rows_on_device
from roformer.study import data as study_data, plan as study_plan, records as study_records, session as study
from roformer.study import stats as study_stats
from roformer.errors import ConfigError
from roformer.train import optim

REPO = Path(__file__).resolve().parents[2]
SCHEMES = ("rope", "shaw", "learned", "t5", "alibi", "sinusoidal", "none")


def config(variant="gpu_smoke", **study_keys):
    c = load_config(f"{plan.CONFIG_DIR / 'study.py'}:{variant}")
    for key, value in study_keys.items():
        c.study[key] = value
    return c


@pytest.mark.parametrize("variant", ["gpu_tiny", "gpu_tiny_long", "gpu_mini", "gpu_small", "gpu_smoke"])
def test_every_variant_is_valid_and_alibi_has_at_least_four_heads(variant):
    c = config(variant)
    study_plan.validate(study_plan.build_plan(c))
    if "alibi" in plan.split_list(c.study.schemes):
        assert study_plan.build_plan(c).model_config("alibi").num_heads >= 4
    assert len(study_plan.build_plan(c).members()) == c.study.seeds * len(study_plan.build_plan(c).rates)


def test_the_accelerator_variants_train_every_scheme_8_seeds_x_3_rates():
    for variant in ("gpu_tiny", "gpu_tiny_long", "gpu_mini", "gpu_small"):
        c = config(variant)
        assert set(plan.split_list(c.study.schemes)) == {"rope", "learned", "shaw", "t5", "alibi", "sinusoidal", "none"}
        assert c.study.seeds >= 8 and len(study_plan.build_plan(c).rates) == 3 and c.study.min_test_predictions >= 200_000
    mini = study_plan.build_plan(config("gpu_mini")).model_config("rope")
    assert (mini.num_layers, mini.hidden_size, mini.num_heads) == (4, 256, 4)


@pytest.mark.parametrize("keys, message", [
    ({"equivalence_margin": 0.0}, "equivalence_margin=0.0"), ({"equivalence_reason": " "}, "equivalence_reason"),
    ({"tuning_seeds": "0,1"}, r"seeds \[1\] both tune and are scored"),
    ({"scored_seeds": "1,2"}, r"seeds \[2\] are not among the study's seeds 0..1"),
    ({"budget_steps": "10,20"}, "the flat test needs >= 2 budgets"),
    ({"learning_rates": "1e-3,0"}, "study.learning_rates"), ({"learning_rates": "1e-3,-2e-3"}, "study.learning_rates"),
    ({"schemes": "rope,nope"}, "unknown scheme 'nope'"), ({"reference": "learned"}, "study.reference"),
    ({"budget_steps": "10,15"}, "study.budget_steps"), ({"windows": "1,4"}, "study.windows"),
    ({"compile_ahead": -1}, "study.compile_ahead=-1")])
def test_bad_settings_are_one_line_before_anything_trains(keys, message):
    with pytest.raises(ConfigError, match=message) as error:
        study_plan.validate(study_plan.build_plan(config(**keys)))
    assert "\n" not in str(error.value)


def test_alibi_with_two_heads_is_refused():
    c = config()
    c.pretrain.model.num_heads = 2
    with pytest.raises(ConfigError, match="ALiBi with 2 heads"):
        study_plan.validate(study_plan.build_plan(c))


def test_an_unknown_variant_is_one_line():
    with pytest.raises(ConfigError, match="unknown configs/study.py variant 'gpu_huge'.*'gpu_tiny'"):
        config("gpu_huge")


def test_the_memory_estimate_refuses_a_group_that_does_not_fit():
    c = config(memory_limit_gib=0.001)
    data = study.study_splits(study_plan.build_plan(c))
    with pytest.raises(ConfigError, match=r"group of 'rope' needs about .* GiB, with 1 group\(s\) prepared ahead "
                       r"\(study.compile_ahead\), more than 90% of the device's") as error:
        study_plan.check_memory(study_plan.build_plan(c), data)
    assert "\n" not in str(error.value) and "0.0 GiB" not in str(error.value)   # small sizes still read
    c.study.memory_limit_gib = 64.0
    assert set(study_plan.check_memory(study_plan.build_plan(c), data)) == set(plan.split_list(c.study.schemes))


def test_the_memory_estimate_counts_the_initial_states_of_the_groups_prepared_ahead():
    """Each group prepared ahead holds its members' parameters and Adam moments on the device
    while another trains: the estimate adds compile_ahead times the largest scheme's."""
    c = config(memory_limit_gib=64.0, compile_ahead=0)
    data = study.study_splits(study_plan.build_plan(c))
    alone = study_plan.check_memory(study_plan.build_plan(c), data)
    c.study.compile_ahead = 2
    ahead = study_plan.check_memory(study_plan.build_plan(c), data)
    n = len(study_plan.build_plan(c).members())
    largest = max(study_plan.initial_state_bytes(study_plan.build_plan(c).model_config(s, data.vocab_size, data.pad_id), n)
                  for s in plan.split_list(c.study.schemes))
    assert largest > 0 and {s: ahead[s] - alone[s] for s in alone} == {s: 2 * largest for s in alone}


def test_memory_estimate_grows_with_members_and_width():
    base = study_plan.build_plan(config("gpu_tiny")).model_config("rope")
    mini = study_plan.build_plan(config("gpu_mini")).model_config("rope")
    est = lambda m, n: study_plan.memory_estimate(m, members_=n, batch_size=16, seq_len=128, max_predictions=20,  # noqa: E731
                                             data_bytes=0)
    assert est(base, 24) == 2 * est(base, 12) and est(mini, 24) > est(base, 24)


# --------------------------------------------------------------------------- schedule


def test_cooldown_branches_and_the_wsd_factor():
    assert optim.cooldown_branches([625, 1250, 2500], 0.2) == [(500, 625), (1000, 1250), (2000, 2500)]
    factor = lambda s, start, end: float(optim.wsd_factor(s, warmup_steps=10, decay_start=start, decay_end=end))  # noqa: E731
    assert factor(0, 80, 100) == pytest.approx(0.1) and factor(50, 80, 100) == 1.0
    assert factor(90, 80, 100) == pytest.approx(0.5) and factor(99, 80, 100) == pytest.approx(0.05)
    with pytest.raises(ConfigError):
        optim.cooldown_branches([100, 100], 0.2)


def test_member_optimizer_takes_each_members_rate():
    tx = optim.make_member_optimizer(weight_decay=0.0, b1=0.9, b2=0.98, eps=1e-8, clip_norm=0.0)
    params = {"w": jnp.ones((3,))}

    def update(rate):
        state = optim.with_learning_rate(tx.init(params), rate)
        return tx.update({"w": jnp.ones((3,))}, state, params)[0]["w"]

    rates = jnp.asarray([1e-3, 4e-3])
    updates = jax.vmap(update)(rates)   # Adam's first step moves by the rate
    np.testing.assert_allclose(updates, -rates[:, None] * jnp.ones((2, 3)), rtol=1e-4)


def test_a_member_reads_its_own_seeds_order_and_keys_whatever_its_group_holds():
    """A group of seed 1 alone reads seed 1's row of the pass orders (it read seed 0's when its
    index was its place among the group's seeds), and no step's dropout key is a masking key."""
    from roformer.study.plan import Member
    from roformer.study.groups import member_inputs

    alone = member_inputs([Member(0, 1, 4e-3)])
    full = member_inputs([Member(0, 0, 4e-3), Member(1, 1, 4e-3)])
    assert alone["seed_index"].tolist() == [1] and full["seed_index"].tolist() == [0, 1]
    assert (jax.random.key_data(alone["data_key"]) == jax.random.key_data(full["data_key"][1:])).all()
    dropout_step1 = jax.random.fold_in(full["dropout_key"][1], 1)
    assert not (jax.random.key_data(dropout_step1) == jax.random.key_data(full["data_key"][1])).all()


# --------------------------------------------------------------------------- data


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


# --------------------------------------------------------------------------- statistics


def test_bootstrap_interval_covers_the_truth_and_widens_with_fewer_items():
    rng = np.random.default_rng(0)
    weight = np.full(400, 10.0)
    loss = 10 * (3.0 + rng.normal(0, 0.5, size=(8, 400)) + rng.normal(0, 0.05, size=(8, 1)))
    lo, hi = study_stats.interval(study_stats.mean_loss(loss, weight),
                                  study_stats.bootstrap_means(loss, weight, samples=1000), 8)
    assert lo < 3.0 < hi
    lo_small, hi_small = study_stats.interval(study_stats.mean_loss(loss[:, :40], weight[:40]),
                                              study_stats.bootstrap_means(loss[:, :40], weight[:40], samples=1000), 8)
    assert hi_small - lo_small > hi - lo


def test_intervals_over_few_seeds_reach_their_level_where_the_seeds_spread_dominates():
    """Seeds far apart, items alike: 8 seeds' percentile interval of the bootstrap covered the
    truth about 87 % of the time; scaled by t(7) and sqrt(8/7) it covers it about 95 %. A
    simulation of 300 studies, each with its own seed offsets (sd 0.05) and item losses."""
    rng = np.random.default_rng(5)
    weight = np.ones(200)
    covered_t, covered_percentile = 0, 0
    for trial in range(300):
        loss = 3.0 + rng.normal(0, 0.05, size=(8, 1)) + rng.normal(0, 0.05, size=(8, 200))
        replicates = study_stats.bootstrap_means(loss, weight, samples=400, seed=trial)
        lo, hi = study_stats.interval(study_stats.mean_loss(loss, weight), replicates, 8)
        covered_t += lo < 3.0 < hi
        p_lo, p_hi = np.percentile(replicates, [2.5, 97.5])
        covered_percentile += p_lo < 3.0 < p_hi
    assert covered_percentile / 300 < 0.91 and 0.92 <= covered_t / 300 <= 0.98


def test_the_bootstrap_draws_its_counts_once_per_shape_and_seed_and_gives_fresh_draws_numbers():
    """The report asks every interval of a budget for the same resampling; the counts are drawn
    once and kept, and the replicates are those of counts drawn afresh for each call."""
    rng = np.random.default_rng(1)
    loss, reference, weight = rng.random((4, 50)), rng.random((4, 50)), rng.random(50) + 0.5

    def fresh(data, seed, items=50):
        draw = np.random.default_rng(seed)
        seed_counts = draw.multinomial(4, np.full(4, 1 / 4), size=300)
        item_counts = draw.multinomial(items, np.full(items, 1 / items), size=300)
        return (seed_counts * (item_counts @ data.T)).sum(1) / (seed_counts.sum(1) * (item_counts @ weight[:items]))

    for seed in (0, 0, 1, 0):
        np.testing.assert_array_equal(study_stats.bootstrap_means(loss, weight, samples=300, seed=seed),
                                      fresh(loss, seed))
        np.testing.assert_array_equal(study_stats.bootstrap_means(loss, weight, samples=300, seed=seed,
                                                                  reference=reference), fresh(loss - reference, seed))
    np.testing.assert_array_equal(study_stats.bootstrap_means(loss[:, :30], weight[:30], samples=300),
                                  fresh(loss[:, :30], 0, items=30))
    study_stats.resample_counts.cache_clear()
    study_stats.bootstrap_means(loss, weight, samples=300)
    study_stats.bootstrap_means(loss, weight, samples=300, reference=reference)
    assert study_stats.resample_counts.cache_info().hits == 1


def test_the_report_time_script_writes_a_report_of_fake_records_at_a_variants_shapes(tmp_path, monkeypatch, capsys):
    """scripts/study_report_time.py (how long a call's report writes take, docs/ablation.md) at
    gpu_smoke: every scheme's grid and group beyond it, a write after each."""
    import runpy

    monkeypatch.setattr(sys, "argv", ["study_report_time.py", "gpu_smoke", "--dir", str(tmp_path / "w")])
    runpy.run_path(str(REPO / "scripts" / "study_report_time.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "6 writes:" in out and out.count("write with 3 schemes") == 4
    report = json.loads((tmp_path / "w" / "study.json").read_text())
    assert report["schemes"] == ["rope", "alibi", "sinusoidal"]
    assert len(report["budgets"][-1]["rows"]["rope"]["validation_by_rate"]) == 3   # the grid's 2 rates and 1 beyond


def test_the_report_is_written_again_from_records_archives(fake_study, tmp_path):
    """A device call's records.tar.gz, or the per-scheme archives a results page keeps, give
    back the report the study wrote, in a directory of one's choosing (`study report SOURCE DIR`)."""
    import tarfile

    archive = tmp_path / "records.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:   # as scripts/gpu_comparison.sh packs them
        for name in (study.SCHEMES_DIR, study.DATA_MANIFEST, study.CONFIG_RECORD):
            tar.add(fake_study / name, arcname=name)
    study_records.split_records(archive, tmp_path / "records")
    expected = (fake_study / "study.md").read_text()
    assert study.open_records(fake_study) == fake_study
    assert study.write_report(archive, tmp_path / "one").read_text() == expected
    study.write_report(tmp_path / "records", tmp_path / "per_scheme")
    assert (tmp_path / "per_scheme" / "study.md").read_text() == expected
    assert sorted(p.name for p in (tmp_path / "per_scheme" / "schemes").iterdir()) == sorted(
        p.name for p in (fake_study / "schemes").iterdir())

    # Each comparison's smallest passing margin is in its row.
    result = json.loads((fake_study / "study.json").read_text())
    vs = result["budgets"][-1]["rows"]["alibi"]["vs_reference"]
    bound = study_stats.equivalence_bound(vs["lo90"], vs["hi90"])
    last_table = expected.split("## Budget")[-1]
    row = next(line for line in last_table.splitlines() if line.startswith("| alibi |"))
    assert f"| {vs['verdict']} | {vs['family'] or '—'} | +-{bound:.3f} |" in row

    with pytest.raises(ConfigError, match="name a directory to write the report in"):
        study.write_report(archive)
    with pytest.raises(ConfigError, match="neither a study workdir"):
        study.open_records(tmp_path / "missing")
    with tarfile.open(tmp_path / "bare.tar.gz", "w:gz") as tar:
        tar.add(fake_study / study.SCHEMES_DIR, arcname=study.SCHEMES_DIR)
    with pytest.raises(ConfigError, match="no study_config.json in .*bare.tar.gz: not study records"):
        study.open_records(tmp_path / "bare.tar.gz", tmp_path / "bare")
    (tmp_path / "broken.tar.gz").write_bytes(b"not gzip")
    with pytest.raises(ConfigError, match="cannot read records archive .*broken.tar.gz"):
        study.open_records(tmp_path / "broken.tar.gz", tmp_path / "broken")


def _records_archive(path: Path, workdir: Path, schemes, members: int | None = None, fingerprint: str | None = None):
    """An archive of `workdir`'s records of `schemes`, as gpu_comparison.sh packs them, with the
    members cut to `members` or the fingerprint replaced when given."""
    import tarfile

    staging = path.parent / f"{path.name}.d"
    (staging / study.SCHEMES_DIR).mkdir(parents=True)
    for name in (study.DATA_MANIFEST, study.CONFIG_RECORD):
        (staging / name).write_bytes((workdir / name).read_bytes())
    for scheme in schemes:
        record = json.loads((workdir / study.SCHEMES_DIR / f"{scheme}.json").read_text())
        if members is not None:
            record["members"] = record["members"][:members]
        if fingerprint is not None:
            record["fingerprint"] = fingerprint
        (staging / study.SCHEMES_DIR / f"{scheme}.json").write_text(json.dumps(record))
        (staging / study.SCHEMES_DIR / f"{scheme}.npz").write_bytes(
            (workdir / study.SCHEMES_DIR / f"{scheme}.npz").read_bytes())
    with tarfile.open(path, "w:gz") as tar:
        for name in (study.SCHEMES_DIR, study.DATA_MANIFEST, study.CONFIG_RECORD):
            tar.add(staging / name, arcname=name)
    return path


def test_a_resumed_study_takes_per_scheme_the_record_of_its_own_settings(fake_study, tmp_path, caplog):
    """Records staged from several archives and the workdir's own: per scheme the one whose
    fingerprint is the study's, the fullest of them; one of other settings is never taken, and
    the workdir's own is set aside, so no report or archive mixes it in. Each said in a line."""
    import logging
    import shutil

    from roformer.study import records as study_records

    workdir = tmp_path / "work"
    shutil.copytree(fake_study, workdir)
    fingerprints = {s: json.loads((fake_study / "schemes" / f"{s}.json").read_text())["fingerprint"]
                    for s in ("rope", "alibi", "sinusoidal")}
    full = len(json.loads((fake_study / "schemes" / "alibi.json").read_text())["members"])
    # The workdir: rope of other settings, alibi and sinusoidal missing.
    (workdir / "schemes" / "rope.json").write_text(json.dumps(
        {**json.loads((fake_study / "schemes" / "rope.json").read_text()), "fingerprint": "other"}))
    for scheme in ("alibi", "sinusoidal"):
        for suffix in (".json", ".npz"):
            (workdir / "schemes" / f"{scheme}{suffix}").unlink()
    archives = [
        _records_archive(tmp_path / "a.tar.gz", fake_study, ["alibi"], members=4),        # partial (grid only)
        _records_archive(tmp_path / "b.tar.gz", fake_study, ["rope", "alibi"]),           # complete
        _records_archive(tmp_path / "c.tar.gz", fake_study, ["sinusoidal"], fingerprint="older settings")]
    assert len(study_records.stage_archives(workdir, list(map(str, archives)))) == len(archives)
    with caplog.at_level(logging.INFO, logger="roformer.study"):
        finished = study_records.take_finished(workdir, fingerprints)
    assert finished == ["rope", "alibi"]
    for scheme in ("rope", "alibi"):
        assert json.loads((workdir / "schemes" / f"{scheme}.json").read_text()) == \
            json.loads((fake_study / "schemes" / f"{scheme}.json").read_text())
    assert not (workdir / "schemes" / "sinusoidal.json").exists()
    assert json.loads((workdir / "schemes" / "stale" / "rope.json").read_text())["fingerprint"] == "other"
    assert not (workdir / study_records.INCOMING_DIR).exists()
    text = caplog.text
    assert "rope: the workdir's record was trained under other settings" in text
    assert f"alibi: already trained ({full} members, from {archives[1]}); 1 other record(s)" in text
    assert f"sinusoidal: {archives[2]} holds a record of other settings" in text
    # The report of the workdir leaves the stale record out; one read from archives leaves out a
    # record whose fingerprint is not its config's, and reports a scheme its config does not list.
    study.write_report(workdir)
    assert json.loads((workdir / "study.json").read_text())["schemes"] == ["rope", "alibi"]
    config_record = json.loads((fake_study / study.CONFIG_RECORD).read_text())
    config_record["study"]["schemes"] = "rope"
    (tmp_path / "listed").mkdir()
    for name, path in (("b", archives[1]), ("c", archives[2])):
        shutil.copy(path, tmp_path / "listed" / f"records-{name}.tar.gz")
    _config_archive(tmp_path / "listed" / "records-z.tar.gz", config_record)
    study.write_report(tmp_path / "listed", tmp_path / "listed_report")
    assert json.loads((tmp_path / "listed_report" / "study.json").read_text())["schemes"] == ["rope", "alibi"]
    # An archive that cannot be read stages nothing.
    (tmp_path / "broken.tar.gz").write_bytes(b"not gzip")
    with pytest.raises(ConfigError, match="cannot read records archive .*broken.tar.gz"):
        study_records.stage_archives(workdir, [archives[0], tmp_path / "broken.tar.gz"])
    assert not list((workdir / study_records.INCOMING_DIR).glob("*"))


def _config_archive(path: Path, config_record: dict) -> None:
    """An archive holding only a study config (the last one read, so its config is the report's)."""
    import tarfile

    (path.parent / "config").mkdir(exist_ok=True)
    (path.parent / "config" / study.CONFIG_RECORD).write_text(json.dumps(config_record))
    with tarfile.open(path, "w:gz") as tar:
        tar.add(path.parent / "config" / study.CONFIG_RECORD, arcname=study.CONFIG_RECORD)


def test_a_schemes_fingerprint_does_not_depend_on_where_the_data_lie():
    """Records made with the checkout in one place resume with it in another (a lent machine's)."""
    manifest = {"num_docs": 3, "setup_s": 1.0}
    here, there = config("gpu_tiny"), config("gpu_tiny")
    here.pretrain.data.files, there.pretrain.data.files = "/one/place/wiki_*", "/another/place/wiki_*"
    there.pretrain.data.cache_dir = "/elsewhere/cache"
    assert study.scheme_fingerprint(study_plan.build_plan(here), "rope", manifest) == study.scheme_fingerprint(study_plan.build_plan(there), "rope", manifest)
    assert study.scheme_fingerprint(study_plan.build_plan(here), "rope", manifest) == study.scheme_fingerprint(study_plan.build_plan(here), "rope", {"num_docs": 3})
    there.pretrain.data.files = "/one/place/other_*"
    assert study.scheme_fingerprint(study_plan.build_plan(here), "rope", manifest) != study.scheme_fingerprint(study_plan.build_plan(there), "rope", manifest)


def test_a_study_refused_at_its_start_leaves_the_config_its_records_were_trained_under(tmp_path):
    (tmp_path / study.SCHEMES_DIR).mkdir()
    (tmp_path / study.CONFIG_RECORD).write_text("the earlier call's\n")
    with pytest.raises(ConfigError, match="min_test_predictions"):
        study.run_study(config(min_test_predictions=10**9), tmp_path)
    assert (tmp_path / study.CONFIG_RECORD).read_text() == "the earlier call's\n"


def test_tost_calls_a_tie_only_within_the_margin():
    rng = np.random.default_rng(1)
    weight = np.ones(2000)
    base = 3 + rng.normal(0, 0.3, size=(8, 2000))
    same = study_stats.compare(base + rng.normal(0, 0.01, size=base.shape), base, weight, margin=0.02, samples=500)
    assert same["verdict"].startswith("equivalent")
    worse = study_stats.compare(base + 0.1, base, weight, margin=0.02, samples=500)
    assert worse["verdict"] == "higher" and worse["lo"] > 0
    noisy = study_stats.compare(base + rng.normal(0, 1.0, size=base.shape), base, weight, margin=0.02, samples=500)
    assert noisy["verdict"] == "undecided"
    with pytest.raises(ValueError):
        study_stats.verdict(-1.0, 1.0, -0.5, 0.5, margin=0.0)


def test_holm_rejects_step_down_and_stops_at_the_first_that_fails():
    # Sorted: 0.005 <= 0.05/4, 0.01 <= 0.05/3, then 0.03 > 0.05/2 stops it (0.04 is not reached).
    assert study_stats.holm([0.01, 0.04, 0.03, 0.005]) == [True, False, False, True]
    assert study_stats.holm([0.01, 0.02, 0.03]) == [True, True, True]   # 0.01 <= 0.05/3, 0.02 <= 0.05/2, 0.03 <= 0.05
    assert study_stats.holm([0.2, 0.001]) == [False, True]
    assert study_stats.holm([]) == []


def test_each_verdict_is_checked_against_the_whole_familys_correction():
    """family_verdicts says which verdicts survive the correction over both tests of every
    comparison: a clear difference does, a borderline one among many does not (and says what
    is left of it), one comparison alone keeps its own verdict, "undecided" claims nothing."""
    rng = np.random.default_rng(3)
    weight = np.ones(2000)
    base = 3 + rng.normal(0, 0.3, size=(8, 2000))
    clear = study_stats.compare(base + 0.2, base, weight, margin=0.02, samples=2000)
    assert clear["verdict"] == "higher" and clear["p_difference"] < 0.05 and clear["p_equivalence"] > 0.05
    tie = study_stats.compare(base + rng.normal(0, 0.005, size=base.shape), base, weight, margin=0.05, samples=2000)
    assert tie["verdict"].startswith("equivalent") and tie["p_equivalence"] < 0.05
    noisy = study_stats.compare(base + rng.normal(0, 1.0, size=base.shape), base, weight, margin=0.02, samples=2000)
    assert noisy["verdict"] == "undecided"
    assert study_stats.family_verdicts([clear, tie, noisy]) == ["holds", "holds", None]
    lost = base + 0.2
    lost[3, 7] = np.nan   # a member that diverged at every rate
    nothing = study_stats.compare(lost, base, weight, margin=0.02, samples=500)
    assert nothing["verdict"] == "undecided" and nothing["p_difference"] == nothing["p_equivalence"] == 1.0
    assert study_stats.family_verdicts([clear, nothing]) == ["holds", None]
    # One comparison alone: its verdict at 5% is the family's (its two nulls count once).
    borderline = {"verdict": "higher", "lo": 0.001, "p_difference": 0.03, "p_equivalence": 1.0}
    assert study_stats.family_verdicts([borderline]) == ["holds"]
    # Among three, 0.03 is not below 0.05/3.
    assert study_stats.family_verdicts([borderline] * 3) == ["not under Holm: undecided"] * 3
    both = {"verdict": "equivalent (nonzero)", "lo": 0.001, "p_difference": 0.04, "p_equivalence": 0.0}
    assert study_stats.family_verdicts([both]) == ["holds"]
    # Three open comparisons: clear's 0 < 0.05/3, both's 0 < 0.05/3 (both stays open for its
    # difference), then 0.04 against 0.05/2 fails: what is left of both is its equivalence.
    assert study_stats.family_verdicts([both, clear, borderline]) == [
        "not under Holm: equivalent", "holds", "not under Holm: undecided"]


def test_the_family_correction_holds_the_family_wise_error_rate():
    """Under the null of no difference in every comparison, with equivalence always shown
    (its p near 0) and the difference tests' p uniform, a false "nonzero" claim that holds
    under the correction comes at most about 5% of the time. Entering only the p-value of the
    claim each comparison made (this module's earlier form) gives about 25% at six comparisons."""
    rng = np.random.default_rng(0)
    trials, m, errors = 20000, 6, 0
    for p_difference in rng.uniform(size=(trials, m)):
        comparisons = [{"verdict": "equivalent (nonzero)" if p < 0.05 else "equivalent", "lo": 0.0,
                        "p_difference": p, "p_equivalence": 0.0} for p in p_difference]
        errors += any(c["verdict"] == "equivalent (nonzero)" and f == "holds"
                      for c, f in zip(comparisons, study_stats.family_verdicts(comparisons)))
    assert errors / trials < 0.055


def test_p_values_are_the_intervals_inverted():
    """p_difference is below a level exactly where the interval at 1 - level excludes 0, and
    p_equivalence exactly where the interval at 1 - 2 level lies within +-margin, at any seed
    count (one seed: the normal quantile)."""
    rng = np.random.default_rng(1)
    for seeds in (1, 2, 3, 8, 16):
        for trial in range(40):
            diff = rng.uniform(-0.1, 0.1)
            replicates = rng.normal(diff, rng.uniform(0.005, 0.05), 500)
            p_difference, p_equivalence = study_stats.p_values(diff, replicates, seeds, 0.05)
            for level in (0.01, 0.02, 0.05, 0.1, 0.2, 0.4):
                lo, hi = study_stats.interval(diff, replicates, seeds, 1 - level)
                if abs(p_difference - level) > 1e-9:
                    assert (lo > 0 or hi < 0) == (p_difference < level), (seeds, trial, level)
                lo, hi = study_stats.interval(diff, replicates, seeds, 1 - 2 * level)
                if abs(p_equivalence - level) > 1e-9:
                    assert (-0.05 < lo and hi < 0.05) == (p_equivalence < level), (seeds, trial, level)
    assert study_stats.p_values(0.1, np.array([0.1, np.nan]), 8, 0.05) == (1.0, 1.0)
    assert all(np.isnan(study_stats.interval(0.1, np.array([0.1, np.inf]), 8)))
    assert study_stats.p_values(0.0, np.zeros(100), 8, 0.05) == (1.0, 0.0)   # identical losses: a tie, no difference
    # TOST reads the 90% interval, not the 95% one: an interval whose 90% lies within the margin
    # and whose 95% does not is "equivalent".
    assert study_stats.verdict(-0.03, 0.055, -0.02, 0.045, 0.05) == "equivalent"
    assert study_stats.verdict(-0.03, 0.055, -0.02, 0.051, 0.05) == "undecided"


def test_the_equivalence_bound_is_the_smallest_margin_tost_passes():
    """Read at another margin, the same intervals give compare's verdict there: equivalent just
    above the bound, and at the bound itself what the 95% interval says."""
    rng = np.random.default_rng(2)
    weight = np.ones(2000)
    base = 3 + rng.normal(0, 0.3, size=(8, 2000))
    for shift in (0.0, 0.01, -0.03):
        loss = base + shift + rng.normal(0, 0.02, size=base.shape)
        found = study_stats.compare(loss, base, weight, margin=0.02, samples=500)
        bound = study_stats.equivalence_bound(found["lo90"], found["hi90"])
        assert bound == pytest.approx(max(abs(found["lo90"]), abs(found["hi90"])))
        assert bound >= abs(shift) - 0.01
        ends = (found["lo"], found["hi"], found["lo90"], found["hi90"])
        assert study_stats.verdict(*ends, margin=bound * 1.001).startswith("equivalent")
        assert not study_stats.verdict(*ends, margin=bound).startswith("equivalent")
        again = study_stats.compare(loss, base, weight, margin=bound * 1.001, samples=500)
        assert again["verdict"].startswith("equivalent")
        assert study_stats.verdict(*ends, margin=0.02) == found["verdict"]


def test_onsets_are_censored_on_both_sides():
    tokens = [0, 10, 20, 30]
    assert study_stats.onset(tokens, [0.0, 0.5, 0.6, 0.7], 0.1) == {"tokens": 10, "started": True, "left_censored": True}
    assert study_stats.onset(tokens, [0.0, 0.0, 0.2, 0.7], 0.1) == {"tokens": 20, "started": True, "left_censored": False}
    assert study_stats.onset(tokens, [0.0] * 4, 0.1) == {"tokens": 30, "started": False, "left_censored": False}
    curve = study_stats.kaplan_meier(np.array([10, 20, 30, 30]), np.array([True, True, False, False]),
                                     np.array([0, 10, 20, 30]))
    np.testing.assert_allclose(curve, [0, 0.25, 0.5, 0.5])


def test_the_onset_band_is_exact_where_none_or_all_seeds_have_started():
    """0 of 8 started: the band still reaches 0.37 (Clopper-Pearson), where resampling the 8
    seeds gave no width at all; 8 of 8: down to 0.69; 4 of 8: the exact binomial interval. A
    run right-censored early (diverged at 10) is not counted after it."""
    band = study_stats.onset_curve([30] * 8, [False] * 8, [10, 20, 30])
    assert band["fraction"] == [0, 0, 0] and band["lo"] == [0, 0, 0]
    assert band["hi"] == pytest.approx([0.3694] * 3, abs=1e-4)
    band = study_stats.onset_curve([10] * 8, [True] * 8, [10])
    assert band["hi"] == [1.0] and band["lo"] == pytest.approx([0.6306], abs=1e-4)
    band = study_stats.onset_curve([10, 10, 10, 10, 30, 30, 30, 30], [True] * 4 + [False] * 4, [10])
    assert band["lo"] == pytest.approx([0.1570], abs=1e-4) and band["hi"] == pytest.approx([0.8430], abs=1e-4)
    band = study_stats.onset_curve([10, 20, 30], [False, True, False], [20])   # 1 started of the 2 followed
    assert band["fraction"] == [0.5]
    assert band["lo"] == pytest.approx([1 - 0.975 ** 0.5]) and band["hi"] == pytest.approx([0.975 ** 0.5])


def test_percentile_band_ignores_diverged_values():
    band = study_stats.percentile_band(np.array([[1.0, 2.0], [3.0, np.nan], [5.0, np.inf]]))
    assert band["median"] == [3.0, 2.0]


# --------------------------------------------------------------------------- the command


@pytest.mark.slow
def test_the_device_script_at_smoke_size(tmp_path):
    """scripts/gpu_comparison.sh OUTDIR gpu_smoke on the CPU: every scheme through the vmapped
    study, one rate that diverges (reported, not chosen), the report; a second call on a fresh
    workdir resumes from the first's records (trains nothing)."""
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "ROFORMER_CACHE": str(tmp_path / "cache"),
           "STUDY_WORKDIR": str(tmp_path / "work")}
    cmd = ["bash", str(REPO / "scripts/gpu_comparison.sh"), str(out), "gpu_smoke",
           f"--config.study.schemes={','.join(SCHEMES)}", "--config.study.learning_rates=2e-3,30"]
    first = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    report = json.loads((out / "study.json").read_text())
    assert report["schemes"] == list(SCHEMES)
    last = report["budgets"][-1]["rows"]
    assert last["rope"]["rate"] == 2e-3 and {d["rate"] for d in last["rope"]["diverged"]} == {30.0}
    assert last["sinusoidal"]["vs_reference"]["verdict"] in {"higher", "lower", "undecided"} or \
        last["sinusoidal"]["vs_reference"]["verdict"].startswith("equivalent")
    text = (out / "study.md").read_text()
    assert "seed 0 at 30" in text and "sinusoidal: scale" in text
    # 30 diverged, so 2e-3 was chosen at the grid's low edge: every scheme's seeds trained one step below
    low = 2e-3 * 2e-3 / 30
    assert "Rates beyond the grid (`study.extend_edges`" in text and f"rope ({low:g})" in text
    assert sorted(map(float, last["rope"]["validation_by_rate"])) == pytest.approx([low, 2e-3, 30.0])
    assert "## What this does and does not show" in text and "member(s) diverged" in text
    assert "{" not in text.split("\n## ")[0]   # the header's every placeholder filled in
    for figure in ("study_loss.png", "study_onset.png", "study_spectrum.png", "study_signal.png"):
        assert (out / figure).stat().st_size > 0
    # What a lent machine sends back: at most 8 files, none in a subfolder.
    assert len(list(out.iterdir())) <= 8 and all(p.is_file() for p in out.iterdir())
    assert (out / "records.tar.gz").stat().st_size > 0
    import tarfile
    with tarfile.open(out / "records.tar.gz") as archive:   # with each scheme's kept member (its scored seed)
        assert sorted(n for n in archive.getnames() if n.endswith("member.json")) == [
            f"kept/{s}/seed1/member.json" for s in sorted(SCHEMES)]
    # Every group after the first had its programs compiled while the one before trained, the
    # first group beyond a grid while the last grid trained.
    records = {s: json.loads((tmp_path / "work" / study.SCHEMES_DIR / f"{s}.json").read_text()) for s in SCHEMES}
    assert [records[s]["timing"]["compiled_ahead"] for s in SCHEMES] == [False] + [True] * (len(SCHEMES) - 1)
    assert [records[s]["edges"]["timing"]["compiled_ahead"] for s in SCHEMES] == [True] * len(SCHEMES)
    assert "s ahead (waited" in text
    # The time table has a row for each group, those beyond the grids too, and their sum.
    assert "| rope, beyond the grid (" in text and f"In all: {2 * len(SCHEMES)} groups" in text
    assert "| tokens/s training | tokens/s evaluation |" in text
    # Each scheme's throughput measured after its compiling chunk, and the comparison read at equal time.
    assert "## At equal wall-clock time against rope" in text
    assert all(report["wall_clock"]["throughput"][s]["member_tokens_per_s"] > 0 for s in SCHEMES)
    # The report command writes the same report from the records and the recorded config.
    (tmp_path / "work" / "study.md").unlink()
    assert study.write_report(tmp_path / "work").read_text() == text
    # On a fresh machine: the records of the first call put back from one archive per scheme
    # (as a study spread over sessions keeps them), nothing trains again.
    kept = study_records.split_records(out / "records.tar.gz", tmp_path / "kept")
    assert [p.name for p in kept] == sorted(f"records-{s}.tar.gz" for s in SCHEMES)
    env = {**env, "STUDY_WORKDIR": str(tmp_path / "fresh"), "RESUME_FROM": " ".join(map(str, kept))}
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and (again.stdout + again.stderr).count(" members, from ") == len(SCHEMES)
    resumed = json.loads((out / "study.json").read_text())
    assert resumed["budgets"] == report["budgets"] and resumed["wall_clock"]["throughput"] == report["wall_clock"]["throughput"]


def test_a_group_compiled_on_a_worker_thread_trains_alike_without_compiling_again(caplog):
    """SchemeRun.compile on CompileAhead's worker thread: the group's training, evaluation and
    signal programs are ready before it runs (nothing compiles while it trains), and the
    group computes what it computes when its first calls compile them."""
    from roformer.study.groups import CompileAhead, SchemeRun

    c = config(schemes="rope", seeds=2, learning_rates="2e-3", budget_steps="2,4")
    data = study.study_splits(study_plan.build_plan(c))
    aux = study.device_arrays(study_plan.build_plan(c), data)
    plain, plain_loss = SchemeRun(study_plan.build_plan(c), "rope", data, aux).run()
    ahead = CompileAhead(lambda scheme: SchemeRun(study_plan.build_plan(c), scheme, data, aux).compile(), groups=1)
    ahead.submit("rope", "rope")
    run = ahead.take("rope", "rope")
    ahead.close()
    assert run.compiled_ahead and run.programs_s > run.init_s > 0
    # Its members' initial states wait on the device: what the memory estimate counts for them
    # (and a step counter per member and moment).
    waiting = sum(x.nbytes for x in jax.tree.leaves(run.states))
    counted = study_plan.initial_state_bytes(run.model_cfg, len(run.group))
    assert counted <= waiting <= counted + 64 * len(run.group)
    with jax.log_compiles(True), caplog.at_level("WARNING", logger="jax"):
        record, test_loss = run.run()
    compiled = [r.getMessage()[:40] for r in caplog.records if r.getMessage().startswith("Compiling")]
    assert not [m for m in compiled if any(f"jit({name})" in m for name in ("train_chunk", "evaluate", "signal"))], \
        compiled
    assert record["timing"]["compiled_ahead"] and not plain["timing"]["compiled_ahead"]
    # Evaluation's throughput counts every row it ran, padding included: each trunk evaluation
    # and each earlier budget's validation, and the test rows at every budget.
    padded = lambda rows: -(-len(rows["input_ids"]) // c.study.eval_batch) * c.study.eval_batch  # noqa: E731
    budgets_ = len(record["budgets"])
    assert run.evaluated_rows == (len(record["evals"]) + budgets_ - 1) * padded(run.eval_rows) + \
        budgets_ * padded(data.test)
    assert record["timing"]["eval_tokens_per_s"] == pytest.approx(
        len(run.group) * run.evaluated_rows * c.pretrain.train.seq_len / record["timing"]["eval_s"])
    assert record["budgets"] == plain["budgets"] and record["evals"] == plain["evals"]
    assert test_loss.keys() == plain_loss.keys()
    for key in test_loss:
        np.testing.assert_array_equal(test_loss[key], plain_loss[key])


def test_records_split_into_one_archive_per_scheme(tmp_path):
    import tarfile

    work = tmp_path / "work"
    (work / study.SCHEMES_DIR).mkdir(parents=True)
    names = [study.DATA_MANIFEST, study.CONFIG_RECORD] + [
        f"{study.SCHEMES_DIR}/{scheme}.{ext}" for scheme in ("rope", "t5") for ext in ("json", "npz")]
    stray = f"{study.SCHEMES_DIR}/.rope.npz.partial-1-ab"   # a write that a kill cut short
    for name in names + [stray]:
        (work / name).write_text(name)
    with tarfile.open(tmp_path / "records.tar.gz", "w:gz") as archive:
        for name in names + [stray]:
            archive.add(work / name, arcname=name)
    kept = study_records.split_records(tmp_path / "records.tar.gz", tmp_path / "kept")
    assert [p.name for p in kept] == ["records-rope.tar.gz", "records-t5.tar.gz"]
    for path, scheme in zip(kept, ("rope", "t5")):
        with tarfile.open(path) as archive:
            assert sorted(archive.getnames()) == sorted(names[:2] + [f"schemes/{scheme}.json", f"schemes/{scheme}.npz"])
            assert archive.extractfile(f"schemes/{scheme}.npz").read() == f"schemes/{scheme}.npz".encode()


def test_the_device_script_refuses_an_unknown_variant(tmp_path):
    result = subprocess.run(["bash", str(REPO / "scripts/gpu_comparison.sh"), str(tmp_path), "gpu_huge"],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "unknown variant 'gpu_huge'" in result.stderr


def test_the_device_script_writes_the_report_again_from_the_records_after_a_stop(tmp_path):
    """A study stopped at LIMIT_S (timeout's 124) may leave its report a group behind its
    records (the report is written beside training): the script writes it again from the
    records, without training; a clean exit does not. A stand-in interpreter records each
    command, and its study leaves a config and one record."""
    stub = tmp_path / "python"
    stub.write_text(f"""#!/bin/sh
echo "$@" >> {tmp_path / "calls"}
case "$*" in
  *"roformer.study --config"*) mkdir -p {tmp_path / "work" / "schemes"}; echo {{}} > {tmp_path / "work" / "study_config.json"}
                      echo {{}} > {tmp_path / "work" / "schemes" / "rope.json"}; exit ${{STUDY_EXIT:-0}} ;;
esac
""")
    stub.chmod(0o755)
    (tmp_path / "pack.npz").write_bytes(b"")

    def calls(study_exit):
        (tmp_path / "calls").unlink(missing_ok=True)
        result = subprocess.run(["bash", str(REPO / "scripts/gpu_comparison.sh"), str(tmp_path / "out"), "gpu_tiny"],
                                env={"PATH": "/usr/bin:/bin", "PYTHON": str(stub), "STUDY_EXIT": str(study_exit),
                                     "STUDY_DATA": str(tmp_path / "pack.npz"), "STUDY_WORKDIR": str(tmp_path / "work")},
                                capture_output=True, text=True, cwd=REPO)
        assert result.returncode == study_exit, result.stderr
        return [c.split(" ")[1] for c in (tmp_path / "calls").read_text().splitlines() if c.startswith("-m ")]

    assert calls(124) == ["roformer.study", "roformer.study"]
    assert f"-m roformer.study report {tmp_path / 'work'}" in (tmp_path / "calls").read_text()
    assert calls(0) == ["roformer.study"]
    # the study's own stop at study.time_limit_s wrote its last report itself
    assert calls(3) == ["roformer.study"]
    assert "(partial: records.tar.gz holds what finished" in (tmp_path / "out" / "log.txt").read_text()


def test_a_study_stopped_by_its_time_limit_exits_with_its_own_status(tmp_path):
    """`python -m roformer.study` on a gpu_smoke study whose time limit leaves schemes untrained
    exits 3 (PARTIAL_EXIT) with a line naming them; the same command with room for the rest
    exits 0. The first scheme sets the forecast, so the limit stops the study after it. The
    finished report leads with the pre-registration, then M(T), and scores gpu_smoke's scored
    seed only (its tuning seed chose the rate)."""
    command = [sys.executable, "-m", "roformer.study", "--config=configs/study.py:gpu_smoke",
               f"--workdir={tmp_path}", "--config.study.schemes=rope,none",
               "--config.study.learning_rates=2e-3", "--config.study.compile_ahead=0",
               "--config.study.extend_edges=False"]
    env = {**os.environ, "ROFORMER_CACHE": str(tmp_path / "cache")}
    first = subprocess.run(command + ["--config.study.time_limit_s=1"], env=env, capture_output=True,
                           text=True, cwd=REPO, timeout=600)
    assert first.returncode == study.PARTIAL_EXIT, first.stdout[-2000:] + first.stderr[-2000:]
    assert "partial: the schemes none not trained yet" in first.stdout
    again = subprocess.run(command, env=env, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert "partial:" not in again.stdout and " members, from " in again.stdout + again.stderr
    md = (tmp_path / "study.md").read_text()
    headings = [line for line in md.splitlines() if line.startswith("## ")]
    assert headings[:3] == ["## Pre-registered", "## Compute multiplier M(T) against rope", "## End state against rope"]
    assert not any(ch.isdigit() for ch in md[:md.index("## Pre-registered")])
    assert "| none | " in md and "- none vs rope: " in md
    result = json.loads((tmp_path / "study.json").read_text())
    assert result["end_state"]["scored_seeds"] == [1] and result["end_state"]["tuning_seeds"] == [0]
    assert all(len(b["rows"][s]["test_loss_per_seed"]) == 1 for b in result["budgets"] for s in ("rope", "none"))
    assert result["end_state"]["uses_order"]["none"] is False


def test_the_report_command_refuses_a_folder_that_is_not_a_study_workdir(tmp_path):
    with pytest.raises(ConfigError, match="has no study_config.json"):
        study.write_report(tmp_path)


def test_the_report_command_refuses_records_made_before_the_preregistration(tmp_path):
    recorded = config().to_dict()
    for key in ("equivalence_margin", "tuning_seeds", "scored_seeds"):
        del recorded["study"][key]
    (tmp_path / study_records.CONFIG_RECORD).write_text(json.dumps(recorded))
    with pytest.raises(ConfigError, match="predates the pre-registration"):
        study.write_report(tmp_path)


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


def test_the_rate_is_chosen_on_validation_and_never_one_that_diverged():
    from roformer.study.report import choose_rate

    members = [{"seed": s, "rate": r} for r in (1e-3, 2e-3, 4e-3) for s in range(2)]
    budget = {"steps": 100, "validation_loss": [5.0, 5.2, 4.0, 4.2, 3.0, float("nan")],
              "diverged_at": [None, None, None, None, None, 40]}
    record = {"members": members, "diverged_at": [None] * 6}
    assert choose_rate(record, budget) == 1          # 4e-3 would be lowest, but one of its seeds diverged
    budget["diverged_at"][5] = None                  # the trunk diverged only after this budget's branch
    budget["validation_loss"][5] = 3.1
    assert choose_rate(record, budget) == 2
    # A record from before budgets kept their own divergences: the trunk's, by the budget's end.
    del budget["diverged_at"]
    record["diverged_at"][5] = 40
    assert choose_rate(record, budget) == 1
    record["diverged_at"][5] = 150
    assert choose_rate(record, budget) == 2


def test_each_budget_counts_the_divergences_of_its_own_model():
    """A budget's model is its trunk up to the cooldown's fork, then its branch: a member that
    diverges in the trunk after the fork, or in another budget's branch, has not diverged for
    it. A member whose last update is not finite (the training loss is taken before each
    update) is marked by its validation loss at the budget's end."""
    from roformer.study.groups import SchemeRun

    c = config(schemes="rope", seeds=2, learning_rates="1e-3,2e-3", budget_steps="4,8", eval_every=1,
               warmup_steps=1, cooldown_fraction=0.5)
    data = study.study_splits(study_plan.build_plan(c))
    run = SchemeRun(study_plan.build_plan(c), "rope", data, study.device_arrays(study_plan.build_plan(c), data)).compile()
    train_chunk, trunk = run.programs.train_chunk, (4, 8)   # budget 4's branch runs (2, 4)
    poison = lambda states, m: {**states, "params": jax.tree.map(lambda p: p.at[m].set(jnp.nan),  # noqa: E731
                                                                 states["params"])}

    def chunk(states, aux, rest, inputs, start, end):
        step, on_trunk = int(np.asarray(states["step"])[0]), (int(start), int(end)) == trunk
        if step == 3:   # member 3 in the trunk (after budget 4's fork), member 1 in budget 4's branch
            states = poison(states, 3 if on_trunk else 1)
        states, losses = train_chunk(states, aux, rest, inputs, start, end)
        return (poison(states, 0) if on_trunk and step == 7 else states), losses   # member 0's last update

    run.programs.train_chunk = chunk
    record, _ = run.run()
    assert [b["diverged_at"] for b in record["budgets"]] == [[None, 4, None, None], [8, None, None, 4]]
    assert record["diverged_at"] == [8, None, None, 4]


def test_the_report_says_what_it_does_not_show():
    from roformer.study.report import limits

    c = config(schemes="rope,alibi,sinusoidal")    # sinusoidal has not finished
    rows = {"rope": {"rate_at_edge": True, "diverged": []},
            "alibi": {"rate_at_edge": False, "diverged": [{"seed": 0, "rate": 30.0, "step": 4}],
                      "vs_reference": {"verdict": "undecided"}}}
    result = {"schemes": ["rope", "alibi"], "budgets": [{"steps": 20, "tokens": 2560, "rows": rows}],
              "schemes_info": {"rope": {"parameters": 1234, "onsets": [{"left_censored": True}]},
                               "alibi": {"parameters": 1234, "onsets": [{"left_censored": False}]}}}
    text = " ".join(limits(c, result, {"train_rows": 20}))   # 20 steps x batch 4 = 4 passes over 20 rows
    assert "reads the training split 4.0 times" in text and "memorised" in text
    assert "edge of the grid for rope at" in text and "'undecided' (alibi)" in text and "1 member(s) diverged" in text
    assert "marked <= (rope)" in text and "Not finished, so not compared: sinusoidal." in text
    assert "1,234 parameters" in text
    rows["rope"]["rate_at_edge"], rows["alibi"]["diverged"] = False, []
    text = " ".join(limits(c, result, {"train_rows": 800}))
    assert "0.10 of the training split's rows, each at most once" in text
    assert "edge of the grid" not in text and "diverged" not in text
    # every scheme finished: one whose grid edge was chosen waits for its rates beyond the grid
    c.study.schemes = "rope,alibi"
    rows["rope"]["rate_at_edge"] = True
    for scheme, extended in (("rope", []), ("alibi", [])):
        result["schemes_info"][scheme]["edge_rates"] = extended
    assert "rates beyond the grid of rope have not trained yet" in " ".join(limits(c, result, {"train_rows": 800}))
    result["schemes_info"]["rope"]["edge_rates"] = [3.5e-4]
    text = " ".join(limits(c, result, {"train_rows": 800}))
    assert "have not trained yet" not in text and "(and the rates beyond the grid for rope)" in text
    # every rate of a scheme had a diverged member: it is compared at one that did not train stably
    rows["alibi"].update(rate=30.0, diverged=[{"seed": 0, "rate": 30.0, "step": 4}])
    text = " ".join(limits(c, result, {"train_rows": 800}))
    assert "Every rate of alibi had a diverged member" in text and "trained stably" not in text
    rows["alibi"]["diverged"] = []
    assert "Holm" not in text
    rows["alibi"]["vs_reference"] = {"verdict": "higher", "family": "not under Holm: undecided"}
    text = " ".join(limits(c, result, {"train_rows": 800}))
    assert "the verdicts of alibi hold as single comparisons but not with all of the budget's comparisons" in text


def test_rates_beyond_the_grid_continue_it_geometrically_at_each_chosen_edge():
    grid = [7e-4, 1.4e-3, 2.8e-3]
    assert study_plan.edge_rates(grid, [1, 1, 1]) == []
    assert study_plan.edge_rates(grid, [2, 1, 0]) == pytest.approx([3.5e-4, 5.6e-3])
    assert study_plan.edge_rates(grid, [1, 2]) == pytest.approx([5.6e-3])
    assert study_plan.edge_rates([1e-3], [0]) == []
    c = config()
    extra = study_plan.build_plan(c).members([3.5e-4], first_index=4)
    assert [(m.index, m.seed, m.rate) for m in extra] == [(4, 0, 3.5e-4), (5, 1, 3.5e-4)]


def test_a_group_beyond_the_grid_joins_its_schemes_record_member_by_member():
    from roformer.study.groups import merge_groups

    def group(rates, offset):
        members = [{"index": offset + i, "seed": i % 2, "rate": r} for i, r in enumerate(rates)]
        n = len(members)
        evals = [{"step": step, "tokens": step * 10, "validation_loss": [offset + i + step for i in range(n)],
                  "validation_accuracy": [0.1] * n, "gaps": {"shuffle2": [offset + i for i in range(n)]},
                  "signal": {"scale": [[offset + i, 0.0] for i in range(n)]}} for step in (0, 10)]
        budgets_ = [{"steps": 10, "tokens": 100, "validation_loss": [offset + i for i in range(n)],
                     "test_loss": [offset + i for i in range(n)]}]
        record = {"scheme": "rope", "members": members, "evals": evals, "budgets": budgets_, "diverged_at": [None] * n,
                  "timing": {"wall_s": 1.0}, "fingerprint": "f"}
        return record, {"budget10": np.arange(offset, offset + n, dtype=np.float32)[:, None] * np.ones((1, 3))}

    main, main_arrays = group([1e-3, 1e-3, 2e-3, 2e-3], 0)
    extra, extra_arrays = group([5e-4, 5e-4], 4)
    main_arrays["test_weight"] = np.ones(3)
    # sums written ahead of a record that did not land: only the record's members are kept
    stale = {**main_arrays, "budget10": np.concatenate([main_arrays["budget10"], np.full((2, 3), -1.0)])}
    merged, arrays = merge_groups(main, stale, extra, extra_arrays)
    assert [m["index"] for m in merged["members"]] == [0, 1, 2, 3, 4, 5] and merged["fingerprint"] == "f"
    assert [e["validation_loss"] for e in merged["evals"]] == [[0, 1, 2, 3, 4, 5], [10, 11, 12, 13, 14, 15]]
    assert merged["evals"][1]["gaps"]["shuffle2"] == [0, 1, 2, 3, 4, 5]
    assert [row[0] for row in merged["evals"][0]["signal"]["scale"]] == [0, 1, 2, 3, 4, 5]
    assert merged["budgets"][0]["test_loss"] == [0, 1, 2, 3, 4, 5] and merged["diverged_at"] == [None] * 6
    np.testing.assert_array_equal(arrays["budget10"][:, 0], np.arange(6))
    np.testing.assert_array_equal(arrays["test_weight"], np.ones(3))
    from roformer.study.report import choose_rate
    assert sorted({m["rate"] for m in merged["members"]})[choose_rate(merged, merged["budgets"][0])] == 1e-3
    # Each budget's own divergences join too, where both records kept them; else neither counts.
    main["budgets"][0]["diverged_at"], extra["budgets"][0]["diverged_at"] = [None] * 4, [None, 7]
    merged, _ = merge_groups(main, main_arrays, extra, extra_arrays)
    assert merged["budgets"][0]["diverged_at"] == [None] * 5 + [7]
    assert sorted({m["rate"] for m in merged["members"]})[choose_rate(merged, merged["budgets"][0])] == 1e-3
    del extra["budgets"][0]["diverged_at"]
    assert "diverged_at" not in merge_groups(main, main_arrays, extra, extra_arrays)[0]["budgets"][0]


def test_the_report_names_the_figures_it_wrote(tmp_path):
    """A call that finished only schemes with nothing to follow (rope, first by its time limit)
    writes no signal figure, and its study.md does not name one."""
    from roformer.study import figures as study_figures

    band = {"median": [1.0, 0.5], "lo": [0.9, 0.4], "hi": [1.1, 0.6]}

    def info(signal):
        return {"tokens": [0, 100], "validation": band, "rate": 1e-3, "onsets": [{"left_censored": False}],
                "onset_curve": {"grid": [0, 100], "fraction": [0.0, 0.5], "lo": [0.0, 0.2], "hi": [0.0, 0.8]},
                "spectrum": {"shuffle2": band, "reverse": band}, "signal": signal}

    for schemes in ({"rope": info({})}, {"rope": info({}), "alibi": info({"slope_max": band})}):
        workdir = tmp_path / "-".join(schemes)
        workdir.mkdir()
        study_figures.figures({"schemes_info": schemes}, workdir)
        assert sorted(p.name for p in workdir.iterdir()) == sorted(study_figures.figure_names(schemes))
        assert ("study_signal.png" in study_figures.figure_names(schemes)) == ("alibi" in schemes)


class StandInRun:
    """A scheme's group for the study's loop that trains nothing: an empty record with the
    timing `wall_s` and `programs_s` give, and zero test sums."""
    compiled_ahead = False
    wall_s = programs_s = 0.0
    params = None   # no members: a study that keeps members keeps none of these

    def __init__(self, plan, scheme, data, aux, group=None):
        self.scheme, self.budgets, self.key = scheme, plan.budgets, (scheme, group is not None)

    def compile(self):
        return self

    def run(self):
        timing = {**dict.fromkeys(("setup_s", "first_eval_s", "compile_s", "train_s", "eval_s", "tokens_per_s"), 0.0),
                  "wall_s": self.wall_s, "programs_s": self.programs_s}
        return {"scheme": self.scheme, "members": [], "timing": timing}, \
            {f"budget{b}": np.zeros((4, 1), np.float32) for b in self.budgets}


def test_a_study_stopped_by_its_time_limit_resumes_with_the_rest(tmp_path, monkeypatch, caplog):
    """A scheme that would end past study.time_limit_s is not started; the same command (here
    without the limit) trains only the schemes that have no record yet."""
    from roformer.study import report as study_report

    trained = []

    class FakeRun(StandInRun):
        wall_s = 1e6

        def run(self):
            trained.append(self.scheme)
            return super().run()

    monkeypatch.setattr(study, "SchemeRun", FakeRun)
    monkeypatch.setattr(study_report, "write", lambda config, workdir, runs=None: {})
    c = config(time_limit_s=60.0, extend_edges=False)
    with caplog.at_level("WARNING", logger="roformer.study"):
        study.run_study(c, tmp_path)
    assert trained == ["rope"] and "alibi and what follows not started" in caplog.text
    c.study.time_limit_s = 0.0
    study.run_study(c, tmp_path)
    assert trained == ["rope", "alibi", "sinusoidal"]
    assert sorted(p.name for p in (tmp_path / study.SCHEMES_DIR).glob("*.json")) == \
        ["alibi.json", "rope.json", "sinusoidal.json"]


@pytest.mark.parametrize("groups", [0, 1])
def test_the_time_limit_counts_a_compilation_only_for_a_group_not_compiled_yet(tmp_path, monkeypatch, caplog, groups):
    """The forecast of the next group is the longest group's run once compiled (60 s here),
    plus the longest compilation (50 s) unless the next group's programs were compiled ahead:
    under a 100 s limit, compiling in turn stops after the first scheme, compiling ahead does not."""
    import threading

    from roformer.study import report as study_report

    trained, compiled = [], {scheme: threading.Event() for scheme in ("rope", "alibi", "sinusoidal")}

    class FakeRun(StandInRun):
        wall_s, programs_s = 60.0, 50.0

        def compile(self):
            compiled[self.scheme].set()
            return self

        def run(self):
            trained.append(self.scheme)
            if groups:   # the next group's compilation, on its worker thread, ends before this group does
                following = list(compiled)[len(trained):len(trained) + 1]
                assert all(compiled[s].wait(30) for s in following)
            return super().run()

    monkeypatch.setattr(study, "SchemeRun", FakeRun)
    monkeypatch.setattr(study_report, "write", lambda config, workdir, runs=None: {})
    with caplog.at_level("WARNING", logger="roformer.study"):
        study.run_study(config(time_limit_s=100.0, extend_edges=False, compile_ahead=groups), tmp_path)
    if groups:
        assert trained == ["rope", "alibi", "sinusoidal"] and "time limit" not in caplog.text
    else:
        assert trained == ["rope"]
        assert "alibi and what follows not started" in caplog.text and "compiling up to 50 s" in caplog.text


@pytest.mark.parametrize("groups", [0, 1, 2])
def test_groups_are_compiled_on_worker_threads_at_most_compile_ahead_groups_early(tmp_path, monkeypatch, groups):
    """Each scheme's group (and each group beyond a grid) is prepared on a worker thread once
    at most `study.compile_ahead` groups are left before it, never in the training thread
    unless compile_ahead is 0 or it is the first group: the first group beyond a grid too,
    while the last grids train."""
    import threading

    from roformer.study import report as study_report

    trained, prepared = [], {}

    class FakeRun(StandInRun):
        def compile(self):
            prepared[self.key] = (threading.current_thread().name, len(trained))
            return self

        def run(self):
            trained.append(self.key)
            return super().run()

    monkeypatch.setattr(study, "SchemeRun", FakeRun)
    monkeypatch.setattr(study, "edge_rates", lambda trained_rates, chosen: [1.0])
    monkeypatch.setattr(study, "merge_groups", lambda record, arrays, edge, edge_loss: (record, arrays))
    monkeypatch.setattr(study_report, "write", lambda config, workdir, runs=None: {})
    monkeypatch.setattr(study_report, "choose_rate", lambda record, budget: 0)
    monkeypatch.setattr(study_report, "load_scheme", lambda workdir, scheme: ({"members": [], "budgets": []}, {}))
    study.run_study(config(time_limit_s=0.0, compile_ahead=groups), tmp_path)
    order = [(s, False) for s in ("rope", "alibi", "sinusoidal")] + [(s, True) for s in ("rope", "alibi", "sinusoidal")]
    assert trained == order
    for turn, key in enumerate(order):
        thread, done_before = prepared[key]
        ahead = groups and turn != 0
        assert thread.startswith("compile-ahead") == bool(ahead), (key, thread)
        assert done_before >= turn - groups, key


@pytest.mark.parametrize("last_fails", [False, True])
def test_the_report_is_written_on_a_worker_thread_while_the_next_group_trains(tmp_path, monkeypatch, caplog,
                                                                              last_fails):
    """After each group the report is rewritten on its worker thread while the next group trains
    (the next group waits here until that write has begun). A write that fails there is logged,
    and the study goes on. The worker's last write sees every scheme and is the study's report;
    only when it failed does the calling thread write it again."""
    import threading

    from roformer.study import report as study_report

    writes, begun = [], {scheme: threading.Event() for scheme in ("rope", "alibi", "sinusoidal")}

    class FakeRun(StandInRun):
        def run(self):
            before = {"alibi": "rope", "sinusoidal": "alibi"}.get(self.scheme)
            if before:   # the write after the group before has begun while this group trains
                assert begun[before].wait(30)
            return super().run()

    def write(config, workdir, runs=None):
        runs = study_report.load(workdir) if runs is None else runs
        writes.append((threading.current_thread().name, sorted(runs)))
        for scheme in runs:
            begun[scheme].set()
        if len(writes) == 1 or (last_fails and len(runs) == 3 and writes[-1][0].startswith("report")):
            raise RuntimeError("a failed write")
        return {"written": len(writes)}

    monkeypatch.setattr(study, "SchemeRun", FakeRun)
    monkeypatch.setattr(study_report, "write", write)
    with caplog.at_level("WARNING", logger="roformer.study"):
        result = study.run_study(config(time_limit_s=0.0, extend_edges=False), tmp_path)
    assert writes[0] == (writes[0][0], ["rope"]) and writes[0][0].startswith("report")
    assert "writing the report on its worker thread failed" in caplog.text and "a failed write" in caplog.text
    on_worker = [w for w in writes if w[0].startswith("report")]
    assert on_worker[-1][1] == ["alibi", "rope", "sinusoidal"]
    if last_fails:
        assert writes[-1] == (threading.current_thread().name, ["alibi", "rope", "sinusoidal"])
    else:
        assert writes[-1] == on_worker[-1]
    assert result == {"written": len(writes)}


def test_a_group_whose_compiling_ahead_failed_is_compiled_in_its_turn(caplog):
    import threading

    from roformer.study.groups import CompileAhead

    class Prepared:
        compiled_ahead = False

    def prepare(scheme):
        if threading.current_thread().name.startswith("compile-ahead"):
            raise RuntimeError("no room for it now")
        return Prepared()

    ahead = CompileAhead(prepare, groups=1)
    ahead.submit("rope", "rope")
    with caplog.at_level("WARNING", logger="roformer.study"):
        run = ahead.take("rope", "rope")
    ahead.close()
    assert isinstance(run, Prepared) and not run.compiled_ahead
    assert "rope: compiling ahead failed; compiling here" in caplog.text and "no room for it now" in caplog.text


def test_the_pack_key_does_not_depend_on_where_the_corpus_lies(monkeypatch):
    monkeypatch.setenv("ROFORMER_SHARED_DATA", "/one/place")
    here = study.data_key(config("gpu_tiny"))
    monkeypatch.setenv("ROFORMER_SHARED_DATA", "/another/place")
    assert study.data_key(config("gpu_tiny")) == here == study.data_key(config("gpu_mini")) == study.data_key(config("gpu_tiny_long"))
    other = config("gpu_tiny")
    other.pretrain.data.vocab_size = 4000
    assert study.data_key(other) != here


def test_a_finished_scheme_is_kept_when_only_how_the_study_is_read_changes():
    c = config()
    fp = study.scheme_fingerprint(study_plan.build_plan(c), "rope", {"tokens": 1})
    c.study.equivalence_margin, c.study.time_limit_s, c.study.data_pack, c.study.schemes = 0.1, 100.0, "x.npz", "rope"
    c.study.tuning_seeds, c.study.scored_seeds, c.study.planning_seed_sds = "1", "0", "0.1"
    c.study.extend_edges, c.study.compile_ahead = not c.study.extend_edges, 0
    assert study.scheme_fingerprint(study_plan.build_plan(c), "rope", {"tokens": 1}) == fp
    c.study.learning_rates = "1e-3,3e-3"
    assert study.scheme_fingerprint(study_plan.build_plan(c), "rope", {"tokens": 1}) != fp


def test_a_schemes_fingerprint_ignores_train_profile_steps():
    """Tracing a window of steps only watches a run: a study's finished schemes stay finished
    whether it is set or not."""
    c = config()
    fp = study.scheme_fingerprint(study_plan.build_plan(c), "rope", {"tokens": 1})
    c.pretrain.train.profile_steps = "2:3"
    assert study.scheme_fingerprint(study_plan.build_plan(c), "rope", {"tokens": 1}) == fp
