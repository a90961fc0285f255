"""The ablation end to end: `roformer.ablation.runner.run_ablation`, as the command runs it.

The tests swap the stage runners for fast fakes that write what the real ones write
(metrics.jsonl, glue_results.json) or return what they return (extrapolation and
context-extension results), so validation, the order of seeds and stages, skipping,
resuming, failure handling and the report the runs add up to are checked without
training; tests/test_notebooks.py runs a tiny real ablation end to end. The pieces have
their own tests: tests/ablation/test_ablation_plan.py, test_ablation_state.py,
test_ablation_collect.py, test_ablation_report.py, test_ablation_extrapolation.py.
"""
import json
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from roformer import ablate
from roformer.ablation import plan, report, runner, validation
from roformer.ablation.state import PINNED_TOKENIZER, STATE_FILE

from helpers.ablation import FakeStages, small_config, stub_figures


@pytest.fixture
def quick_figures(monkeypatch):
    return stub_figures(monkeypatch)


def _set(path, value):
    """A change of the ablation config at dotted `path` (a field of another type is replaced:
    ConfigDict keeps a field's type, the command line could not give a float for an int)."""
    def change(config):
        *parents, key = path.split(".")
        for parent in parents:
            config = config[parent]
        if type(value) is not type(config[key]):
            del config[key]
        config[key] = value
    return change


@pytest.mark.parametrize("changes, message", [
    ([_set("schemes", "learned,rotery")], "unknown scheme 'rotery'"),
    ([_set("seeds", 0)], "config.seeds=0: give the number of pretraining seeds"),
    ([_set("seeds", -1)], "config.seeds=-1: give the number of pretraining seeds"),
    ([_set("seeds", 2.0)], "config.seeds=2.0: give the number of pretraining seeds"),
    ([_set("seeds", True)], "config.seeds=True: give the number of pretraining seeds"),
    ([_set("extension.methods", "none,rotate")], "extension.methods='none,rotate': choose from"),
    ([_set("reference", "t5")], r"config.reference='t5' is not one of config.schemes \['learned', 'rope'\]"),
    # The extension keeps the tokens per step: batch 15 cannot be split into 2x longer rows.
    ([_set("pretrain.train.batch_size", 15)],
     r"extension.factor=2: must be >= 2 and divide pretrain.train.batch_size=15"),
    # Its step-0 loss is the extrapolation column at the factor: 2 must be evaluated.
    ([_set("extrapolation.factors", "1,4")], r"extension.factor=2 must be one of extrapolation.factors '1,4'"),
    ([_set("extension.factor", 4), _set("extrapolation.factors", "1,2")],
     r"extension.factor=4 must be one of extrapolation.factors '1,2'"),
    ([_set("extension.scheme", "learned")], r"extension.scheme='learned' \(position 'learned'\) has no rotary"),
    # float32 compute (and on a CPU no GPU): a kernel no scheme's model can run here
    ([_set("pretrain.model.attention_impl", "cudnn")], r"scheme 'learned': model.attention_impl='cudnn' cannot be used"),
], ids=["scheme", "seeds-0", "seeds-negative", "seeds-float", "seeds-bool", "method", "reference",
        "factor-batch", "factor-not-evaluated", "factor-4-not-evaluated", "extension-scheme", "cudnn"])
def test_validate_refuses_a_bad_config_before_any_training(tmp_path, monkeypatch, changes, message):
    stages = FakeStages()
    stages.install(monkeypatch)
    config = small_config()
    validation.validate(plan.build_plan(config, "/ablation"))   # the smoke config itself is fine
    for change in changes:
        change(config)
    with pytest.raises(ValueError, match=message) as error:
        runner.run_ablation(config, tmp_path / "ablation")
    assert str(error.value).startswith("ablation config: ")
    assert stages.calls == [] and not (tmp_path / "ablation").exists()


def test_validate_names_every_problem_in_one_error(tmp_path, monkeypatch):
    stages = FakeStages()
    stages.install(monkeypatch)
    config = small_config("learned,rotery")
    config.seeds = 0
    config.reference = "t5"
    config.extension.methods = ("none", "rotate")
    config.extension.factor = 3
    with pytest.raises(ValueError) as error:
        runner.run_ablation(config, tmp_path / "ablation")
    text = str(error.value)
    for part in ("unknown scheme 'rotery'", "config.seeds=0", "config.reference='t5'",
                 "extension.methods=('none', 'rotate')", "divide pretrain.train.batch_size=16",
                 "extension.factor=3 must be one of extrapolation.factors"):
        assert part in text
    assert stages.calls == [] and not (tmp_path / "ablation").exists()
    # Extension settings are checked only when the extension runs.
    config = small_config()
    config.extension.update(enabled=False, methods=("none", "rotate"), factor=3)
    validation.validate(plan.build_plan(config, "/ablation"))


def test_run_writes_report_skips_finished_and_reports_failures(tmp_path, monkeypatch):
    stages = FakeStages(fail={("learned/seed1", "extrapolation"), ("t5/seed0", "pretrain"),
                              ("t5/seed1", "pretrain")})
    stages.install(monkeypatch)
    config = small_config("learned,rope,t5")   # 2 seeds
    config.extension.enabled = False
    result = runner.run_ablation(config, tmp_path)

    runs = {(r["scheme"], r["seed"]): r for r in result["runs"]}
    rows = {r["scheme"]: r for r in result["schemes"]}
    assert list(runs) == [(s, k) for k in (0, 1) for s in ("learned", "rope", "t5")]
    assert rows["rope"]["status"] == "done" and rows["rope"]["seeds"] == [0, 1]
    assert runs[("learned", 0)]["status"] == "done"
    failed = runs[("learned", 1)]
    assert failed["status"] == "failed" and failed["failed_stage"] == "extrapolation"
    assert "injected failure" in failed["error"]
    assert rows["learned"]["status"] == "failed"
    assert rows["learned"]["errors"] == [
        "seed 1 extrapolation: RuntimeError: injected failure in learned/seed1 extrapolation"]
    # The failed seed is left out of the scheme's statistics.
    assert rows["learned"]["seeds"] == [0] and rows["learned"]["eval_loss"] == {"mean": 7.5, "std": None, "n": 1}
    assert ("learned/seed1", "glue") in stages.calls              # fine-tuning needs only the pretrained model
    assert rows["t5"]["status"] == "failed"
    assert [runs[("t5", k)]["failed_stage"] for k in (0, 1)] == ["pretrain", "pretrain"]
    assert [c for c in stages.calls if c[0].startswith("t5/")] == \
        [("t5/seed0", "pretrain"), ("t5/seed1", "pretrain")]   # nothing to evaluate
    assert (tmp_path / "errors" / "learned.seed1.extrapolation.txt").exists()
    assert "RuntimeError: injected failure" in (tmp_path / "errors" / "t5.seed0.pretrain.txt").read_text()
    assert runs[("learned", 1)]["tokens_per_sec"] == 1000.0 and runs[("rope", 0)]["tokens_per_sec"] == 800.0
    assert rows["rope"]["eval_loss"] == {"mean": pytest.approx(7.05), "std": pytest.approx(np.std([7.0, 7.1], ddof=1)),
                                         "n": 2}
    assert rows["rope"]["params"] == 1000
    assert rows["rope"]["glue"]["tasks"] == {
        "MRPC f1": {"mean": pytest.approx(80.0), "std": pytest.approx(0.0), "n": 2},
        "MRPC accuracy": {"mean": pytest.approx(70.0), "std": pytest.approx(0.0), "n": 2}}
    for name in (report.REPORT_JSON, report.REPORT_MD, report.LOSS_CURVES_PNG, report.EXTRAPOLATION_PNG,
                 report.ATTENTION_PNG):
        assert (tmp_path / name).stat().st_size > 0
    assert not (tmp_path / report.EXTENSION_PNG).exists()        # no context extension in this ablation
    assert json.loads((tmp_path / report.REPORT_JSON).read_text()) == json.loads(json.dumps(result))
    md = (tmp_path / report.REPORT_MD).read_text()
    assert "| rope | done |" in md and "| learned | failed |" in md and "| t5 | failed |" in md
    assert "rope + position interpolation" in md and "rope + NTK scaling" in md and "rope + YaRN" in md
    assert "80.0 ± 0.0*" in md   # partial GLUE score is marked
    assert "- learned seed 1 extrapolation: RuntimeError: injected failure" in md

    # Re-run: finished stages are skipped, the failed ones (now healthy) are retried.
    stub_figures(monkeypatch)   # drawn above already
    stages.calls.clear()
    stages.fail.clear()
    result = runner.run_ablation(config, tmp_path)
    assert stages.calls == [("t5/seed0", "pretrain"), ("t5/seed0", "extrapolation"), ("t5/seed0", "glue"),
                            ("learned/seed1", "extrapolation"),
                            ("t5/seed1", "pretrain"), ("t5/seed1", "extrapolation"), ("t5/seed1", "glue")]
    rows = {r["scheme"]: r for r in result["schemes"]}
    assert {s: r["status"] for s, r in rows.items()} == {"learned": "done", "rope": "done", "t5": "done"}
    assert not (tmp_path / "errors" / "learned.seed1.extrapolation.txt").exists()
    # Throughput and step time relative to the fastest scheme (same tokens per step).
    assert rows["learned"]["tokens_per_sec"] == {"mean": 1000.0, "std": 0.0, "n": 2}
    assert [rows[s]["step_time_rel"] for s in ("learned", "rope", "t5")] == pytest.approx([1.0, 1.25, 2.0])

    # A bigger budget changes the pretraining config: every stage of every seed reruns.
    stages.calls.clear()
    config.schemes = ("rope",)
    config.reference = "rope"
    config.budget_tokens *= 2
    runner.run_ablation(config, tmp_path)
    assert stages.calls == [(f"rope/seed{k}", stage) for k in (0, 1)
                            for stage in ("pretrain", "extrapolation", "glue")]


def test_seeds_run_in_turn_and_the_report_aggregates_them(tmp_path, monkeypatch, quick_figures):
    seeds = (0, 1, 2)
    loss = {"learned": [7.5, 7.9, 7.6], "rope": [7.0, 7.3, 7.1]}       # learned - rope: 0.5, 0.6, 0.5
    acc = {"learned": [0.30, 0.20, 0.25], "rope": [0.25, 0.26, 0.24]}  # differences 0.05, -0.06, 0.01
    values = {(s, k): {"eval_loss": loss[s][k], "eval_mlm_accuracy": acc[s][k]} for s in loss for k in seeds}
    ext_loss = {("none", 0): [7.4, 7.35, 7.30], ("none", 1): [7.5, 7.40, 7.36], ("none", 2): [7.45, 7.4, 7.31],
                ("linear", 0): [7.2, 7.10, 7.12], ("linear", 1): [7.3, 7.12, 7.16], ("linear", 2): [7.25, 7.1, 7.14]}
    stages = FakeStages(values=values, extension_loss=ext_loss)
    stages.install(monkeypatch)
    config = small_config(seeds=3, methods="none,linear")
    result = runner.run_ablation(config, tmp_path)
    # The command's last line names outputs that exist.
    named = [word.rstrip(",") for word in ablate.done_line(str(tmp_path), result).split()
             if word.startswith(str(tmp_path))]
    assert len(named) == 5 and all(Path(p).exists() for p in named), named

    # Every scheme of seed 0, then of seed 1, ...; the context extension once every seed is pretrained.
    expected = [(f"{scheme}/seed{k}", stage) for k in seeds for scheme in ("learned", "rope")
                for stage in ("pretrain", "extrapolation", "glue")]
    expected += [(f"extension/{method}/seed{k}", stage) for k in seeds for method in ("none", "linear")
                 for stage in ("extension", "extension_eval")]
    assert stages.calls == expected
    workdir = tmp_path.resolve()
    for k in seeds:
        learned, rope = (stages.configs[(f"{s}/seed{k}", "pretrain")] for s in ("learned", "rope"))
        assert learned.train.seed == rope.train.seed == k
        # Same data, data order, masks, initialisation seed and budget for every scheme of a seed.
        assert learned.train.to_dict() == rope.train.to_dict() and learned.data.to_dict() == rope.data.to_dict()
        for method in ("none", "linear"):
            ext = stages.configs[(f"extension/{method}/seed{k}", "extension")]
            assert ext.train.seed == k
            assert ext.train.init_from == str(workdir / "pretrain" / "rope" / f"seed{k}")
            assert (ext.train.seq_len, ext.train.batch_size) == (2 * rope.train.seq_len, rope.train.batch_size // 2)
            assert ext.train.steps == 10 and ext.model.position == "rope"
        assert stages.configs[(f"extension/linear/seed{k}", "extension")].model.rope_scaling == "linear"
        # Evaluated on the windows of the seed's own extrapolation table (same seed, same masks).
        assert stages.configs[(f"extension/none/seed{k}", "extension_eval")].to_dict() == rope.to_dict()

    runs = result["runs"]
    assert [(r["scheme"], r["seed"], r["status"]) for r in runs] == \
        [(s, k, "done") for k in seeds for s in ("learned", "rope")]
    assert all(r["eval_order_gap"] is not None and len(r["curve"]) == 2 for r in runs)
    rows = {r["scheme"]: r for r in result["schemes"]}
    for scheme in ("learned", "rope"):
        row = rows[scheme]
        assert row["status"] == "done" and row["seeds"] == [0, 1, 2]
        for key, table in (("eval_loss", loss), ("eval_mlm_accuracy", acc)):
            assert row[key]["n"] == 3
            assert row[key]["mean"] == pytest.approx(np.mean(table[scheme]))
            assert row[key]["std"] == pytest.approx(np.std(table[scheme], ddof=1))
        # The held-out curve over seeds: the final point is the final loss; the order gap at every evaluation.
        assert [p["step"] for p in row["curve"]["eval_loss"]] == [20, 40]
        assert row["curve"]["eval_loss"][-1]["mean"] == pytest.approx(np.mean(loss[scheme]))
        assert [p["step"] for p in row["curve"]["eval_order_gap"]] == [20, 40]
        assert row["order_onset_tokens"] == 20 * 16 * 64   # gap at step 20 (0.15 / 0.25) >= 0.1
        # The attention stats over training: the most local head, the output layer's cosine.
        assert [p["mean"] for p in row["curve"]["nearest_head_distance"]] == pytest.approx([6.0, 2.0])
        assert [p["mean"] for p in row["curve"]["last_hidden_cosine"]] == pytest.approx([0.65, 0.4])
    assert rows["rope"]["vs_reference"] == {}
    assert runs[0]["curve"][-1]["attention_distance"] == [[2.0, 12.0]]
    assert "| rope | 2.00 ± 0.00 | 0.400 ± 0.000 |" in report.to_markdown(result)
    # Every seed of both schemes passes the order threshold at its first evaluation (step 20).
    onsets = {s["scheme"]: s for s in result["onset"]["schemes"]}
    assert [(onsets[s]["started"], onsets[s]["observed"], onsets[s]["median_onset"]) for s in ("learned", "rope")] \
        == [(3, 3, 20 * 16 * 64)] * 2
    cells = {r["scheme"]: r["cells"] for r in result["onset"]["loss_at_matched_tokens"]}
    assert cells["learned"][-1]["vs_reference"]["diff"] == pytest.approx(np.mean(loss["learned"]) - np.mean(loss["rope"]))
    assert "## Onset of word-order use (per seed)" in report.to_markdown(result)

    def interval(diffs):
        diffs = np.asarray(diffs)
        half = stats.t.ppf(0.975, df=len(diffs) - 1) * np.std(diffs, ddof=1) / np.sqrt(len(diffs))
        return diffs.mean(), diffs.mean() - half, diffs.mean() + half

    for key, table, exceeds in (("eval_loss", loss, True), ("eval_mlm_accuracy", acc, False)):
        d = rows["learned"]["vs_reference"][key]
        mean, lo, hi = interval(np.subtract(table["learned"], table["rope"]))
        assert (d["diff"], d["lo"], d["hi"]) == pytest.approx((mean, lo, hi))
        assert d["n"] == 3 and d["exceeds"] is exceeds
    assert any(f.startswith("Held-out MLM loss higher than rope by more than the seed spread")
               and "learned (+0.533" in f for f in result["findings"])

    ext = result["extension"]
    assert ext["length"] == 128
    methods = {m["method"]: m for m in ext["methods"]}
    assert list(methods) == ["none", "linear"]
    for method, m in methods.items():
        assert m["status"] == "done" and m["seeds"] == [0, 1, 2] and m["steps"] == [0, 5, 10]
        for i, stat in enumerate(m["loss"]):
            column = [ext_loss[(method, k)][i] for k in seeds]
            assert (stat["mean"], stat["std"], stat["n"]) == \
                pytest.approx((np.mean(column), np.std(column, ddof=1), 3))
    assert methods["none"]["vs_plain"] is None
    d = methods["linear"]["vs_plain"]
    mean, lo, hi = interval([ext_loss[("linear", k)][-1] - ext_loss[("none", k)][-1] for k in seeds])
    assert (d["diff"], d["lo"], d["hi"]) == pytest.approx((mean, lo, hi)) and d["exceeds"] is True
    assert [(r["method"], r["seed"], r["status"]) for r in ext["runs"]] == \
        [(m, k, "done") for k in seeds for m in ("none", "linear")]
    assert ("plot_extension", tmp_path / report.EXTENSION_PNG) in quick_figures
    md = (tmp_path / report.REPORT_MD).read_text()
    assert "## Context extension" in md and "| position interpolation | done |" in md
    # The real figures of this multi-seed report: a mean line with a ±std band per scheme / method.
    monkeypatch.undo()
    assert len(report.plot_extension(result).axes[0].lines) == 2
    assert len(report.plot_loss_curves(result).axes[1].lines) == 2


def test_every_run_reads_one_pinned_vocabulary_kept_in_the_workdir(tmp_path, monkeypatch, quick_figures):
    """WordPiece training is not deterministic, so a vocabulary trained on the corpus is
    pinned in the workdir once and every run (and a resumed ablation) reads that file;
    fingerprints stay those of the config as written."""
    from roformer.data.tokenizer import WordPieceTokenizer

    stages = FakeStages()
    stages.install(monkeypatch)
    config = small_config("rope", seeds=1, methods="none")
    config.pretrain.data.vocab = ""
    config.pretrain.data.vocab_size = 300
    config.pretrain.data.cache_dir = str(tmp_path / "cache")

    # A fresh workdir trains the vocabulary through the data pipeline (cached) and pins it.
    fresh = tmp_path / "fresh"
    result = runner.run_ablation(config, fresh)
    pinned = fresh / PINNED_TOKENIZER
    assert WordPieceTokenizer.from_tokenizer_json(pinned).vocab_size == 300
    assert any((tmp_path / "cache" / "tokenizers").iterdir())
    assert {cfg.data.vocab for cfg in stages.configs.values()} == {str(pinned)}
    assert result["setup"]["unigram_loss"] > 0
    saved = (fresh / STATE_FILE).read_text()
    assert plan.fingerprint(plan.build_plan(config, fresh).scheme_configs["rope"]) in saved

    # An older workdir whose first run trained its own vocabulary pins that one, not the
    # cached one a new run would get.
    older = tmp_path / "older"
    run_dir = older / "pretrain" / "rope" / "seed0"
    own = WordPieceTokenizer.train(["the first run trained its own small vocabulary"] * 20, vocab_size=120,
                                   lowercase=True, show_progress=False)
    own.save(run_dir)
    (run_dir / "checkpoints").mkdir()
    runner.run_ablation(config, older)
    assert (older / PINNED_TOKENIZER).read_text() == (run_dir / "tokenizer.json").read_text()


def test_preempted_pretraining_stops_the_ablation_and_resumes(tmp_path, monkeypatch, quick_figures):
    stages = FakeStages(preempt={("learned/seed0", "pretrain")})
    stages.install(monkeypatch)
    config = small_config(methods="none,linear")   # 2 seeds
    result = runner.run_ablation(config, tmp_path)
    assert stages.calls == [("learned/seed0", "pretrain")]          # stopped, not marked failed
    assert [r["status"] for r in result["runs"]] == ["pending"] * 4
    assert [r["status"] for r in result["schemes"]] == ["0/2 seeds"] * 2
    assert [r["status"] for r in result["extension"]["runs"]] == ["pending"] * 4
    assert not (tmp_path / "errors").exists()

    stages.preempt.clear()
    result = runner.run_ablation(config, tmp_path)
    assert stages.calls.count(("learned/seed0", "pretrain")) == 2 and len(stages.calls) == 1 + 4 * 3 + 4 * 2
    assert [r["status"] for r in result["schemes"]] == ["done", "done"]
    assert [m["status"] for m in result["extension"]["methods"]] == ["done", "done"]


def test_preempted_extension_resumes_with_only_what_is_left(tmp_path, monkeypatch, quick_figures):
    stages = FakeStages(preempt={("extension/linear/seed1", "extension")})
    stages.install(monkeypatch)
    config = small_config(methods="none,linear,yarn")   # 2 seeds
    result = runner.run_ablation(config, tmp_path)
    assert stages.calls[-3:] == [("extension/none/seed1", "extension"), ("extension/none/seed1", "extension_eval"),
                                 ("extension/linear/seed1", "extension")]
    assert [r["status"] for r in result["runs"]] == ["done"] * 4
    assert {(r["method"], r["seed"]): r["status"] for r in result["extension"]["runs"]} == {
        ("none", 0): "done", ("linear", 0): "done", ("yarn", 0): "done",
        ("none", 1): "done", ("linear", 1): "pending", ("yarn", 1): "pending"}
    assert [m["status"] for m in result["extension"]["methods"]] == ["done", "1/2 seeds", "1/2 seeds"]
    assert [m["seeds"] for m in result["extension"]["methods"]] == [[0, 1], [0], [0]]
    assert json.loads((tmp_path / report.REPORT_JSON).read_text()) == json.loads(json.dumps(result))

    stages.calls.clear()
    stages.preempt.clear()
    result = runner.run_ablation(config, tmp_path)
    assert stages.calls == [("extension/linear/seed1", "extension"), ("extension/linear/seed1", "extension_eval"),
                            ("extension/yarn/seed1", "extension"), ("extension/yarn/seed1", "extension_eval")]
    assert [m["status"] for m in result["extension"]["methods"]] == ["done"] * 3
    assert all(m["seeds"] == [0, 1] for m in result["extension"]["methods"])

    # Nothing is left: a third run trains and evaluates nothing.
    stages.calls.clear()
    runner.run_ablation(config, tmp_path)
    assert stages.calls == []


def test_report_snapshot_reads_a_running_ablation_and_trains_nothing(tmp_path, monkeypatch, quick_figures):
    from roformer.errors import ConfigError
    from roformer.workdir_lock import workdir_lock

    stages = FakeStages(preempt={("rope/seed1", "pretrain")})
    stages.install(monkeypatch)
    config = small_config(methods="none")
    runner.run_ablation(config, tmp_path)
    calls = list(stages.calls)
    # As if the ablation were still running: its lock is held, and seed 1 of rope has trained
    # only part of its steps (no evaluation yet, so its onset is not observed).
    with workdir_lock(tmp_path):
        result = runner.report_snapshot(config, tmp_path, tmp_path / "snapshot")
    assert stages.calls == calls
    assert [(r["scheme"], r["seed"], r["status"]) for r in result["runs"]] == \
        [("learned", 0, "done"), ("rope", 0, "done"), ("learned", 1, "done"), ("rope", 1, "pending")]
    onsets = {s["scheme"]: s for s in result["onset"]["schemes"]}
    assert (onsets["learned"]["observed"], onsets["rope"]["observed"]) == (2, 1)
    md = (tmp_path / "snapshot" / report.REPORT_MD).read_text()
    assert "## Onset of word-order use (per seed)" in md and "| rope | 1 / 1 |" in md
    with pytest.raises(ConfigError, match="holds no ablation"):
        runner.report_snapshot(config, tmp_path / "snapshot", tmp_path / "elsewhere")


def test_config_stages_name_what_each_scheme_run_does(tmp_path, monkeypatch, quick_figures):
    stages = FakeStages()
    stages.install(monkeypatch)
    config = small_config("rope", seeds=1)
    config.extension.enabled = False
    config.stages = ("pretrain", "glue")
    result = runner.run_ablation(config, tmp_path)
    assert stages.calls == [("rope/seed0", "pretrain"), ("rope/seed0", "glue")]
    assert result["runs"][0]["status"] == "done" and result["runs"][0]["extrapolation"] is None
    assert result["runs"][0]["glue_workdir"] == "glue/rope/seed0"
