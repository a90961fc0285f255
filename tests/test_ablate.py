"""Ablation orchestration, report building and length-extrapolation evaluation.

The orchestration tests swap the three stage runners for fast fakes that write what
the real ones write (metrics.jsonl, glue_results.json), so skipping, resuming and
failure handling are checked without training; tests/test_notebooks.py runs a tiny
real ablation end to end.
"""
import json

import jax
import numpy as np
import pytest
from flax import nnx

from roformer import ablate, extrapolation, report
from roformer.model import ModelConfig, RoFormerForMaskedLM


def small_config(schemes="learned,rope"):
    config = ablate.load_config_file("ablation", "smoke")
    config.schemes = schemes
    return config


class FakeStages:
    """Stage runners that record their calls and write the files the real ones write."""

    def __init__(self, fail=()):
        self.calls = []
        self.fail = set(fail)   # {(scheme, stage)}

    def _check(self, scheme, stage):
        self.calls.append((scheme, stage))
        if (scheme, stage) in self.fail:
            raise RuntimeError(f"injected failure in {scheme} {stage}")

    def pretrain(self, cfg, workdir):
        scheme = workdir.name
        self._check(scheme, "pretrain")
        workdir.mkdir(parents=True, exist_ok=True)
        speed = {"learned": 1000.0, "rope": 800.0}.get(scheme, 500.0)
        with open(workdir / "metrics.jsonl", "a") as f:
            for step in range(5, cfg.train.steps + 1, 5):
                f.write(json.dumps({"step": step, "loss": 8.0 - step / 10, "mlm_accuracy": step / 100,
                                    "tokens_per_sec": speed}) + "\n")
            f.write(json.dumps({"step": cfg.train.steps, "eval_loss": 7.0 if scheme == "rope" else 7.5,
                                "eval_mlm_accuracy": 0.1}) + "\n")
        return {"steps": cfg.train.steps}

    def extrapolation(self, config, pretrain_cfg, pretrain_dir):
        scheme = pretrain_dir.name
        self._check(scheme, "extrapolation")
        lengths = [64, 128, 256]
        loss = {"plain": [7.0, None, None] if scheme == "learned" else [7.0, 7.4, 7.9]}
        if scheme == "rope":
            loss.update(linear=[7.0, 7.2, 7.5], ntk=[7.0, 7.1, 7.3])
        return {"params": 1000, "extrapolation": {"lengths": lengths, "rows": [8, 8, 8], "loss": loss}}

    def glue(self, cfg, workdir):
        self._check(workdir.name, "glue")
        workdir.mkdir(parents=True, exist_ok=True)
        results = {"tasks": {"mrpc": {"median": {"dev": {"f1": 0.8, "accuracy": 0.7}}}},
                   "glue": {"glue_bert_9": {"score": 80.0, "complete": False}}}
        (workdir / "glue_results.json").write_text(json.dumps(results))
        return {}

    def install(self, monkeypatch):
        monkeypatch.setitem(ablate.STAGE_RUNNERS, "pretrain", self.pretrain)
        monkeypatch.setitem(ablate.STAGE_RUNNERS, "extrapolation", self.extrapolation)
        monkeypatch.setitem(ablate.STAGE_RUNNERS, "glue", self.glue)


def test_schemes_share_everything_but_the_model_position():
    config = small_config("learned,sinusoidal,shaw,t5,rope,rope_linear")
    cfgs = {s: ablate.scheme_pretrain_config(config, s) for s in ablate._split_list(config.schemes)}
    expected_steps = -(-config.budget_tokens // (config.pretrain.train.batch_size * config.pretrain.train.seq_len))
    for scheme, cfg in cfgs.items():
        assert cfg.data.to_dict() == config.pretrain.data.to_dict()
        assert cfg.train.steps == expected_steps
        assert {k: v for k, v in cfg.train.items() if k != "steps"} == \
            {k: v for k, v in config.pretrain.train.items() if k != "steps"}
        assert cfg.model.size == "tiny"
        assert cfg.model.max_position_embeddings == cfg.train.seq_len
    positions = {s: c.model.position for s, c in cfgs.items()}
    assert positions == {"learned": "learned", "sinusoidal": "sinusoidal", "shaw": "shaw", "t5": "t5",
                         "rope": "rope", "rope_linear": "rope"}
    assert cfgs["rope_linear"].model.attention == "linear" and cfgs["rope"].model.attention == "softmax"
    with pytest.raises(ValueError, match="unknown scheme 'rotery'"):
        ablate.scheme_pretrain_config(config, "rotery")


def test_run_writes_report_skips_finished_and_reports_failures(tmp_path, monkeypatch):
    stages = FakeStages(fail={("learned", "extrapolation"), ("t5", "pretrain")})
    stages.install(monkeypatch)
    config = small_config("learned,rope,bogus,t5")
    result = ablate.run_ablation(config, tmp_path)

    rows = {r["scheme"]: r for r in result["schemes"]}
    assert rows["rope"]["status"] == "done"
    assert rows["learned"]["status"] == "failed" and rows["learned"]["failed_stage"] == "extrapolation"
    assert "injected failure" in rows["learned"]["error"]
    assert rows["bogus"]["status"] == "failed" and "unknown scheme" in rows["bogus"]["error"]
    assert ("learned", "glue") in stages.calls              # fine-tuning needs only the pretrained model
    assert rows["t5"]["status"] == "failed" and rows["t5"]["failed_stage"] == "pretrain"
    assert [c for c in stages.calls if c[0] == "t5"] == [("t5", "pretrain")]   # nothing to evaluate
    assert (tmp_path / "errors" / "learned.extrapolation.txt").exists()
    # Throughput and step time relative to the fastest scheme.
    assert rows["learned"]["tokens_per_sec"] == 1000.0 and rows["rope"]["step_time_rel"] == pytest.approx(1.25)
    assert rows["rope"]["eval_loss"] == 7.0 and rows["rope"]["params"] == 1000
    assert rows["rope"]["glue"]["tasks"] == {"MRPC f1": pytest.approx(80.0), "MRPC accuracy": pytest.approx(70.0)}
    for name in (report.REPORT_JSON, report.REPORT_MD, report.LOSS_CURVES_PNG, report.EXTRAPOLATION_PNG):
        assert (tmp_path / name).stat().st_size > 0
    assert json.loads((tmp_path / report.REPORT_JSON).read_text()) == json.loads(json.dumps(result))
    md = (tmp_path / report.REPORT_MD).read_text()
    assert "| rope | done |" in md and "| learned | failed |" in md
    assert "rope + position interpolation" in md and "rope + NTK scaling" in md
    assert "80.0*" in md   # partial GLUE score is marked

    # Re-run: finished stages are skipped, the failed one (now healthy) is retried.
    stages.calls.clear()
    stages.fail.clear()
    result = ablate.run_ablation(config, tmp_path)
    assert stages.calls == [("learned", "extrapolation"), ("t5", "pretrain"), ("t5", "extrapolation"),
                            ("t5", "glue")]
    assert {r["scheme"]: r["status"] for r in result["schemes"]} == \
        {"learned": "done", "rope": "done", "bogus": "failed", "t5": "done"}
    assert not (tmp_path / "errors" / "learned.extrapolation.txt").exists()

    # A bigger budget changes the pretraining config: every stage of every scheme reruns.
    stages.calls.clear()
    config.schemes = "rope"
    config.budget_tokens *= 2
    ablate.run_ablation(config, tmp_path)
    assert stages.calls == [("rope", "pretrain"), ("rope", "extrapolation"), ("rope", "glue")]


def test_preempted_pretraining_stops_the_ablation_and_resumes(tmp_path, monkeypatch):
    stages = FakeStages()
    stages.install(monkeypatch)

    def preempted(cfg, workdir):
        stages.calls.append((workdir.name, "pretrain"))
        raise ablate.Preempted(f"{workdir} preempted")

    monkeypatch.setitem(ablate.STAGE_RUNNERS, "pretrain", preempted)
    result = ablate.run_ablation(small_config(), tmp_path)
    assert stages.calls == [("learned", "pretrain")]          # stopped, not marked failed
    assert [r["status"] for r in result["schemes"]] == ["pending", "pending"]

    monkeypatch.setitem(ablate.STAGE_RUNNERS, "pretrain", stages.pretrain)
    result = ablate.run_ablation(small_config(), tmp_path)
    assert [r["status"] for r in result["schemes"]] == ["done", "done"]


def test_report_helpers():
    rows = [{"step": 10, "loss": 5.0, "mlm_accuracy": 0.1, "tokens_per_sec": 50.0},
            {"step": 20, "loss": 4.0, "mlm_accuracy": 0.2, "tokens_per_sec": 100.0},
            {"step": 20, "eval_loss": 4.5, "eval_mlm_accuracy": 0.15},
            {"step": 20, "loss": 3.9, "mlm_accuracy": 0.21, "tokens_per_sec": 110.0}]  # resumed run re-logs 20
    summary = report.pretrain_summary(rows)
    assert summary["train_loss"] == 3.9 and summary["eval_loss"] == 4.5 and summary["steps"] == 20
    assert summary["tokens_per_sec"] == 105.0   # first (compiling) interval left out
    assert report.loss_curves(rows) == {"train": [(10, 5.0), (20, 3.9)], "eval": [(20, 4.5)]}

    schemes = [{"scheme": "a", "status": "done", "tokens_per_sec": 100.0, "eval_loss": 3.0},
               {"scheme": "b", "status": "done", "tokens_per_sec": 50.0, "eval_loss": 2.5},
               {"scheme": "c", "status": "failed", "tokens_per_sec": None, "error": "boom"}]
    report.add_relative_step_time(schemes)
    assert [s["step_time_rel"] for s in schemes] == [1.0, 2.0, None]
    assert report.winners(schemes) == {"held-out MLM loss": "b (2.500)"}
    schemes[0]["eval_loss"] = 2.5001      # equal at the printed precision
    assert report.winners(schemes) == {"held-out MLM loss": "all tied (2.500)"}
    md = report.to_markdown({"schemes": schemes})
    assert "| c | failed | n/a |" in md and "- c (?): boom" in md


def test_read_metrics_ignores_a_torn_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    assert report.read_metrics(path) == [{"step": 1, "loss": 2.0}]
    assert report.read_metrics(tmp_path / "missing.jsonl") == []


def _batches(rng, batch_size, length, vocab, num_batches=1, predictions=6):
    batches = []
    for _ in range(num_batches):
        batches.append({
            "input_ids": rng.integers(5, vocab, (batch_size, length)).astype(np.int32),
            "token_type_ids": np.zeros((batch_size, length), np.int32),
            "positions": np.tile(np.arange(length, dtype=np.int32), (batch_size, 1)),
            "segment_ids": np.ones((batch_size, length), np.int32),
            "masked_positions": rng.integers(0, length, (batch_size, predictions)).astype(np.int32),
            "masked_labels": rng.integers(5, vocab, (batch_size, predictions)).astype(np.int32),
            "masked_weights": np.ones((batch_size, predictions), np.float32),
        })
    return batches


def test_windows_cover_the_same_leading_text_at_every_length():
    from roformer.data.packing import plan_rows

    doc_len = np.array([600, 40, 700])    # document 1 is too short for a 256-token window
    for window, expected in ((64, 4), (128, 2), (256, 1)):
        plan = plan_rows(np.array([0, 2]), doc_len, window, "document")
        picked = extrapolation.window_rows(plan.doc, plan.offset, plan.length, window, max_len=256)
        assert list(plan.doc[picked]) == [0] * expected + [2] * expected
        assert np.all(plan.length[picked] == window - 2)
        assert np.all(plan.offset[picked] + plan.length[picked] <= 254)   # inside the first 256 tokens


def test_extrapolation_evaluate_learned_na_and_rope_scalings():
    rng = np.random.default_rng(0)
    vocab, seq_len = 64, 16
    batches = {n: _batches(rng, 2, n, vocab) for n in (seq_len, 2 * seq_len)}
    common = dict(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, vocab_size=vocab,
                  max_position_embeddings=seq_len,
                  initializer_range=0.5)   # sharp attention, so position scalings visibly matter

    def init(position):
        config = ModelConfig.from_preset("tiny", position=position, **common)
        return config, nnx.to_pure_dict(nnx.state(RoFormerForMaskedLM(config, rngs=nnx.Rngs(0)), nnx.Param))

    # Learned absolute at 2x its table: n/a, without evaluating anything.
    learned = extrapolation.evaluate(*init("learned"), {2 * seq_len: batches[2 * seq_len]}, seq_len)
    assert learned["lengths"] == [32] and learned["loss"] == {"plain": [None]}

    config, params = init("rope")
    rope = extrapolation.evaluate(config, params, batches, seq_len, scalings=("linear", "ntk"))
    plain, linear, ntk = (rope["loss"][k] for k in ("plain", "linear", "ntk"))
    assert linear[0] == ntk[0] == plain[0]          # factor 1 is the unscaled model
    assert linear[1] != plain[1] and ntk[1] != plain[1] and linear[1] != ntk[1]
    assert extrapolation.count_params(params) == sum(np.size(x) for x in jax.tree.leaves(params))
    with pytest.raises(ValueError, match="choose from"):
        extrapolation.evaluate(config, params, batches, seq_len, scalings=("yarnish",))
