"""Local text files as documents: strict UTF-8 (gunzipped when they start with the gzip
magic, a byte-order mark dropped), in one of two formats detected from the first non-blank
line: plain text (documents separated by blank lines) or WikiExtractor output (`<doc ...>`,
the title line, the body, `</doc>`). What roformer.data.sources' `files` source reads.
"""
from __future__ import annotations

import codecs
import gzip
import io
import zlib
from collections.abc import Iterator

from roformer.errors import ConfigError


def _open_text(path: str) -> tuple[io.TextIOWrapper, io.BufferedReader]:
    """A file as strict UTF-8 text (gunzipped when it starts with the gzip magic) + its raw bytes."""
    try:
        raw = open(path, "rb")
    except OSError as err:
        raise ConfigError(f"data.files: cannot read {path}: {err.strerror}") from err
    # utf-8-sig: a byte-order mark would otherwise stay on the first line and hide a
    # WikiExtractor file's `<doc` from the format detection
    return io.TextIOWrapper(_unzipped(raw), encoding="utf-8-sig", errors="strict"), raw


def _unzipped(raw: io.BufferedReader):
    """The file's bytes, gunzipped when they start with the gzip magic (whatever its name)."""
    return gzip.GzipFile(fileobj=raw, mode="rb") if raw.peek(2)[:2] == b"\x1f\x8b" else raw


def _first_bad_byte(path: str) -> int | None:
    """The offset of the first byte of `path`'s text (after gunzipping) that is not UTF-8: a
    decode error's own offset counts from the start of the chunk being decoded."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    with open(path, "rb") as raw:
        binary = _unzipped(raw)
        consumed = 0
        try:
            while chunk := binary.read(1 << 20):
                pending = len(decoder.getstate()[0])
                try:
                    decoder.decode(chunk)
                except UnicodeDecodeError as err:
                    return consumed - pending + err.start
                consumed += len(chunk)
            decoder.decode(b"", final=True)
        except UnicodeDecodeError as err:
            return consumed - len(err.object) + err.start
        except (OSError, EOFError, zlib.error):
            return None
    return None


def read_documents(path: str, file_format: str = "auto", on_open=None) -> Iterator[str]:
    """Documents of one file; the format is detected from its first non-blank line.

    on_open(raw_file), if given, sees the underlying byte stream (to report progress).
    """
    try:
        f, raw = _open_text(path)
        if on_open is not None:
            on_open(raw)
        with f, raw:
            lines = iter(f)
            first = ""
            head: list[str] = []
            for line in lines:
                head.append(line)
                if line.strip():
                    first = line
                    break
            fmt = file_format
            if fmt == "auto":
                fmt = "wikiextractor" if first.lstrip().startswith("<doc ") else "text"
            all_lines = _chain(head, lines)
            if fmt == "wikiextractor":
                yield from _wikiextractor_documents(all_lines)
            else:
                yield from _blank_line_documents(all_lines)
    except UnicodeDecodeError as err:
        offset = _first_bad_byte(path)
        where = f"byte {offset:,} of its text: " if offset is not None else ""
        raise ConfigError(f"data.files: {path} is not valid UTF-8 ({where}{err.reason})") from err
    except (OSError, EOFError, zlib.error) as err:  # BadGzipFile is an OSError
        raise ConfigError(f"data.files: cannot read {path}: {err}") from err


def _chain(head: list[str], rest: Iterator[str]) -> Iterator[str]:
    yield from head
    yield from rest


def _blank_line_documents(lines: Iterator[str]) -> Iterator[str]:
    doc: list[str] = []
    for line in lines:
        line = line.strip()
        if line:
            doc.append(line)
        elif doc:
            yield "\n".join(doc)
            doc = []
    if doc:
        yield "\n".join(doc)


def _wikiextractor_documents(lines: Iterator[str]) -> Iterator[str]:
    """Bodies of `<doc ...>` blocks; the title line is dropped and title-only stubs skipped."""
    body: list[str] | None = None
    seen_title = False
    for line in lines:
        if line.startswith("<doc "):
            body, seen_title = [], False
        elif line.startswith("</doc>"):
            if body:
                yield "\n".join(body)
            body = None
        elif body is not None:
            line = line.strip()
            if not line:
                continue
            if not seen_title:  # the first line repeats the title attribute
                seen_title = True
            else:
                body.append(line)
