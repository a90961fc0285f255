"""The downstream arm: the members a study keeps (roformer.study.kept), the verdict rules
(roformer.study.downstream_rules) on synthetic scores, and `python -m roformer.study downstream`
at smoke size on the CPU."""
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from flax import nnx

from roformer import config_files
from roformer.cli import load_config
from roformer.errors import ConfigError
from roformer.study import downstream, kept, plan as study_plan, records as study_records, session
from roformer.study.records import SCHEMES_DIR
from roformer.study.downstream_rules import control_passes, paired

REPO = Path(__file__).resolve().parents[2]
GLUE_DIR = REPO.parent / "shared" / "data" / "glue"


def config(variant="gpu_smoke", **downstream_keys):
    c = load_config(f"{config_files.CONFIG_DIR / 'study.py'}:{variant}")
    for key, value in downstream_keys.items():
        c.downstream[key] = value
    return c


def smoke_plan(**keys):
    return downstream.DownstreamPlan.from_config(config(**keys))


# --------------------------------------------------------------------------- the rules, on synthetic numbers


def test_the_paired_interval_is_students_t_over_the_pretraining_seeds():
    rope = {2: 20.0, 3: 21.0, 4: 22.0, 5: 23.0, 9: 50.0}   # seed 9 has no partner: left out
    learned = {2: 19.0, 3: 19.0, 4: 19.0, 5: 19.0}
    p = paired(learned, rope, 0.95)
    d = np.array([-1.0, -2.0, -3.0, -4.0])
    se = d.std(ddof=1) / 2
    assert p.seeds == (2, 3, 4, 5) and p.mean == pytest.approx(-2.5)
    assert (p.lo, p.hi) == pytest.approx((-2.5 - 3.182446 * se, -2.5 + 3.182446 * se), abs=1e-5)   # t(3), 97.5%
    assert (p.lo_tost, p.hi_tost) == pytest.approx((-2.5 - 2.353363 * se, -2.5 + 2.353363 * se), abs=1e-5)   # t(3), 95%
    assert paired({2: 1.0}, {2: 0.0, 3: 0.0}, 0.95) is None   # one common seed: no interval


@pytest.mark.parametrize("rope, none, passes", [
    ([30, 32, 31, 29], [10, 12, 13, 9], True),      # rope above none at every seed
    ([10, 12, 13, 9], [30, 32, 31, 29], False),     # separated, but the wrong way round
    ([30, 10, 31, 9], [12, 30, 11, 29], False),     # no separation
])
def test_a_task_counts_only_where_the_reference_beats_the_control(rope, none, passes):
    seeds = range(2, 6)
    difference = paired(dict(zip(seeds, rope)), dict(zip(seeds, none)), 0.95)
    assert control_passes(difference) is passes
    assert not control_passes(None)


def test_each_scheme_is_judged_against_the_reference_only_on_tasks_that_pass_the_control():
    plan = smoke_plan()
    seeds = [2, 3, 4, 5, 6, 7]
    rope = [20.0, 22.0, 21.0, 23.0, 19.0, 20.0]
    table = {
        "cola": {"rope": dict(zip(seeds, rope)),
                 "none": dict(zip(seeds, [5.0, 6.0, 4.0, 7.0, 5.0, 6.0])),
                 "alibi": dict(zip(seeds, [r + 0.1 * (-1) ** i for i, r in enumerate(rope)])),   # within +-1
                 "sinusoidal": dict(zip(seeds, [r - 3.0 + 0.2 * i for i, r in enumerate(rope)])),  # clearly lower
                 "learned": dict(zip(seeds, [r + 6.0 * (-1) ** i for i, r in enumerate(rope)]))},  # noise
        "stsb": {"rope": dict(zip(seeds, rope)), "none": dict(zip(seeds, [r + (-1) ** i for i, r in enumerate(rope)])),
                 "alibi": dict(zip(seeds, [r - 5.0 for r in rope]))},
        "sst2": {"rope": dict(zip(seeds, rope)), "alibi": dict(zip(seeds, rope))},   # no control member
    }
    summary = downstream.summarize(plan, table)
    assert summary["counted"] == ["cola"]
    cola = summary["tasks"]["cola"]["schemes"]
    # reference, control, the study's order (gpu_smoke: rope, alibi, sinusoidal), then the others, each once
    assert list(cola) == ["rope", "none", "alibi", "sinusoidal", "learned"]
    assert downstream.order_schemes(plan, {"t5", "none", "rope", "alibi", "learned"}) == [
        "rope", "none", "alibi", "learned", "t5"]
    assert cola["alibi"]["verdict"] == "equivalent"
    assert cola["sinusoidal"]["verdict"] == "lower"
    assert cola["learned"]["verdict"] == "undecided"
    assert cola["none"]["verdict"] == "lower"
    # stsb: none scores with rope, so even alibi's clear 5-point loss is not judged
    assert summary["tasks"]["stsb"]["schemes"]["alibi"]["verdict"] == "not judged (the task fails the control)"
    assert summary["tasks"]["sst2"]["control"] is None and not summary["tasks"]["sst2"]["counted"]


def test_the_report_prints_the_rules_before_any_number(tmp_path):
    plan = smoke_plan()
    table = {task: {"rope": {1: 12.5, 2: 13.5}, "none": {1: 2.25, 2: 3.75}} for task in plan.tasks}
    members = {(s, k): kept.KeptMember(s, k, tmp_path, {"rate": 4e-3}) for s in ("rope", "none") for k in (1, 2)}
    text = downstream.markdown(plan, downstream.summarize(plan, table), members, [])
    rules_end = text.index("## Which tasks count")
    assert text.index("## Pre-registered") < rules_end
    for number in ("13.00", "3.00", "+10.00"):
        assert rules_end < text.index(number)
    assert "+-1 points (half the 1-2 point GLUE differences" in text[:rules_end]


@pytest.mark.parametrize("keys, message", [
    ({"control": "rope"}, "is the reference"), ({"tasks": "cola,qqpx"}, "downstream.tasks"),
    ({"level": 1.5}, r"downstream.level=1.5"), ({"equivalence_margin": 0.0}, "equivalence_margin=0.0"),
    ({"equivalence_reason": " "}, "equivalence_reason is empty")])
def test_bad_downstream_settings_are_one_line(keys, message):
    with pytest.raises(ConfigError, match=message) as error:
        smoke_plan(**keys)
    assert "\n" not in str(error.value)


def test_a_bad_glue_setting_of_the_arm_is_named_with_its_section():
    c = config()
    c.downstream.glue.learning_rate = -1.0
    with pytest.raises(ConfigError, match="downstream.glue.learning_rate"):
        downstream.DownstreamPlan.from_config(c)


def test_the_arms_keys_leave_every_schemes_fingerprint_as_it_was():
    c = config()
    manifest = {"num_docs": 1}
    before = session.scheme_fingerprint(study_plan.build_plan(c), "rope", manifest)
    c.downstream.keep_members = False
    c.downstream.glue.learning_rate = 1.0
    c.downstream.tasks = "cola"
    assert session.scheme_fingerprint(study_plan.build_plan(c), "rope", manifest) == before


def test_the_long_mini_variant_is_valid_and_reaches_the_evidence_pages_budget():
    c = config("gpu_mini_long")
    plan = study_plan.build_plan(c)
    study_plan.validate(plan)
    assert plan.budgets[-1] * c.pretrain.train.batch_size * c.pretrain.train.seq_len == 32_768_000
    assert plan.model_config("rope").hidden_size == 256 and c.downstream.keep_members
    downstream.DownstreamPlan.from_config(c)


# --------------------------------------------------------------------------- keeping members


def tokenizer_json() -> str:
    from roformer.data.tokenizer import WordPieceTokenizer

    text = ["the cat sat on the mat", "a dog ran in the park", "position schemes encode word order"] * 20
    return WordPieceTokenizer.train(text, vocab_size=60, show_progress=False).tokenizer.to_str()


def fake_group(plan, scheme, rates_losses):
    """A group's record (one budget) whose validation losses per rate are `rates_losses`, and
    distinct stacked parameters per member."""
    from roformer.model import RoFormerForMaskedLM

    members = plan.members(list(rates_losses))
    model_cfg = plan.model_config(scheme, 60, 0)
    per_member = [nnx.to_pure_dict(nnx.state(RoFormerForMaskedLM(model_cfg, rngs=nnx.Rngs(100 + m.index)), nnx.Param))
                  for m in members]
    params = jax.tree.map(lambda *leaves: np.stack(leaves), *per_member)
    record = {"fingerprint": "f", "members": [{"index": m.index, "seed": m.seed, "rate": m.rate} for m in members],
              "budgets": [{"steps": 20, "tokens": 2560, "validation_loss": [rates_losses[m.rate] for m in members],
                           "diverged_at": [None] * len(members)}],
              "diverged_at": [None] * len(members)}
    return record, params, members, per_member


def test_the_study_keeps_the_scored_seeds_of_the_chosen_rate_from_its_stacked_group(tmp_path):
    from roformer.convert import load_converted

    c = config()
    c.study.seeds, c.study.scored_seeds = 3, "1,2"   # seed 0 tunes
    plan = study_plan.build_plan(c)
    record, params, members, per_member = fake_group(plan, "rope", {1e-3: 5.0, 2e-3: 4.0})   # 2e-3 is chosen
    data = SimpleNamespace(tokenizer_json=tokenizer_json(), vocab_size=60, pad_id=0)
    saved = kept.Keeper.start(tmp_path, plan, data).keep("rope", record, params, members)
    assert saved == [kept.member_dir(tmp_path, "rope", 1), kept.member_dir(tmp_path, "rope", 2)]
    for folder, seed in zip(saved, (1, 2)):
        meta = json.loads((folder / kept.MEMBER_FILE).read_text())
        index = next(m.index for m in members if m.seed == seed and m.rate == 2e-3)
        assert (meta["rate"], meta["index"], meta["record_members"]) == (2e-3, index, 6)
        _, model = load_converted(folder)
        restored = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        jax.tree.map(np.testing.assert_array_equal, restored, per_member[index])
        assert (folder / "tokenizer.json").is_file()
    # a group beyond the grid whose rate is then chosen replaces the seeds' folders
    extra = plan.members([4e-3], first_index=6)
    record["members"] += [{"index": m.index, "seed": m.seed, "rate": m.rate} for m in extra]
    record["budgets"][0]["validation_loss"] += [3.0] * 3
    record["budgets"][0]["diverged_at"] += [None] * 3
    edge_params = jax.tree.map(lambda leaf: leaf[:3], params)
    kept.Keeper(tmp_path, plan, data).keep("rope", record, edge_params, extra)
    assert json.loads((saved[0] / kept.MEMBER_FILE).read_text())["rate"] == 4e-3


def test_a_pack_without_the_tokenizer_is_refused_before_training_when_members_are_kept(tmp_path):
    plan = study_plan.build_plan(config())
    data = SimpleNamespace(tokenizer_json="", vocab_size=60, pad_id=0)
    with pytest.raises(ConfigError, match="made before packs held the tokenizer"):
        kept.Keeper.start(tmp_path, plan, data)
    plan.config.downstream.keep_members = False
    assert kept.Keeper.start(tmp_path, plan, data) is None


def _archive(path: Path, members: dict, fingerprint: str = "f") -> Path:
    """A kept archive holding member.json files only: {(scheme, seed): record_members}."""
    with tarfile.open(path, "w:gz") as tar:
        for (scheme, seed), count in members.items():
            info = tarfile.TarInfo(f"{SCHEMES_DIR}/{scheme}.json")   # a record, for split_records
            info.size = 2
            tar.addfile(info, io.BytesIO(b"{}"))
            meta = json.dumps({"scheme": scheme, "seed": seed, "rate": 1e-3, "record_members": count,
                               "fingerprint": fingerprint}).encode()
            info = tarfile.TarInfo(f"{kept.KEPT_DIR}/{scheme}/seed{seed}/{kept.MEMBER_FILE}")
            info.size = len(meta)
            tar.addfile(info, io.BytesIO(meta))
    return path


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_of_several_archives_the_member_chosen_on_the_larger_record_is_taken(tmp_path, order):
    archives = [_archive(tmp_path / "a.tar.gz", {("rope", 2): 9, ("none", 2): 6}),
                _archive(tmp_path / "b.tar.gz", {("rope", 2): 6, ("rope", 3): 6})]
    members = kept.gather([archives[i] for i in order], tmp_path / "into")
    assert sorted(members) == [("none", 2), ("rope", 2), ("rope", 3)]
    assert members[("rope", 2)].meta["record_members"] == 9
    with pytest.raises(ConfigError, match="neither a study workdir with kept members"):
        kept.gather([tmp_path / "nothing"], tmp_path / "into2")


def test_members_of_one_scheme_from_records_of_other_settings_are_said(tmp_path, caplog):
    archives = [_archive(tmp_path / "a.tar.gz", {("rope", 2): 6}, "old"),
                _archive(tmp_path / "b.tar.gz", {("rope", 3): 6, ("none", 2): 6}, "new")]
    kept.gather(archives, tmp_path / "into")
    assert "rope: its kept members come from records of different settings (fingerprints new, old)" in caplog.text
    assert "none:" not in caplog.text


def test_split_gives_each_scheme_its_kept_members(tmp_path):
    archive = _archive(tmp_path / "records.tar.gz", {("rope", 2): 6, ("none", 2): 6, ("none", 3): 6})
    split = study_records.split_records(archive, tmp_path / "split")
    assert [p.name for p in split] == ["records-none.tar.gz", "records-rope.tar.gz"]
    members = kept.gather([tmp_path / "split"], tmp_path / "into")
    assert sorted(members) == [("none", 2), ("none", 3), ("rope", 2)]
    with tarfile.open(split[1]) as tar:
        assert tar.getnames() == [f"{kept.KEPT_DIR}/rope/seed2/{kept.MEMBER_FILE}", f"{SCHEMES_DIR}/rope.json"]


# --------------------------------------------------------------------------- the command at smoke size


@pytest.mark.slow
@pytest.mark.skipif(not (GLUE_DIR / "CoLA").is_dir(), reason="needs the shared GLUE copy")
def test_the_downstream_command_fine_tunes_every_member_and_resumes(tmp_path):
    """Kept members of rope and none (2 pretraining seeds each, untrained: the command's
    path, not a result) fine-tuned on 64 rows of CoLA and STS-B with the GLUE code; the report
    leads with the rules; the same command again fine-tunes nothing."""
    c = config()
    c.study.seeds, c.study.scored_seeds, c.study.schemes = 3, "1,2", "rope,none"
    plan = study_plan.build_plan(c)
    data = SimpleNamespace(tokenizer_json=tokenizer_json(), vocab_size=60, pad_id=0)
    study = tmp_path / "study"
    for scheme in ("rope", "none"):
        record, params, members, _ = fake_group(plan, scheme, {1e-3: 5.0, 2e-3: 4.0})
        kept.Keeper(study, plan, data).keep(scheme, record, params, members)
    command = [sys.executable, "-m", "roformer.study", "downstream", "--config=configs/study.py:gpu_smoke",
               "--config.downstream.tasks=cola,stsb", "--config.downstream.glue.max_train_examples=64",
               "--config.downstream.glue.max_eval_examples=64", "--config.downstream.glue.seeds=1",
               f"--config.downstream.glue.data_dir={GLUE_DIR}", str(tmp_path / "arm"), str(study)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    first = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stderr[-3000:]
    report = (tmp_path / "arm" / downstream.REPORT_MD).read_text()
    assert report.index("## Pre-registered") < report.index("## Which tasks count") < report.index("## cola")
    summary = json.loads((tmp_path / "arm" / downstream.REPORT_JSON).read_text())
    assert summary["missing"] == []
    for task in ("cola", "stsb"):
        assert set(summary["tasks"][task]["schemes"]) == {"rope", "none"}
        assert summary["tasks"][task]["control"]["seeds"] == [1, 2]
        for scheme in ("rope", "none"):
            scores = json.loads((downstream.run_dir(tmp_path / "arm", scheme, 1, task) / downstream.SCORES_FILE)
                                .read_text())
            assert list(scores["scores"]) == ["0"] and scores["member"]["scheme"] == scheme
    assert "downstream 1/8" in first.stderr
    again = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "downstream 1/8" not in again.stderr and "fine-tuned yet" not in again.stdout


def test_the_downstream_command_without_a_config_is_one_line(tmp_path):
    command = [sys.executable, "-m", "roformer.study", "downstream", str(tmp_path / "arm"), str(tmp_path)]
    result = subprocess.run(command, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == ("error: downstream: give --config=configs/study.py:VARIANT "
                                                      "(its downstream section)")
