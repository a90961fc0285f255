"""Both notebooks execute top to bottom (nbclient) on tiny settings.

The ablation-report notebook reads the output of a tiny but real ablation run
(pretraining, length extrapolation and GLUE for two schemes), which is also
checked here end to end.
"""
import json
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from roformer import ablate, report

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def execute_notebook(name: str, parameters: dict, cwd: Path, monkeypatch) -> nbformat.NotebookNode:
    """Run a notebook with its `parameters`-tagged cell replaced; fails on any cell error."""
    monkeypatch.setenv("MPLBACKEND", "Agg")   # the kernel inherits it: no display needed
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    cell.source = "\n".join(f"{key} = {value!r}" for key, value in parameters.items())
    NotebookClient(nb, timeout=180, kernel_name="python3",
                   resources={"metadata": {"path": str(cwd)}}).execute()
    return nb


def outputs(nb, kind: str) -> list:
    """All outputs of a mime type ('image/png', 'text/markdown') or of stream text ('stream')."""
    found = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if kind == "stream" and out.output_type == "stream":
                found.append(out.text)
            elif kind in out.get("data", {}):
                found.append(out.data[kind])
    return found


def test_rope_explained_notebook(tmp_path, monkeypatch):
    nb = execute_notebook("rope_explained.ipynb", {
        "HEAD_DIM": 32, "MAX_DISTANCE": 64, "BASES": (100.0, 10000.0),
        "INTERPOLATION_FACTORS": (2.0,), "NUM_SHIFT_CHECKS": 20}, tmp_path, monkeypatch)
    text = "".join(outputs(nb, "stream"))
    assert "max |score(m,n) - score(m+s,n+s)|" in text
    assert "y_PI(s * t) == y(t)" in text
    assert len(outputs(nb, "image/png")) == 4


def tiny_ablation_config(shared_data: Path, cache_dir: Path):
    """configs/ablation.py:smoke shrunk to seconds: 1-layer 32-wide model, 4 steps, 16 GLUE rows."""
    config = ablate.load_config_file("ablation", "smoke")
    config.schemes = "learned,rope"
    pre = config.pretrain
    pre.model.update(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    pre.data.vocab = str(shared_data / "vocab" / "bert-base-uncased-vocab.txt")
    pre.data.cache_dir = str(cache_dir)
    pre.data.num_workers = 1
    pre.mesh.num_devices = 1   # one of the 8 virtual test devices: a smaller program to compile
    pre.train.update(seq_len=32, batch_size=8, warmup_steps=1, log_every=2, eval_every=4, eval_batches=1,
                     checkpoint_every=4, async_checkpoints=False, progress_bar=False,
                     peak_flops_per_device=1e11)   # skip measuring the CPU matmul peak
    config.budget_tokens = 4 * 8 * 32          # 4 steps
    config.glue.update(task="wnli", data_dir=str(shared_data / "glue"), max_train_examples=16,
                       max_eval_examples=16, max_seq_len=16, batch_size=8, eval_batch_size=16)
    config.extrapolation.update(factors="1,2", num_docs=2, batch_size=4)
    return config


def test_tiny_ablation_and_report_notebook(tmp_path, monkeypatch, shared_data):
    workdir = tmp_path / "ablation"
    result = ablate.run_ablation(tiny_ablation_config(shared_data, tmp_path / "cache"), workdir)

    rows = {r["scheme"]: r for r in result["schemes"]}
    assert {s: r["status"] for s, r in rows.items()} == {"learned": "done", "rope": "done"}, \
        [(r["scheme"], r.get("error")) for r in result["schemes"]]
    for row in rows.values():
        assert row["steps"] == 4 and row["params"] > 0 and row["eval_loss"] > 0
        assert (workdir / row["pretrain_workdir"] / "checkpoints").is_dir()   # ordinary pretrain workdir
        assert "WNLI accuracy" in row["glue"]["tasks"]
    assert rows["learned"]["extrapolation"]["loss"]["plain"][1] is None          # beyond its table
    assert set(rows["rope"]["extrapolation"]["loss"]) == {"plain", "linear", "ntk"}
    assert all(v is not None for v in rows["rope"]["extrapolation"]["loss"]["ntk"])
    assert json.loads((workdir / report.REPORT_JSON).read_text())["schemes"][0]["scheme"] == "learned"
    assert (workdir / report.LOSS_CURVES_PNG).stat().st_size > 0

    nb = execute_notebook("ablation_report.ipynb", {"ABLATION_DIR": str(workdir)}, tmp_path, monkeypatch)
    tables = outputs(nb, "text/markdown")
    assert tables and "| rope | done |" in tables[0] and "| learned | done |" in tables[0]
    assert len(outputs(nb, "image/png")) == 3      # loss curves, extrapolation, GLUE
