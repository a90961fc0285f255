"""scripts/lr_sweep.py: per scheme, the best rate among those it ran, and when that best sits
at the edge of its rates. The ablation reports are synthetic (the rows `roformer.ablate`
writes into ablation.json)."""
import importlib.util
import json

import pytest

from helpers import REPO_ROOT


@pytest.fixture()
def sweep():
    spec = importlib.util.spec_from_file_location("lr_sweep", REPO_ROOT / "scripts" / "lr_sweep.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_rate(sweep, root, rate, rows):
    workdir = sweep.rate_workdir(root, rate)
    workdir.mkdir(parents=True)
    runs = [{"scheme": s, "seed": 0, "status": status, "eval_loss": loss, "eval_order_gap": 0.01}
            for s, (loss, status) in rows.items()]
    (workdir / "ablation.json").write_text(json.dumps({"runs": runs}))


def test_best_rate_per_scheme_and_the_edge_of_its_grid(sweep, tmp_path):
    write_rate(sweep, tmp_path, "0.0005", {"shaw": (6.46, "done")})                    # shaw only
    write_rate(sweep, tmp_path, "0.001", {"shaw": (5.59, "done"), "rope": (5.64, "done"), "t5": (6.3, "done")})
    write_rate(sweep, tmp_path, "0.002", {"shaw": (6.33, "done"), "rope": (4.69, "done"), "t5": (None, "failed")})
    write_rate(sweep, tmp_path, "0.004", {"shaw": (6.33, "done"), "rope": (4.80, "pending")})
    result = sweep.collect(tmp_path, ["0.0005", "0.001", "0.002", "0.004"])
    # shaw: best 1e-3 inside its grid; rope: best 2e-3 of the two it finished, its highest (4e-3
    # not done yet); t5: one finished rate, no choice yet.
    assert result["best"] == {"shaw": "0.001", "rope": "0.002"}
    assert result["edge"] == {"rope": "higher"}
    assert result["scheme_learning_rates"] == "shaw=0.001,rope=0.002"
    text = sweep.to_markdown(result)
    assert "| shaw | 6.460 / +0.010 | **5.590** / +0.010 | 6.330 / +0.010 | 6.330 / +0.010 | 0.001 |" in text
    assert "| rope | not run | 5.640 / +0.010 | **4.690** / +0.010 | pending | 0.002 (edge of the rates run: try higher) |" \
        in text
    assert "| t5 | not run | 6.300 / +0.010 | failed | not run | - |" in text
