"""The study's records (roformer/study/records.py): the archives a call packs, one per
scheme, the report written again from them, and a resumed study taking per scheme the record
of its own settings."""
import json
from pathlib import Path

import pytest

from roformer.errors import ConfigError
from roformer.study import records as study_records
from roformer.study import session as study
from roformer.study import stats as study_stats


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
