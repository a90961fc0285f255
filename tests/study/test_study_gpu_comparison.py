"""scripts/gpu_comparison.sh, the whole comparison on a device: at smoke size, what it
refuses, and the report written again from the records after a stop."""
import json
import os
import subprocess
import sys

import pytest

from helpers import REPO_ROOT as REPO
from roformer.study import records as study_records
from roformer.study import session as study

SCHEMES = ("rope", "shaw", "learned", "t5", "alibi", "sinusoidal", "none")


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
    # OUTDIR holds the eight files the script names (its header), none in a subfolder.
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
