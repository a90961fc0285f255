"""Read one GLUE split into `Example`s from a local GLUE dir, HF `datasets` or TFDS.

Every reader returns the same records, with class ids in HF/TFDS order (see tasks.py);
unlabelled (test) splits carry `label=None` and the index the leaderboard expects.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from roformer.config_files import shared_data
from roformer.errors import ConfigError
from roformer.glue.tasks import TaskSpec

SOURCES = ("auto", "local", "hf", "tfds")


@dataclasses.dataclass(frozen=True)
class Example:
    idx: int                     # row index; the submission's `index` column on test splits
    text_a: str
    text_b: str | None
    label: int | float | None    # class id, STS-B score, or None when unlabelled


class GlueDataError(ConfigError):
    """Malformed or missing GLUE data, with the file (and line) at fault."""


def glue_source(source: str, data_dir: str) -> tuple[str, str]:
    """(the source a run reads, its local GLUE dir or ""). `auto` reads the local dir
    `data_dir` when one is given, else the shared data's GLUE copy where there is one
    (roformer.config_files.shared_data: a checkout's ../shared/data), else HF `datasets`
    (the Hub's GLUE, downloaded once into its cache): so an installed package needs no
    GLUE files of its own."""
    if source not in SOURCES:
        raise ConfigError(f"unknown GLUE data source {source!r}; choose one of {', '.join(SOURCES)}")
    if source != "auto":
        return source, data_dir
    if data_dir:
        return "local", data_dir
    shared = shared_data() / "glue"
    return ("local", str(shared)) if shared.is_dir() else ("hf", "")


def read_split(task: TaskSpec, split: str, *, source: str = "local", data_dir: str = "",
               hf_path: str = "nyu-mll/glue", hf_cache_dir: str | None = None,
               tfds_data_dir: str | None = None) -> list[Example]:
    if split not in task.splits:
        raise ConfigError(f"task {task.name} has no split {split!r}; "
                          f"it has {', '.join(task.splits)}")
    source, data_dir = glue_source(source, data_dir)
    if source == "local":
        check_data_dir(data_dir)
        return read_local(task, split, data_dir)
    if source == "hf":
        return read_hf(task, split, hf_path=hf_path, cache_dir=hf_cache_dir)
    if source == "tfds":
        return read_tfds(task, split, data_dir=tfds_data_dir)
    raise ConfigError(f"unknown GLUE data source {source!r}; choose one of {', '.join(SOURCES)}")


# ---------------------------------------------------------------- local TSV

def check_data_dir(data_dir: str) -> None:
    if not data_dir:
        raise ConfigError("config.data_dir is empty: point it at a GLUE dir in the "
                          "download_glue_data.py layout (e.g. ../shared/data/glue)")


def local_path(task: TaskSpec, split: str, data_dir: str | Path) -> Path:
    return Path(data_dir) / task.local_dir / task.local[split].file


def read_local(task: TaskSpec, split: str, data_dir: str | Path) -> list[Example]:
    path = local_path(task, split, data_dir)
    if not path.is_file():
        raise GlueDataError(f"{task.display} {split} split not found: no file {path}")
    layout = task.local[split]
    # The official files are unquoted TSV (quotes are text), so split on tabs only.
    # utf-8-sig drops MRPC's byte-order mark.
    lines = _read_utf8(path).split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    start = 0
    columns: dict[str | int, int] = {}
    if layout.header:
        if not lines:
            raise GlueDataError(f"{path}: empty file, expected a header line")
        header = lines[0].rstrip("\r").split("\t")
        columns = {name: i for i, name in enumerate(header)}
        wanted = [c for c in (*layout.text_columns, layout.label_column, layout.index_column)
                  if c is not None]
        missing = [c for c in wanted if c not in columns]
        if missing:
            raise GlueDataError(f"{path}:1: header lacks column(s) {missing}; found {header}")
        num_columns = len(header)
        start = 1
    else:
        num_columns = 1 + max(c for c in (*layout.text_columns, layout.label_column)
                              if isinstance(c, int))

    def col(name):
        return columns[name] if layout.header else name

    text_idx = [col(c) for c in layout.text_columns]
    label_idx = None if layout.label_column is None else col(layout.label_column)
    index_idx = None if layout.index_column is None else col(layout.index_column)
    examples = []
    for line_no in range(start, len(lines)):
        fields = lines[line_no].rstrip("\r").split("\t")
        where = f"{path}:{line_no + 1}"
        if len(fields) != num_columns:
            raise GlueDataError(f"{where}: expected {num_columns} tab-separated columns, "
                                f"got {len(fields)}")
        label = None if label_idx is None else _parse_label(task, fields[label_idx], where)
        if index_idx is None:
            idx = len(examples)
        else:
            try:
                idx = int(fields[index_idx])
            except ValueError:
                raise GlueDataError(f"{where}: index {fields[index_idx]!r} is not an integer") from None
        texts = [fields[i] for i in text_idx]
        examples.append(Example(idx, texts[0], texts[1] if len(texts) > 1 else None, label))
    return examples


def _read_utf8(path: Path) -> str:
    """The file's text (utf-8-sig drops MRPC's byte-order mark); bytes that are not UTF-8
    are a GlueDataError naming the file, line and byte."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        column = error.start - (data.rfind(b"\n", 0, error.start) + 1) + 1
        raise GlueDataError(f"{path}:{line}: byte 0x{data[error.start]:02x} at column {column} is not UTF-8 text; "
                            "GLUE files are UTF-8 (re-encode the file, e.g. with iconv)") from None


def _parse_label(task: TaskSpec, raw: str, where: str) -> int | float:
    raw = raw.strip()
    if task.is_regression:
        try:
            score = float(raw)
        except ValueError:
            score = math.nan
        if not math.isfinite(score):
            raise GlueDataError(f"{where}: {task.display} score {raw!r} is not a number")
        return score
    if raw not in task.labels:
        raise GlueDataError(f"{where}: {task.display} label {raw!r} is not one of "
                            f"{list(task.labels)}")
    return task.labels.index(raw)


# ---------------------------------------------------------------- HF datasets / TFDS

def _from_records(task: TaskSpec, split: str, records, where: str) -> list[Example]:
    """HF and TFDS share field names (sentence1/premise/...), `idx` and -1 = unlabelled."""
    examples = []
    for row_no, rec in enumerate(records):
        try:
            texts = [_text(rec[f]) for f in task.hf_text_fields]
            label = _record_label(task, rec["label"])
            idx = int(rec.get("idx", row_no))
        except KeyError as e:
            raise GlueDataError(f"{where} row {row_no}: missing field {e}; "
                                f"have {sorted(rec)}") from None
        if label is not None and not task.is_regression and not 0 <= label < task.num_labels:
            raise GlueDataError(f"{where} row {row_no}: label {label} outside "
                                f"0..{task.num_labels - 1}")
        examples.append(Example(idx, texts[0], texts[1] if len(texts) > 1 else None, label))
    return examples


def _text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _record_label(task: TaskSpec, value: Any) -> int | float | None:
    if task.is_regression:
        value = float(value)
        return None if value < 0 else value  # test split scores are -1
    value = int(value)
    return None if value < 0 else value


def read_hf(task: TaskSpec, split: str, *, hf_path: str = "nyu-mll/glue",
            cache_dir: str | None = None) -> list[Example]:
    import datasets   # imported here: heavy (pyarrow, fsspec), and only data_source='hf' needs it

    try:
        ds = datasets.load_dataset(hf_path, task.hf_config, split=split, cache_dir=cache_dir)
    except ValueError as e:  # unknown split
        raise GlueDataError(f"{hf_path}/{task.hf_config}: cannot load split {split!r}: {e}") from e
    except OSError as e:   # ConnectionError: offline, or the Hub out of reach, with nothing cached
        raise GlueDataError(
            f"cannot read GLUE {task.display} from the Hub ({hf_path}) through HF datasets: "
            f"{str(e).splitlines()[0] if str(e) else type(e).__name__}; offline, point --config.data_dir at a "
            f"local GLUE copy (download_glue_data.py layout; --config.source=local) or "
            f"--config.source=tfds at a prepared TFDS one") from e
    return _from_records(task, split, ds, f"{hf_path}/{task.hf_config}[{split}]")


def read_tfds(task: TaskSpec, split: str, *, data_dir: str | None = None) -> list[Example]:
    """Random-access `tfds.data_source` (array_record, no TensorFlow needed) first; a
    tfrecord-prepared copy goes through `tfds.load`, which needs TensorFlow."""
    # imported here: heavy, and only data_source='tfds' needs it
    import tensorflow_datasets as tfds
    import tensorflow_datasets.text.glue  # noqa: F401  registers glue/* without TensorFlow

    where = f"tfds {task.tfds_name}[{split}]" + (f" in {data_dir}" if data_dir else "")
    try:
        source = tfds.data_source(task.tfds_name, split=split, data_dir=data_dir,
                                  download=False)
        records = (source[i] for i in range(len(source)))
    except Exception as err:  # noqa: BLE001 - not prepared as array_record: try tfrecord
        try:
            ds = tfds.load(task.tfds_name, split=split, data_dir=data_dir, download=False)
        except ModuleNotFoundError:
            raise GlueDataError(f"{where}: cannot read it as array_record ({err}), and "
                                "TensorFlow is not installed to read tfrecords") from None
        except Exception as err2:  # noqa: BLE001
            raise GlueDataError(f"{where}: not available ({err2})") from None
        records = tfds.as_numpy(ds)
    return _from_records(task, split, records, where)
