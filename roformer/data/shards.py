"""Pre-tokenized shards: tokenize a source once, reuse the numpy files afterwards.

Layout of one cache entry, `<cache_dir>/shards/<source>-<key>/`:
  manifest.json            source description + fingerprint, tokenizer hash, counts,
                           and each file's size and CRC32 (written last)
  shard_00000.tokens.npy   all token ids of the shard's documents, concatenated
                           (uint16 when the vocabulary fits, else int32); no specials
  shard_00000.offsets.npy  int64 [num_docs + 1] document boundaries into tokens
  shard_00000.hashes.npy   uint64 [num_docs] content hash of each document's text
                           (decides the held-out split, independent of order)

The key hashes the source fingerprint and the tokenizer hash, so a changed
tokenizer or source gets a new entry. An entry is built in a temporary directory
and renamed into place, so a crash never leaves a half-written entry under the
final name; an entry whose files disagree with its manifest (size or CRC32) is
deleted and rebuilt.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import itertools
import json
import logging
import os
import shutil
import time
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from roformer.data.sources import TextSource, sha256_json
from roformer.data.tokenizer import WordPieceTokenizer

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
SHARD_TOKENS = 1 << 25        # ~32M tokens (64 MB as uint16) per shard file
CHUNK_CHARS = 1 << 18         # text per batch-encoder call (smaller chunks overlap better)
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


def load_or_build(source: TextSource, tokenizer: WordPieceTokenizer, cache_dir: str | os.PathLike = "",
                  *, num_workers: int = 0, shard_tokens: int = SHARD_TOKENS,
                  show_progress: bool = True) -> TokenCorpus:
    """The source's token shards for this tokenizer: reused if intact, else (re)built."""
    fingerprint = source.fingerprint()
    root = Path(cache_dir or default_cache_dir()).expanduser() / "shards"
    directory = root / f"{source.name}-{cache_key(fingerprint, tokenizer.hash)}"
    expected = {"source_fingerprint": fingerprint, "tokenizer_hash": tokenizer.hash}
    if directory.exists():
        corpus, problem = open_shards(directory, expected)
        if corpus is not None:
            log.info("reusing token shards %s (%d docs, %d tokens)", directory, corpus.num_docs, corpus.num_tokens)
            return corpus
        log.warning("token shard cache %s is unusable (%s); rebuilding it", directory, problem)
    root.mkdir(parents=True, exist_ok=True)
    staging = root / f".{directory.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        build_shards(source, tokenizer, staging, fingerprint, num_workers=num_workers,
                     shard_tokens=shard_tokens, show_progress=show_progress)
        _move_into_place(staging, directory, expected)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    corpus, problem = open_shards(directory, expected)
    if corpus is None:
        raise RuntimeError(f"token shards just written to {directory} do not verify: {problem}")
    return corpus


def _move_into_place(staging: Path, directory: Path, expected: dict) -> None:
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


# ---------------------------------------------------------------- building

def build_shards(source: TextSource, tokenizer: WordPieceTokenizer, directory: Path, fingerprint: str,
                 *, num_workers: int = 0, shard_tokens: int = SHARD_TOKENS, show_progress: bool = True) -> dict:
    """Tokenizes every document of the source into shard files plus manifest.json."""
    directory.mkdir(parents=True, exist_ok=True)
    dtype = np.uint16 if tokenizer.vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32
    workers = num_workers or os.cpu_count() or 1
    writer = _ShardWriter(directory, dtype, shard_tokens)
    start = time.perf_counter()
    # The bar runs over the fraction of the source read (ETA) when the source can tell.
    progress = tqdm(desc=f"tokenizing {source.name}", total=100.0, unit="%", disable=not show_progress,
                    mininterval=1.0, dynamic_ncols=True,
                    bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f}% [{elapsed}<{remaining}{postfix}]")
    # Rust's batch encoder releases the GIL, so worker threads overlap encoding chunks
    # with this thread reading/parsing the next ones; results are consumed in order.
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        pending: list[concurrent.futures.Future] = []
        for chunk in chunk_documents(source.documents()):
            pending.append(pool.submit(_encode_chunk, tokenizer, chunk, dtype))
            if len(pending) >= 2 * workers:
                _consume(pending.pop(0).result(), writer, progress, source, start)
        for future in pending:
            _consume(future.result(), writer, progress, source, start)
    progress.update(100.0 - progress.n)
    progress.close()
    if writer.num_docs == 0:
        raise ValueError(f"corpus is empty: {source} yielded no documents with any tokens")
    seconds = time.perf_counter() - start
    manifest = writer.finish({
        "format": FORMAT_VERSION,
        "source": source.describe(),
        "source_fingerprint": fingerprint,
        "tokenizer_hash": tokenizer.hash,
        "vocab_size": tokenizer.vocab_size,
        "dtype": np.dtype(dtype).name,
        "build": {"seconds": round(seconds, 3), "tokens_per_second": round(writer.num_tokens / seconds),
                  "threads": workers, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
    })
    log.info("tokenized %d docs / %d tokens in %.1fs (%.2fM tokens/s) into %s", manifest["num_docs"],
             manifest["num_tokens"], seconds, manifest["num_tokens"] / seconds / 1e6, directory)
    return manifest


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


def _encode_chunk(tokenizer: WordPieceTokenizer, docs: list[str], dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    ids = tokenizer.encode_ids(docs)
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype, count=int(lengths.sum()))
    hashes = np.fromiter((int.from_bytes(hashlib.blake2b(d.encode("utf-8"), digest_size=8).digest(), "little")
                          for d in docs), dtype=np.uint64, count=len(docs))
    keep = lengths > 0  # text that normalizes to nothing (control characters only)
    return flat, lengths[keep], hashes[keep]


def _consume(result, writer: "_ShardWriter", progress, source: TextSource, start: float) -> None:
    flat, lengths, hashes = result
    writer.add(flat, lengths, hashes)
    fraction = source.progress()
    if fraction is not None:
        progress.update(100.0 * fraction - progress.n)
    rate = writer.num_tokens / max(time.perf_counter() - start, 1e-9)
    progress.set_postfix_str(f"{writer.num_docs} docs, {writer.num_tokens / 1e6:.1f}M tokens, "
                             f"{rate / 1e6:.2f}M tok/s", refresh=False)


class _ShardWriter:
    """Accumulates encoded documents and writes a shard every `shard_tokens` tokens."""

    def __init__(self, directory: Path, dtype, shard_tokens: int) -> None:
        self.directory, self.dtype, self.shard_tokens = directory, dtype, shard_tokens
        self.parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.buffered = 0
        self.shards: list[dict] = []
        self.num_docs = self.num_tokens = 0

    def add(self, flat: np.ndarray, lengths: np.ndarray, hashes: np.ndarray) -> None:
        self.parts.append((flat, lengths, hashes))
        self.buffered += len(flat)
        self.num_docs += len(lengths)
        self.num_tokens += len(flat)
        if self.buffered >= self.shard_tokens:
            self._flush()

    def _flush(self) -> None:
        if not self.parts:
            return
        tokens = np.concatenate([p[0] for p in self.parts])
        lengths = np.concatenate([p[1] for p in self.parts])
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        arrays = {"tokens": tokens, "offsets": offsets, "hashes": np.concatenate([p[2] for p in self.parts])}
        name = f"shard_{len(self.shards):05d}"
        files = {}
        for kind, array in arrays.items():
            path = self.directory / f"{name}.{kind}.npy"
            np.save(path, array)
            files[kind] = {"file": path.name, "bytes": path.stat().st_size, "crc32": _crc32(path)}
        self.shards.append({"name": name, "num_docs": len(lengths), "num_tokens": len(tokens), "files": files})
        self.parts, self.buffered = [], 0

    def finish(self, header: dict) -> dict:
        self._flush()
        manifest = {**header, "num_docs": self.num_docs, "num_tokens": self.num_tokens,
                    "bytes": sum(f["bytes"] for s in self.shards for f in s["files"].values()),
                    "shards": self.shards}
        tmp = self.directory / "manifest.json.tmp"
        tmp.write_text(json.dumps(manifest, indent=1))
        os.replace(tmp, self.directory / "manifest.json")
        return manifest


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            crc = zlib.crc32(block, crc)
    return crc


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
                if _crc32(path) != meta["crc32"]:
                    return None, f"{path.name} fails its CRC32 check"
                arrays[kind] = np.load(path, mmap_mode="r")
            offsets = np.asarray(arrays["offsets"])
            if (len(arrays["tokens"]) != shard["num_tokens"] or len(offsets) != shard["num_docs"] + 1
                    or offsets[-1] != shard["num_tokens"] or len(arrays["hashes"]) != shard["num_docs"]):
                return None, f"{shard['name']} arrays disagree with the manifest counts"
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
