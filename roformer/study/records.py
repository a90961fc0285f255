"""A comparison study's records on disk: what a finished scheme leaves, and how records travel
between runs and machines.

A study workdir holds, per finished scheme, `schemes/<scheme>.json` (its record, with the
fingerprint of the settings it was trained under) and `schemes/<scheme>.npz` (its per-item
test sums), beside the config the study recorded (`study_config.json`) and its data manifest.
A run leaves them as one archive (scripts/gpu_comparison.sh's records.tar.gz),
`split_records` cuts that into one archive per scheme for a results page, and a later run,
on any machine, resumes from any number of them: `stage_archives` unpacks each apart, and `take_finished`
takes per scheme the record whose fingerprint is the study's (the one with the most members
when several are), never one of other settings, saying in a line what it took, left or set
aside. `open_records` unpacks archives for a report without training.
"""
from __future__ import annotations

import io
import json
import logging
import shutil
import tarfile
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from roformer.errors import ConfigError
from roformer.files import write_bytes_atomic, write_json_atomic

log = logging.getLogger("roformer.study")

SCHEMES_DIR = "schemes"
CONFIG_RECORD = "study_config.json"
DATA_MANIFEST = "data_manifest.json"
INCOMING_DIR = "incoming"            # archives staged for take_finished, one folder each
STALE_DIR = f"{SCHEMES_DIR}/stale"   # a workdir's records of other settings, set aside
RECIPE_CHECK = "recipe_check.json"   # roformer.study.recipe_check's result, read by the report
KEPT_DIR = "kept"                    # the members kept for the downstream arm (roformer.study.kept)


def save_scheme(workdir: Path, scheme: str, record: dict, arrays: dict[str, np.ndarray]) -> None:
    """A scheme's test sums, then its record: a record on disk always has its sums (the sums
    may run ahead of a record that did not land; roformer.study.groups.merge_groups
    reads only the record's members from them)."""
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **arrays)
    write_bytes_atomic(workdir / SCHEMES_DIR / f"{scheme}.npz", buffer.getvalue())
    write_json_atomic(workdir / SCHEMES_DIR / f"{scheme}.json", record)


def record_scheme(name: str) -> str | None:
    """The scheme whose record (schemes/<scheme>.json) or test sums (.npz) the archive member
    `name` is, else None."""
    path = Path(name)
    return path.stem if path.parent == Path(SCHEMES_DIR) and path.suffix in (".json", ".npz") else None


def kept_scheme(name: str) -> str | None:
    """The scheme whose kept member (kept/<scheme>/seed<k>/...) the archive member `name` is a
    file of, else None."""
    parts = Path(name).parts
    return parts[1] if len(parts) > 3 and parts[0] == KEPT_DIR else None


def split_records(archive: Path, directory: Path) -> list[Path]:
    """An archive of scheme records (scripts/gpu_comparison.sh's records.tar.gz) as one archive
    per scheme, DIR/records-<scheme>.tar.gz, each with the data manifest and the config (and
    the scheme's kept members, where the archive holds them): what a study spread over several
    machines keeps between them (scripts/gpu_comparison.sh takes several in RESUME_FROM,
    `python -m roformer.study downstream` their kept members), each file a scheme's size."""
    directory.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive) as source:
        members = {m.name.removeprefix("./"): m for m in source.getmembers() if m.isfile()}
        shared = [name for name in (DATA_MANIFEST, CONFIG_RECORD) if name in members]
        schemes = sorted({record_scheme(name) for name in members if name.endswith(".json")} - {None})
        written = []
        for scheme in schemes:
            path = directory / f"records-{scheme}.tar.gz"
            with tarfile.open(path, "w:gz") as target:
                for name in shared + sorted(n for n in members if scheme in (record_scheme(n), kept_scheme(n))):
                    target.addfile(members[name], source.extractfile(members[name]))
            written.append(path)
    return written


def _unpack(archive: Path, into: Path) -> None:
    """The records, data manifest, config and recipe check of `archive` into `into` (nothing else)."""
    try:
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                name = member.name.removeprefix("./")
                wanted = name in (CONFIG_RECORD, DATA_MANIFEST, RECIPE_CHECK) or record_scheme(name) is not None
                if member.isfile() and wanted:
                    (into / name).parent.mkdir(parents=True, exist_ok=True)
                    write_bytes_atomic(into / name, tar.extractfile(member).read())
    except (tarfile.TarError, OSError) as error:
        raise ConfigError(f"cannot read records archive {archive}: {error}") from error


def open_records(source: str | Path, into: str | Path | None = None) -> Path:
    """A study workdir to read: `source` itself when it is one (it has study_config.json), else
    the records in `source` (scripts/gpu_comparison.sh's records.tar.gz, or a directory of
    archives such as `split_records` writes) unpacked into `into` (a new temporary directory
    when None), later archives over earlier ones. Only records, the data manifest and the
    config are taken from an archive."""
    source = Path(source)
    if (source / CONFIG_RECORD).is_file():
        return source
    archives = sorted(source.glob("*.tar.gz")) if source.is_dir() else [source] if source.is_file() else []
    if not archives:
        raise ConfigError(f"{source} is neither a study workdir (no {CONFIG_RECORD}) nor a records archive or a "
                          "directory of them (*.tar.gz)")
    if into is None:
        import tempfile

        into = tempfile.mkdtemp(prefix="roformer-study-")
    workdir = Path(into)
    (workdir / SCHEMES_DIR).mkdir(parents=True, exist_ok=True)
    for archive in archives:
        _unpack(archive, workdir)
    if not (workdir / CONFIG_RECORD).is_file():
        raise ConfigError(f"no {CONFIG_RECORD} in {', '.join(map(str, archives))}: not study records")
    return workdir


def stage_archives(workdir: Path, archives: Iterable[str | Path]) -> list[Path]:
    """Each archive unpacked into a folder of its own under WORKDIR/incoming (its name in
    SOURCE), for the next study run in `workdir` to take its finished schemes from
    (`take_finished`); when one cannot be read, none of them is staged (ConfigError)."""
    incoming = workdir / INCOMING_DIR
    first = len(list(incoming.glob("*"))) if incoming.is_dir() else 0
    staged: list[Path] = []
    try:
        for archive in map(Path, archives):
            into = incoming / str(first + len(staged))
            staged.append(into)
            if not archive.is_file():
                raise ConfigError(f"records archive {archive} is not a file")
            _unpack(archive, into)
            (into / "SOURCE").write_text(f"{archive}\n")
    except ConfigError:
        for folder in staged:
            shutil.rmtree(folder, ignore_errors=True)
        raise
    return staged


def _read_record(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text()) if path.is_file() and path.with_suffix(".npz").is_file() else None
    except (OSError, ValueError):
        return None


def take_finished(workdir: Path, fingerprints: dict[str, str]) -> list[str]:
    """The schemes of `fingerprints` finished in `workdir`, after taking staged archives' records
    (`stage_archives`). Per scheme, of its record in the workdir and those staged, the ones
    whose fingerprint is the study's count; the one with the most members (the rates beyond
    the grid included) is kept, the workdir's own on a tie, then the earlier archive's. A
    workdir record of other settings is moved to schemes/stale, so neither the report nor an
    archive mixes it with these; a staged one is left. Each is said in one line. The staged
    folders are removed."""
    incoming = sorted((workdir / INCOMING_DIR).glob("*"), key=lambda p: int(p.name)) \
        if (workdir / INCOMING_DIR).is_dir() else []
    finished = []
    for scheme, fingerprint in fingerprints.items():
        own = workdir / SCHEMES_DIR / f"{scheme}.json"
        candidates = [(own, "this workdir")] + [
            (folder / SCHEMES_DIR / f"{scheme}.json", (folder / "SOURCE").read_text().strip()) for folder in incoming]
        matching = []
        for path, source in candidates:
            record = _read_record(path)
            if record is None:
                continue
            if record.get("fingerprint") == fingerprint:
                matching.append((len(record["members"]), -len(matching), path, source))
            elif path == own:
                stale = workdir / STALE_DIR
                stale.mkdir(parents=True, exist_ok=True)
                for suffix in (".npz", ".json"):
                    shutil.move(str(own.with_suffix(suffix)), str(stale / f"{scheme}{suffix}"))
                log.warning("%s: the workdir's record was trained under other settings (fingerprint %s, this "
                            "study's %s): moved to %s, trained again", scheme, record.get("fingerprint"),
                            fingerprint, STALE_DIR)
            else:
                log.warning("%s: %s holds a record of other settings (fingerprint %s, this study's %s): not taken",
                            scheme, source, record.get("fingerprint"), fingerprint)
        if not matching:
            continue
        members, _, path, source = max(matching)
        if path != own:
            for suffix in (".npz", ".json"):   # the sums first: a record on disk always has its sums
                write_bytes_atomic(own.with_suffix(suffix), path.with_suffix(suffix).read_bytes())
        others = f"; {len(matching) - 1} other record(s) of these settings left" if len(matching) > 1 else ""
        log.info("%s: already trained (%d members, from %s)%s, skipping", scheme, members, source, others)
        finished.append(scheme)
    shutil.rmtree(workdir / INCOMING_DIR, ignore_errors=True)
    return finished
