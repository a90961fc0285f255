"""scripts/recipe_sweep.py: its table compares variants at equal tokens and at equal wall time.

The runs are synthetic workdirs (summary.json, metrics.jsonl and tokenizer.json, what
`roformer.pretrain` writes); the vocabulary's unigram loss is stubbed (it tokenizes the corpus).
"""
import importlib.util
import json

import pytest

from helpers import REPO_ROOT


@pytest.fixture()
def sweep(monkeypatch):
    spec = importlib.util.spec_from_file_location("recipe_sweep", REPO_ROOT / "scripts" / "recipe_sweep.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "unigram_loss", lambda settings: (settings["data.vocab_size"], 7.5))
    return module


def write_run(root, variant, tokens_per_sec, losses, tokens_per_step):
    """A finished 700-step run evaluated every 100 steps with the given held-out losses."""
    workdir = root / variant
    workdir.mkdir(parents=True)
    rows = [{"step": 100 * (i + 1), "eval_loss": loss} for i, loss in enumerate(losses)]
    (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (workdir / "tokenizer.json").write_text(json.dumps({"vocabulary of": variant}))   # the run's own
    (workdir / "summary.json").write_text(json.dumps({
        "final_step": 700, "eval_loss": losses[-1], "eval_mlm_accuracy": 0.2, "eval_order_gap": 1.234,
        "tokens_per_sec": tokens_per_sec}))


def table_rows(text):
    return {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in text.splitlines() if line.startswith("| ") and not line.startswith("| variant")}


def test_equal_wall_time_reads_each_curve_at_the_fastest_budget(sweep, tmp_path):
    tokens_per_step = 32 * 128
    losses = [7.0, 6.5, 6.2, 6.0, 5.9, 5.8, 5.7]
    write_run(tmp_path, "base", 10_000.0, losses, tokens_per_step)
    write_run(tmp_path, "vocab_4000", 20_000.0, [x - 1 for x in losses], tokens_per_step)
    rows = table_rows(sweep.report(tmp_path, ["base", "vocab_4000"]))
    # vocab_4000 finishes its 2.87M tokens in half of base's time: base is read at 350 steps.
    assert rows["base"][3] == "5.700" and rows["base"][6] == "6.100"
    assert rows["vocab_4000"][6] == "4.700"   # its whole budget
    assert rows["base"][7] == "1.23"          # the word-order probe at the end


def test_speed_measured_alone_replaces_the_sweep_runs_figures(sweep, tmp_path):
    tokens_per_step = 32 * 128
    losses = [7.0, 6.5, 6.2, 6.0, 5.9, 5.8, 5.7]
    write_run(tmp_path, "base", 10_000.0, losses, tokens_per_step)
    write_run(tmp_path, "vocab_4000", 20_000.0, losses, tokens_per_step)
    # Measured alone the two are equally fast: equal wall time is then equal tokens.
    (tmp_path / sweep.SPEED_FILE).write_text(json.dumps({"base": 15_000.0, "vocab_4000": 15_000.0}))
    text = sweep.report(tmp_path, ["base", "vocab_4000"])
    assert "measured alone" in text.splitlines()[0]
    rows = table_rows(text)
    assert rows["base"][2] == "15,000" and rows["base"][6] == "5.700" and rows["vocab_4000"][6] == "5.700"


def test_speed_times_each_distinct_step_once(sweep, tmp_path, monkeypatch):
    """Variants that change only the learning rate, warmup or schedule share one timing."""
    timed = []
    monkeypatch.setattr(sweep, "measure_speed", lambda v, root: timed.append(v) or 1000.0 * len(timed))
    monkeypatch.setattr(sweep.sys, "argv", ["recipe_sweep.py", "--workdir", str(tmp_path), "--speed",
                                            "--only", "base,lr_1e-3,cosine,batch_16,learned,learned_lr_4e-3"])
    sweep.main()
    assert timed == ["base", "batch_16", "learned"]
    speed = json.loads((tmp_path / sweep.SPEED_FILE).read_text())
    assert speed == {"base": 1000.0, "lr_1e-3": 1000.0, "cosine": 1000.0, "batch_16": 2000.0,
                     "learned": 3000.0, "learned_lr_4e-3": 3000.0}
