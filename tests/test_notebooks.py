"""Both notebooks execute top to bottom (nbclient) on tiny settings.

The ablation-report notebook reads the output of a tiny but real ablation run
(pretraining with the word-order probe, length extrapolation and GLUE for two schemes
and two seeds, then a context extension of rope), which is also checked here end to end.
"""
import json
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from roformer.ablation import plan, report, runner

from helpers import patient

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def execute_notebook(name: str, parameters: dict, cwd: Path, monkeypatch) -> nbformat.NotebookNode:
    """Run a notebook with its `parameters`-tagged cell replaced; fails on any cell error."""
    monkeypatch.setenv("MPLBACKEND", "Agg")   # the kernel inherits it: no display needed
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    cell.source = "\n".join(f"{key} = {value!r}" for key, value in parameters.items())
    NotebookClient(nb, timeout=round(patient(180)), kernel_name="python3",
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


# Plain extrapolation and YaRN: each extension run costs a compile, so two of the five
# methods (tests/ablation/test_ablate.py covers every method's config and the per-seed plumbing).
EXTENSION_METHODS = ("none", "yarn")


def tiny_ablation_config(shared_data: Path, cache_dir: Path):
    """configs/ablation.py:smoke shrunk to seconds: 1-layer 32-wide model, 4 steps (evaluated
    every 2), 16 GLUE rows, 2 pretraining seeds, and a 4-step context extension of seed 0's
    rope at 2x the length, evaluated every 2 steps."""
    config = plan.load_config_file("ablation", "smoke")
    config.schemes = ("learned", "rope")
    config.seeds = 2
    pre = config.pretrain
    pre.model.update(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    pre.data.vocab = str(shared_data / "vocab" / "bert-base-uncased-vocab.txt")
    pre.data.cache_dir = str(cache_dir)
    pre.data.num_workers = 1
    pre.mesh.num_devices = 1   # one of the 8 virtual test devices: a smaller program to compile
    pre.train.update(seq_len=32, batch_size=8, warmup_steps=1, log_every=2, eval_every=2, eval_batches=1,
                     checkpoint_every=4, async_checkpoints=False, progress_bar=False,
                     peak_flops_per_device=1e11)   # skip measuring the CPU matmul peak
    config.budget_tokens = 4 * 8 * 32          # 4 steps
    config.glue.update(task="wnli", data_dir=str(shared_data / "glue"), max_train_examples=16,
                       max_eval_examples=16, max_seq_len=16, batch_size=8, eval_batch_size=16)
    config.extrapolation.update(factors=(1, 2), num_docs=2, batch_size=4, scalings=("linear", "ntk", "yarn"))
    config.extension.update(enabled=True, scheme="rope", seeds=1, methods=EXTENSION_METHODS,
                            factor=2, steps=4, eval_every=2, warmup_steps=1)
    return config


@pytest.mark.slow
def test_tiny_ablation_and_report_notebook(tmp_path, monkeypatch, shared_data):
    workdir = tmp_path / "ablation"
    result = runner.run_ablation(tiny_ablation_config(shared_data, tmp_path / "cache"), workdir)

    failures = [(r.get("scheme", r.get("method")), r["seed"], r.get("error"))
                for r in result["runs"] + result["extension"]["runs"] if r["status"] != "done"]
    assert not failures
    runs = {(r["scheme"], r["seed"]): r for r in result["runs"]}
    assert list(runs) == [("learned", 0), ("rope", 0), ("learned", 1), ("rope", 1)]
    for (scheme, seed), run in runs.items():
        assert run["steps"] == 4 and run["params"] > 0 and run["eval_loss"] > 0
        assert run["pretrain_workdir"] == f"pretrain/{scheme}/seed{seed}"
        assert (workdir / run["pretrain_workdir"] / "checkpoints").is_dir()   # ordinary pretrain workdir
        assert (workdir / run["pretrain_workdir"] / "tokenizer.json").is_file()
        assert "WNLI accuracy" in run["glue"]["tasks"]
        # The word-order probe at every evaluation, the last one being the run's final gap.
        assert isinstance(run["eval_order_gap"], float)
        assert [p["step"] for p in run["curve"]] == [2, 4]
        assert all(isinstance(p["eval_order_gap"], float) for p in run["curve"])
        assert run["curve"][-1]["eval_order_gap"] == run["eval_order_gap"]
        assert run["extrapolation"]["lengths"] == [32, 64]
    for seed in (0, 1):
        assert runs[("learned", seed)]["extrapolation"]["loss"]["plain"][1] is None   # beyond its table
        rope = runs[("rope", seed)]["extrapolation"]["loss"]
        assert set(rope) == {"plain", "linear", "ntk", "yarn"}
        assert all(v is not None for losses in rope.values() for v in losses)
    # The seeds are different pretraining runs (initialisation, data order, masks).
    assert runs[("rope", 0)]["eval_loss"] != runs[("rope", 1)]["eval_loss"]
    at_2x = [runs[("rope", k)]["extrapolation"]["loss"]["plain"][1] for k in (0, 1)]
    assert at_2x[0] != at_2x[1]

    rows = {r["scheme"]: r for r in result["schemes"]}
    assert {s: r["status"] for s, r in rows.items()} == {"learned": "done", "rope": "done"}
    for scheme, row in rows.items():
        assert row["seeds"] == [0, 1] and "WNLI accuracy" in row["glue"]["tasks"]
        for key in ("eval_loss", "eval_order_gap"):
            values = [runs[(scheme, k)][key] for k in (0, 1)]
            assert row[key]["n"] == 2 and row[key]["mean"] == pytest.approx(sum(values) / 2)
    d = rows["learned"]["vs_reference"]["eval_loss"]
    assert d["n"] == 2 and d["lo"] <= d["diff"] <= d["hi"]
    assert d["diff"] == pytest.approx(sum(runs[("learned", k)]["eval_loss"] - runs[("rope", k)]["eval_loss"]
                                          for k in (0, 1)) / 2)

    ext = result["extension"]
    assert ext["length"] == 64
    assert [(m["method"], m["status"], m["steps"], m["seeds"]) for m in ext["methods"]] == \
        [(m, "done", [0, 2, 4], [0]) for m in EXTENSION_METHODS]
    assert [(r["method"], r["seed"]) for r in ext["runs"]] == [(m, 0) for m in EXTENSION_METHODS]
    for r in ext["runs"]:
        assert r["steps"] == [0, 2, 4] and len(r["loss"]) == 3
        assert r["workdir"] == f"extension/{r['method']}/seed{r['seed']}"
        assert (workdir / r["workdir"] / "checkpoints").is_dir()
        # Step 0 is the pretrained rope model of the same seed on the extrapolation table's
        # windows at 2x, under the method's scaling.
        column = {"none": "plain"}.get(r["method"], r["method"])
        at_2x = runs[("rope", r["seed"])]["extrapolation"]["loss"][column][1]
        assert r["loss"][0] == pytest.approx(at_2x, rel=1e-6, abs=1e-6), (r["method"], r["seed"])
        assert r["loss"][-1] != r["loss"][0]   # the extension trained
    assert any(f.startswith("Context extension to 64 tokens") for f in result["findings"])

    assert json.loads((workdir / report.REPORT_JSON).read_text()) == json.loads(json.dumps(result))
    for name in (report.REPORT_MD, report.LOSS_CURVES_PNG, report.EXTRAPOLATION_PNG, report.EXTENSION_PNG):
        assert (workdir / name).stat().st_size > 0

    nb = execute_notebook("ablation_report.ipynb", {"ABLATION_DIR": str(workdir)}, tmp_path, monkeypatch)
    tables = outputs(nb, "text/markdown")
    assert tables and "| rope | done |" in tables[0] and "| learned | done |" in tables[0]
    assert "## Context extension" in tables[0] and "| YaRN | done |" in tables[0]
    # Every figure the report wrote (loss curves, extrapolation, extension, and onsets and
    # attention where it drew them), and GLUE's, which only the notebook draws.
    assert len(outputs(nb, "image/png")) == len(list(workdir.glob("*.png"))) + 1
    text = "".join(outputs(nb, "stream"))
    assert "rope seed 1: done" in text and "extension yarn seed 0: done" in text


def test_study_report_notebook_reads_a_device_calls_records(fake_study, tmp_path, monkeypatch):
    """The comparison's notebook on a records.tar.gz as a device call sends it back: the report
    the study wrote, its four figures, the rate and seed figures and the margins table."""
    import tarfile

    from roformer.study import session as study, report as study_report, stats as study_stats

    archive = tmp_path / "records.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for name in (study.SCHEMES_DIR, study.DATA_MANIFEST, study.CONFIG_RECORD):
            tar.add(fake_study / name, arcname=name)
    margins = (0.01, 1.0)
    nb = execute_notebook("study_report.ipynb", {"STUDY": str(archive), "MARGINS": margins}, tmp_path, monkeypatch)
    markdown = outputs(nb, "text/markdown")
    assert markdown[0] == (fake_study / study_report.REPORT_MD).read_text()
    assert len(outputs(nb, "image/png")) == 4 + 2
    assert "3 schemes finished (rope, alibi, sinusoidal)" in "".join(outputs(nb, "stream"))

    result = json.loads((fake_study / study_report.REPORT_JSON).read_text())
    table = markdown[-1].splitlines()
    assert table[0] == "| tokens | scheme (vs rope) | equivalent above | +-0.01 | +-1 |"
    assert len(table) == 2 + 2 * len(result["budgets"])   # alibi and sinusoidal at every budget
    vs = result["budgets"][-1]["rows"]["sinusoidal"]["vs_reference"]
    ends = (vs["lo"], vs["hi"], vs["lo90"], vs["hi90"])
    assert table[-1] == (f"| {study_report.format_tokens(result['budgets'][-1]['tokens'])} | sinusoidal | "
                         f"+-{study_stats.equivalence_bound(vs['lo90'], vs['hi90']):.3f} | "
                         + " | ".join(study_stats.verdict(*ends, margin=m) for m in margins) + " |")
    # Budgets below 100k tokens (gpu_smoke's) are told apart, as the report writes them.
    assert {row.split(" | ")[0] for row in table[2:]} == {f"| {study_report.format_tokens(b['tokens'])}"
                                                          for b in result["budgets"]}
    assert len({b["tokens"] for b in result["budgets"]}) == len(result["budgets"]) > 1


def test_study_report_notebook_runs_on_a_study_stopped_before_its_first_scheme(fake_study, tmp_path, monkeypatch):
    """What a run stopped before its first scheme finished leaves: the config and
    the data manifest, no record. The notebook shows the report's "no scheme" text and stops
    there, without a figure."""
    import shutil

    from roformer.study import session as study

    workdir = tmp_path / "empty"
    (workdir / study.SCHEMES_DIR).mkdir(parents=True)
    for name in (study.DATA_MANIFEST, study.CONFIG_RECORD):
        shutil.copy(fake_study / name, workdir / name)
    nb = execute_notebook("study_report.ipynb", {"STUDY": str(workdir)}, tmp_path, monkeypatch)
    assert not outputs(nb, "image/png")
    assert "No scheme has finished yet" in "".join(outputs(nb, "text/markdown"))
