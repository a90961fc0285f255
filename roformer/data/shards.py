"""Pre-tokenized shards, the format and its reader: a source tokenized once, read back as
memory-mapped numpy files (building them: roformer.data.shard_build).

Layout of one cache entry, `<cache_dir>/shards/<source>-<key>/`:
  manifest.json            source description + fingerprint, tokenizer hash, counts,
                           and each file's size and CRC32 (written last)
  shard_00000.tokens.npy   all token ids of the shard's documents, concatenated
                           (uint16 when the vocabulary fits, else int32); no specials
  shard_00000.offsets.npy  int64 [num_docs + 1] document boundaries into tokens
  shard_00000.hashes.npy   uint64 [num_docs] content hash of each document's text
                           (decides the held-out split, independent of order)
  build.json               how it was built: seconds, processes, threads, each process's share

The key hashes the source fingerprint and the tokenizer hash, so a changed
tokenizer or source gets a new entry. The shard files and the manifest depend only
on the documents and the tokenizer: where a shard ends is fixed by the documents'
lengths, so any number of processes or threads writes the same bytes. An entry whose
files disagree with its manifest (size or CRC32), or holds a token id beyond its vocabulary,
reads as unusable, and is rebuilt.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from roformer.data.sources import sha256_json

FORMAT_VERSION = 1
# Documents are encoded in chunks of about this much text; a shard ends at the end of such
# a chunk of the whole corpus, so the value is part of the on-disk layout (content ids).
CHUNK_CHARS = 1 << 18
FILES = ("tokens", "offsets", "hashes")


def default_cache_dir() -> Path:
    return Path(os.environ.get("ROFORMER_CACHE", Path.home() / ".cache" / "roformer-jax"))


@dataclasses.dataclass
class TokenCorpus:
    """Every document's tokens, memory-mapped from the shard files."""

    directory: Path
    manifest: dict
    tokens: list[np.ndarray]   # one memmap per shard
    doc_shard: np.ndarray      # int32 [num_docs]
    doc_start: np.ndarray      # int64 [num_docs] offset inside its shard
    doc_len: np.ndarray        # int64 [num_docs]
    doc_hash: np.ndarray       # uint64 [num_docs]

    @property
    def num_docs(self) -> int:
        return len(self.doc_len)

    @property
    def num_tokens(self) -> int:
        return int(self.manifest["num_tokens"])

    @property
    def content_id(self) -> str:
        """Hash of the token stream itself (tokenizer + every shard file's size and CRC32).
        Unlike the cache key it ignores file paths and mtimes, so a copied or re-touched
        corpus with the same text keeps the same id."""
        files = [[f["bytes"], f["crc32"]] for shard in self.manifest["shards"]
                 for f in (shard["files"][kind] for kind in FILES)]
        return sha256_json([self.manifest["tokenizer_hash"], files])[:20]

    def gather(self, docs: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Concatenated tokens of pieces: piece i is doc docs[i] from offsets[i], lengths[i] long."""
        lengths = lengths.astype(np.int64)
        total = int(lengths.sum())
        within = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        src = np.repeat(self.doc_start[docs] + offsets, lengths) + within
        if len(self.tokens) == 1:
            return self.tokens[0][src].astype(np.int32)
        shard = np.repeat(self.doc_shard[docs], lengths)
        out = np.empty(total, dtype=np.int32)
        for s in np.unique(shard):
            pick = shard == s
            out[pick] = self.tokens[s][src[pick]]
        return out


def cache_key(source_fingerprint: str, tokenizer_hash: str) -> str:
    joined = f"{FORMAT_VERSION}:{source_fingerprint}:{tokenizer_hash}"
    return hashlib.sha256(joined.encode()).hexdigest()[:20]


class Entry:
    """One cache entry; `check` verifies it (a full CRC32 pass) again only when its manifest
    changed since the last look, so waiting processes can poll it cheaply."""

    def __init__(self, directory: Path, expected: dict) -> None:
        self.directory, self.expected = directory, expected
        self.problem = ""
        self._seen: tuple | None = None
        self._corpus: TokenCorpus | None = None

    def check(self) -> TokenCorpus | None:
        """The entry's corpus when it is complete and matches, else None (and `problem` says why)."""
        try:
            st = (self.directory / "manifest.json").stat()
        except OSError:
            self._seen, self._corpus = None, None
            self.problem = "no manifest.json (partial build)" if self.directory.exists() else ""
            return None
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        if stamp != self._seen:
            self._seen = stamp
            self._corpus, self.problem = open_shards(self.directory, self.expected)
        return self._corpus


def crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            crc = zlib.crc32(block, crc)
    return crc



def move_into_place(staging: Path, directory: Path, expected: dict) -> None:
    """Renames the finished build into place, replacing a damaged entry but never a valid one
    (another process, e.g. another host on a shared disk, may have finished first)."""
    if directory.exists():
        if open_shards(directory, expected)[0] is not None:
            return
        shutil.rmtree(directory, ignore_errors=True)
    try:
        os.replace(staging, directory)
    except OSError:
        if open_shards(directory, expected)[0] is None:
            raise


def chunk_documents(documents: Iterator[str]) -> Iterator[list[str]]:
    """Groups documents into lists of about CHUNK_CHARS characters (one encoder call each)."""
    chunk: list[str] = []
    size = 0
    for doc in documents:
        chunk.append(doc)
        size += len(doc)
        if size >= CHUNK_CHARS:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


# ---------------------------------------------------------------- loading

def open_shards(directory: Path, expected: dict) -> tuple[TokenCorpus | None, str]:
    """(corpus, "") when the entry is complete and matches, else (None, what is wrong)."""
    try:
        manifest = json.loads((directory / "manifest.json").read_text())
    except FileNotFoundError:
        return None, "no manifest.json (partial build)"
    except (OSError, ValueError) as err:
        return None, f"unreadable manifest.json: {err}"
    if manifest.get("format") != FORMAT_VERSION:
        return None, f"format {manifest.get('format')} != {FORMAT_VERSION}"
    for key, value in expected.items():
        if manifest.get(key) != value:
            return None, f"{key} differs"
    tokens, doc_shard, doc_start, doc_len, doc_hash = [], [], [], [], []
    try:
        for index, shard in enumerate(manifest["shards"]):
            arrays = {}
            for kind in FILES:
                meta = shard["files"][kind]
                path = directory / meta["file"]
                if not path.is_file() or path.stat().st_size != meta["bytes"]:
                    return None, f"{path.name} is missing or has the wrong size"
                if crc32(path) != meta["crc32"]:
                    return None, f"{path.name} fails its CRC32 check"
                arrays[kind] = np.load(path, mmap_mode="r")
            offsets = np.asarray(arrays["offsets"])
            if (len(arrays["tokens"]) != shard["num_tokens"] or len(offsets) != shard["num_docs"] + 1
                    or offsets[-1] != shard["num_tokens"] or len(arrays["hashes"]) != shard["num_docs"]):
                return None, f"{shard['name']} arrays disagree with the manifest counts"
            if len(arrays["tokens"]) and int(np.max(arrays["tokens"])) >= manifest["vocab_size"]:
                # ids a model of that vocabulary has no embedding for: it would read garbage rows
                return None, (f"{shard['files']['tokens']['file']} holds token id {int(np.max(arrays['tokens']))}, "
                              f"beyond the vocabulary of {manifest['vocab_size']}")
            tokens.append(arrays["tokens"])
            doc_shard.append(np.full(shard["num_docs"], index, dtype=np.int32))
            doc_start.append(offsets[:-1])
            doc_len.append(np.diff(offsets))
            doc_hash.append(np.asarray(arrays["hashes"]))
    except (KeyError, TypeError, ValueError) as err:
        return None, f"malformed manifest or shard file: {err}"
    corpus = TokenCorpus(directory, manifest, tokens, np.concatenate(doc_shard), np.concatenate(doc_start),
                         np.concatenate(doc_len), np.concatenate(doc_hash))
    return corpus, ""
