"""Text sources: every corpus is an iterator of document strings behind one interface.

`make_source(data)` picks the source from the DataConfig's `source`:
  embedded  the Python reference manual text shipped in the standard library
            (`pydoc_data.topics`), split into its sections; needs no data or network
  files     a glob of local files: plain text (documents separated by blank lines)
            or WikiExtractor output (`<doc ...>` / title / body / `</doc>`); .gz is
            read transparently and the format is detected per file
            (roformer.data.text_files)
  hf        a Hugging Face `datasets` dataset (hub name, local builder or a
            `save_to_disk` directory), streaming or not
  tfds      a TensorFlow Datasets builder read through `tfds.data_source`
            (array_record files, no TensorFlow needed)

A source also has a `fingerprint()` that changes when its content may have
changed (the shard cache is keyed on it), and `parts()`: consecutive pieces (the
files of a `files` source) that the processes of a multi-process job tokenize
separately.
"""
from __future__ import annotations

import abc
import copy
import glob
import hashlib
import io
import json
import os
import re
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from roformer.data.config import DataConfig
from roformer.data.text_files import read_documents
from roformer.errors import ConfigError

SOURCES = ("embedded", "files", "hf", "tfds")
FILE_FORMATS = ("auto", "text", "wikiextractor")


class TextSource(abc.ABC):
    """A corpus: an ordered, re-iterable stream of non-empty documents."""

    name: str

    @abc.abstractmethod
    def documents(self) -> Iterator[str]:
        """Yields each document's text, in a fixed order."""

    @abc.abstractmethod
    def describe(self) -> dict:
        """JSON-able description of what is read (goes into manifests and logs)."""

    def progress(self) -> float | None:
        """Fraction of the source read so far by documents(), when it can tell (for an ETA)."""
        return None

    def fingerprint(self) -> str:
        """Changes whenever the documents may have changed."""
        return sha256_json(self.describe())

    def parts(self) -> list[tuple["TextSource", int]]:
        """Consecutive pieces whose documents, in order, are this source's documents, each with
        its size in bytes (to balance the pieces over processes). One piece unless the source
        can be split (a files source: one per file)."""
        return [(self, 1)]

    def __str__(self) -> str:
        """What is read, as a log line names it (describe() is the full record, hashes included)."""
        return f"the {self.name} source"


def sha256_json(value: Any) -> str:
    """Hex SHA-256 of a JSON-serialisable value (the cache keys and stream ids use it)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


# ---------------------------------------------------------------- embedded

# A reST-style heading underline as pydoc renders it: "*****", "=====", "-----", "~~~~~".
_UNDERLINE = re.compile(r"^([*=\-~^])\1{2,}$")


class EmbeddedSource(TextSource):
    """The Python Language Reference text in `pydoc_data.topics` (ships with CPython).

    Each of its topics (79 in Python 3.11) is split at its section headings, giving about 200
    documents (~65k words) of real technical English: enough for a smoke run on a
    machine with no data and no network, far too small for a useful model.
    """

    name = "embedded"

    def __init__(self) -> None:
        try:   # imported here: only this source needs it, and some Python builds lack it
            from pydoc_data import topics
        except ImportError as err:  # some minimal Python builds drop pydoc_data
            raise ConfigError("data.source='embedded' needs the standard library module "
                              "pydoc_data, which this Python build lacks; use source='files'") from err
        self._topics = topics.topics
        self._topics_done = 0

    def documents(self) -> Iterator[str]:
        self._topics_done = 0
        for key in sorted(self._topics):
            yield from _split_sections(self._topics[key])
            self._topics_done += 1

    def progress(self) -> float | None:
        return self._topics_done / len(self._topics)

    def __str__(self) -> str:
        return "the embedded corpus (Python's pydoc topics)"

    def describe(self) -> dict:
        text_hash = hashlib.sha256("".join(self._topics[k] for k in sorted(self._topics)).encode())
        return {"source": "embedded", "corpus": "pydoc_data.topics (Python Language Reference)",
                "python": sys.version.split()[0], "sha256": text_hash.hexdigest()}


def _split_sections(text: str) -> Iterator[str]:
    """Splits a pydoc topic at headings (a line underlined by *, =, -, ~ or ^)."""
    lines = text.splitlines()
    section: list[str] = []
    for i, line in enumerate(lines):
        if _UNDERLINE.match(line.strip()):
            continue
        is_heading = i + 1 < len(lines) and _UNDERLINE.match(lines[i + 1].strip()) and line.strip()
        if is_heading and section:
            body = "\n".join(section).strip()
            if body:
                yield body
            section = []
        section.append(line)
    body = "\n".join(section).strip()
    if body:
        yield body


# ---------------------------------------------------------------- files

class FilesSource(TextSource):
    """Local files matched by a glob (or a list of globs), read in sorted path order."""

    name = "files"

    def __init__(self, pattern: str | list[str], file_format: str = "auto") -> None:
        if file_format not in FILE_FORMATS:
            raise ConfigError(f"data.file_format={file_format!r}: expected one of {FILE_FORMATS}")
        patterns = [pattern] if isinstance(pattern, str) else list(pattern)
        if not patterns or not all(patterns):
            raise ConfigError("data.files is empty: give a glob of text or WikiExtractor files "
                              "(source='files')")
        paths: set[str] = set()
        for p in patterns:
            matched = [m for m in glob.glob(os.path.expanduser(p), recursive=True) if not os.path.isdir(m)]
            if not matched:
                raise ConfigError(f"data.files: glob {p!r} matched no files")
            paths.update(matched)
        self.paths = sorted(paths)
        self.file_format = file_format
        # read progress: bytes of finished files + a tell() of the open one
        self._total_bytes, self._bytes_done, self._position = 1, 0, None

    def documents(self) -> Iterator[str]:
        self._total_bytes = sum(os.path.getsize(p) for p in self.paths if os.path.exists(p)) or 1
        self._bytes_done, self._position = 0, None
        for path in self.paths:
            yield from read_documents(path, self.file_format, on_open=self._track)
            self._bytes_done += os.path.getsize(path)
            self._position = None

    def parts(self) -> list[tuple["FilesSource", int]]:
        pieces = []
        for path in self.paths:
            piece = copy.copy(self)
            piece.paths = [path]
            pieces.append((piece, os.path.getsize(path)))
        return pieces

    def _track(self, raw: io.BufferedReader) -> None:
        self._position = raw.tell

    def progress(self) -> float | None:
        current = self._position() if self._position is not None else 0
        return min(1.0, (self._bytes_done + current) / self._total_bytes)

    def __str__(self) -> str:
        more = f" and {len(self.paths) - 1} more" if len(self.paths) > 1 else ""
        return f"{self.paths[0] if self.paths else 'no files'}{more}"

    def describe(self) -> dict:
        files = []
        for path in self.paths:
            try:
                st = os.stat(path)
            except OSError as err:
                raise ConfigError(f"data.files: cannot read {path}: {err.strerror}") from err
            files.append([os.path.abspath(path), st.st_size, st.st_mtime_ns])
        return {"source": "files", "file_format": self.file_format, "files": files}


# ---------------------------------------------------------------- Hugging Face datasets

class HFSource(TextSource):
    """A `datasets` dataset: `load_dataset(path, name, split=..., streaming=...)`.

    `path` may also be a directory written by `Dataset.save_to_disk`.
    """

    name = "hf"

    def __init__(self, path: str, name: str = "", split: str = "train", text_column: str = "text",
                 streaming: bool = False, data_files: Any = None) -> None:
        if not path:
            raise ConfigError("data.hf_path is empty: give a dataset name (e.g. 'Salesforce/wikitext') "
                              "or a save_to_disk directory (source='hf')")
        self.path, self.config_name, self.split = path, name or None, split or "train"
        self.text_column, self.streaming = text_column or "text", bool(streaming)
        self.data_files = _plain(data_files) if data_files else None
        self._dataset = None
        self._rows_done = 0

    def _load(self):
        if self._dataset is None:
            import datasets   # imported here: heavy (pyarrow, fsspec), and only this source needs it

            saved = Path(self.path)
            if saved.is_dir() and ((saved / "state.json").exists() or (saved / "dataset_dict.json").exists()):
                ds = datasets.load_from_disk(self.path)
                if isinstance(ds, datasets.DatasetDict):
                    if self.split not in ds:
                        raise ConfigError(f"data.hf_split={self.split!r}: {self.path} has splits {list(ds)}")
                    ds = ds[self.split]
            else:
                ds = datasets.load_dataset(self.path, self.config_name, split=self.split,
                                           streaming=self.streaming, data_files=self.data_files)
            columns = ds.column_names or []
            if columns and self.text_column not in columns:
                raise ConfigError(f"data.hf_text_column={self.text_column!r}: dataset {self.path} has "
                                  f"columns {columns}")
            self._dataset = ds
        return self._dataset

    def documents(self) -> Iterator[str]:
        ds = self._load()
        self._rows_done = 0
        if not self.streaming and hasattr(ds, "iter"):
            # Column-batched reads avoid building one dict per row.
            for batch in ds.select_columns([self.text_column]).iter(batch_size=1000):
                for text in batch[self.text_column]:
                    self._rows_done += 1
                    if text and text.strip():
                        yield text.strip()
        else:
            for row in ds:
                self._rows_done += 1
                text = row[self.text_column]
                if text and text.strip():
                    yield text.strip()

    def progress(self) -> float | None:
        if self.streaming or self._dataset is None:
            return None
        return self._rows_done / max(len(self._dataset), 1)

    def __str__(self) -> str:
        return f"HF dataset {self.path}{f' ({self.config_name})' if self.config_name else ''}, split {self.split}"

    def describe(self) -> dict:
        ds = self._load()
        # A non-streaming dataset has a content fingerprint; a stream only has its name.
        content = getattr(ds, "_fingerprint", None) if not self.streaming else None
        return {"source": "hf", "path": self.path, "name": self.config_name, "split": self.split,
                "text_column": self.text_column, "streaming": self.streaming,
                "data_files": self.data_files, "fingerprint": content}


def _plain(value: Any) -> Any:
    """ConfigDict / tuple values -> plain JSON-able dicts and lists."""
    if isinstance(value, Mapping) or hasattr(value, "to_dict"):
        items = value.to_dict() if hasattr(value, "to_dict") else value
        return {k: _plain(v) for k, v in items.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


# ---------------------------------------------------------------- TFDS

class TFDSSource(TextSource):
    """A TFDS dataset read with `tfds.data_source` (random-access array_record, no TensorFlow).

    The dataset must be prepared in array_record format (`tfds build --file_format=array_record`
    or `builder.download_and_prepare(file_format="array_record")`); `tfds.data_source`
    prepares it itself when the builder can download.
    """

    name = "tfds"

    def __init__(self, name: str, split: str = "train", data_dir: str = "", text_key: str = "text") -> None:
        if not name:
            raise ConfigError("data.tfds_name is empty: give a TFDS builder name such as "
                              "'wikipedia/20230601.en' (source='tfds')")
        self.builder_name, self.split = name, split or "train"
        self.data_dir, self.text_key = data_dir or None, text_key or "text"
        self._source = None
        self._records_done = 0

    def _load(self):
        if self._source is None:
            import tensorflow_datasets as tfds   # imported here: heavy, and only this source needs it

            try:
                self._source = tfds.data_source(self.builder_name, split=self.split, data_dir=self.data_dir)
            except Exception as err:  # tfds raises many types; name the setting in one message
                raise ConfigError(f"data.tfds_name={self.builder_name!r} split={self.split!r} "
                                  f"data_dir={self.data_dir!r}: cannot open as a TFDS array_record "
                                  f"data source: {err}") from err
        return self._source

    def documents(self) -> Iterator[str]:
        source = self._load()
        for i in range(len(source)):
            self._records_done = i + 1
            record = source[i]
            if self.text_key not in record:
                raise ConfigError(f"data.tfds_text_key={self.text_key!r}: {self.builder_name} records have "
                                  f"keys {sorted(record)}")
            text = record[self.text_key]
            text = text.decode("utf-8") if isinstance(text, bytes) else str(text)
            if text.strip():
                yield text.strip()

    def progress(self) -> float | None:
        if self._source is None:
            return None
        return self._records_done / max(len(self._source), 1)

    def __str__(self) -> str:
        return f"TFDS dataset {self.builder_name}, split {self.split}"

    def describe(self) -> dict:
        source = self._load()
        info = source.dataset_info
        return {"source": "tfds", "name": self.builder_name, "split": self.split,
                "data_dir": str(info.data_dir), "version": str(info.version),
                "num_records": len(source), "text_key": self.text_key, "files": _local_files(str(info.data_dir))}


def _local_files(directory: str) -> list | None:
    """[name, size, mtime_ns] of each file in a local dataset directory: a dataset prepared
    again with other text under the same version and record count is then another source (its
    cached tokens are not reused). None for a remote directory (gs://...), which is not listed."""
    if not os.path.isdir(directory):
        return None
    return [[name, st.st_size, st.st_mtime_ns] for name in sorted(os.listdir(directory))
            if os.path.isfile(path := os.path.join(directory, name)) and (st := os.stat(path))]


# ---------------------------------------------------------------- factory

def make_source(data: DataConfig) -> TextSource:
    """Builds the source named by `data.source` from the other data settings."""
    if data.source == "embedded":
        return EmbeddedSource()
    if data.source == "files":
        return FilesSource(data.files, data.file_format)
    if data.source == "hf":
        return HFSource(data.hf_path, data.hf_name, data.hf_split, data.hf_text_column, data.hf_streaming,
                        data.hf_data_files or None)
    if data.source == "tfds":
        return TFDSSource(data.tfds_name, data.tfds_split, data.tfds_data_dir, data.tfds_text_key)
    raise ConfigError(f"data.source={data.source!r}: expected one of {SOURCES}")
