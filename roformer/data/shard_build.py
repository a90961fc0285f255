"""Building the token shards of a source (the format: roformer.data.shards):
`load_or_build` reuses an intact cache entry, else builds it.

An entry is built in a temporary directory and renamed into place, so a crash never
leaves a half-written entry under the final name (and the next build removes the staging
directory of a build that was killed). A full disk stops the build in one line naming
the entry. Runs that share a cache build an entry once: a builder holds the entry's lock
(roformer.data.cache_lock) and a second run waits for it, then reads the entry.

Processes of a multi-process job that share the cache directory split the build:
each tokenizes its share of the source's parts (the files of a `files` source) into
`<cache_dir>/shards/.<source>-<key>.parts/`, process 0 lays the parts out as shards
and the others wait for its manifest.
"""
from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import itertools
import json
import logging
import os
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
from tqdm.auto import tqdm

from roformer.data import shards
from roformer.data.cache_lock import CacheUnwritable, build_lock, find_each_other
from roformer.data.shards import (FORMAT_VERSION, Entry, TokenCorpus, cache_key, chunk_documents,
                                  crc32, default_cache_dir, move_into_place)
from roformer.data.sources import TextSource
from roformer.data.tokenizer import WordPieceTokenizer
from roformer.errors import ConfigError
from roformer.files import replacing, stale_staging, write_json_atomic, writing
from roformer.machine import cores_available

log = logging.getLogger(__name__)

SHARD_TOKENS = 1 << 25        # ~32M tokens (64 MB as uint16) per shard file
# A multi-process build: how long processes look for each other in the cache directory
# before each builds alone (a cache on each host's own disk), and how long a process
# waits without any other process's progress before it gives up.
HANDSHAKE_SECONDS = 60.0
WAIT_SECONDS = 3600.0


def load_or_build(source: TextSource, tokenizer: WordPieceTokenizer, cache_dir: str | os.PathLike = "",
                  *, process_index: int = 0, process_count: int = 1, num_workers: int = 0,
                  shard_tokens: int = SHARD_TOKENS, handshake_seconds: float = HANDSHAKE_SECONDS,
                  wait_seconds: float = WAIT_SECONDS, show_progress: bool = True,
                  on_shard: Callable[[Path, dict], None] | None = None) -> TokenCorpus:
    """The source's token shards for this tokenizer: reused if intact, else (re)built.

    In a job of `process_count` processes, process `process_index` tokenizes only its share
    of the source's parts when the processes find each other in the cache directory within
    `handshake_seconds`; otherwise (a cache on each host's own disk) it builds the whole entry.
    A wait with no progress from the other processes for `wait_seconds` is an error naming the
    missing shares. `on_shard(directory, shard)` is called as each shard file set of a build
    is written (its manifest record; the directory is the build's staging directory), so a
    reader can use the finished shards before the entry is complete (roformer.data.streaming)."""
    if not 0 <= process_index < process_count:
        raise ConfigError(f"process_index={process_index} must be in [0, process_count={process_count})")
    fingerprint = source.fingerprint()
    root = Path(cache_dir or default_cache_dir()).expanduser() / "shards"
    directory = root / f"{source.name}-{cache_key(fingerprint, tokenizer.hash)}"
    entry = Entry(directory, {"source_fingerprint": fingerprint, "tokenizer_hash": tokenizer.hash})
    corpus = entry.check()
    if corpus is not None:
        log.info("reusing token shards %s (%d docs, %d tokens)", directory, corpus.num_docs, corpus.num_tokens)
        return corpus
    if entry.problem:
        log.warning("token shard cache %s is unusable (%s); rebuilding it", directory, entry.problem)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise CacheUnwritable(f"{directory} must be built but the cache {root} cannot be made "
                              f"({error.strerror or error}); set data.cache_dir (or $ROFORMER_CACHE) to a writable "
                              "directory") from None
    for stale in stale_staging(root):   # builds killed before they were renamed into place
        log.info("removing %s, left by a build that did not finish", stale)
        shutil.rmtree(stale, ignore_errors=True)
    build = _Build(source, tokenizer, entry, fingerprint, num_workers or cores_available(), shard_tokens, show_progress,
                   on_shard)
    with writing(f"the token shard cache entry {directory}"):
        if process_count == 1 or not find_each_other(build.parts_dir, process_index, process_count,
                                                       handshake_seconds):
            build.alone()
        else:
            build.together(process_index, process_count, wait_seconds)
    corpus = entry.check()     # verified once more only if it changed since this process last looked
    if corpus is None:
        raise RuntimeError(f"token shards just written to {directory} do not verify: {entry.problem}")
    return corpus


def assign_parts(sizes: Sequence[int], process_count: int) -> list[int]:
    """The process that tokenizes each part: largest parts first, each to the least loaded process
    (deterministic, so every process computes the same assignment)."""
    load = [0] * process_count
    owner = [0] * len(sizes)
    for part in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        process = min(range(process_count), key=lambda p: (load[p], p))
        owner[part] = process
        load[process] += sizes[part]
    return owner


class Encoded(NamedTuple):
    """Consecutive documents, encoded."""

    tokens: np.ndarray    # every document's token ids, concatenated
    lengths: np.ndarray   # int64 tokens per document (0: text that normalizes to nothing)
    hashes: np.ndarray    # uint64 content hash per document
    chars: np.ndarray     # int64 characters per document (where the shards end depends on them)


def _encode_chunk(tokenizer: WordPieceTokenizer, docs: list[str], dtype) -> Encoded:
    ids = tokenizer.encode_ids(docs)
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype, count=int(lengths.sum()))
    hashes = np.fromiter((int.from_bytes(hashlib.blake2b(d.encode("utf-8"), digest_size=8).digest(), "little")
                          for d in docs), dtype=np.uint64, count=len(docs))
    return Encoded(flat, lengths, hashes, np.fromiter(map(len, docs), dtype=np.int64, count=len(docs)))


def encode_parts(parts: Sequence[tuple[TextSource, int]], tokenizer: WordPieceTokenizer, dtype, workers: int
                 ) -> Iterator[tuple[int, Encoded, float]]:
    """(index into parts, encoded chunk, fraction of the parts read) in document order; every part
    yields at least one (possibly empty) chunk.

    The Rust batch encoder releases the GIL, so worker threads encode chunks while this thread
    reads and parses the next ones. The work that holds the GIL (parsing, turning ids into
    arrays, hashing) measured 5.5% of the CPU time on Wikipedia, which bounds one process at
    about 18 busy cores; more processes (`python -m roformer.data prepare --processes`) go
    past that."""
    total = sum(size for _, size in parts) or 1
    read = 0
    empty = Encoded(np.zeros(0, dtype), *(np.zeros(0, t) for t in (np.int64, np.uint64, np.int64)))
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        pending: collections.deque = collections.deque()   # (part index, future or None for no documents)

        def oldest() -> tuple[int, Encoded]:
            index, future = pending.popleft()
            return index, empty if future is None else future.result()

        for index, (part, size) in enumerate(parts):
            chunks = 0
            for chunk in chunk_documents(part.documents()):
                chunks += 1
                pending.append((index, pool.submit(_encode_chunk, tokenizer, chunk, dtype)))
                if len(pending) >= 2 * workers:
                    yield *oldest(), (read + size * (part.progress() or 0.0)) / total
            if not chunks:
                pending.append((index, None))
            read += size
        while pending:
            yield *oldest(), read / total


class _ShardWriter:
    """Lays encoded documents out in shard files. A shard ends at the end of the first
    CHUNK_CHARS chunk (counted over the whole corpus, as chunk_documents groups it) that
    brings it to `shard_tokens` tokens, however the documents were encoded."""

    def __init__(self, directory: Path, dtype, shard_tokens: int,
                 on_shard: Callable[[Path, dict], None] | None = None) -> None:
        self.directory, self.dtype, self.shard_tokens, self.on_shard = directory, dtype, shard_tokens, on_shard
        self.parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.buffered = 0
        self.chunk_chars = 0     # characters of the corpus chunk still open
        self.shards: list[dict] = []
        self.num_docs = self.num_tokens = 0

    def add(self, encoded: Encoded) -> None:
        chars = np.cumsum(encoded.chars)
        ends = np.cumsum(encoded.lengths)
        first = 0
        while first < len(chars):
            before = int(chars[first - 1]) if first else 0
            last = int(np.searchsorted(chars, before + shards.CHUNK_CHARS - self.chunk_chars))  # closes the chunk
            if last >= len(chars):
                self._take(encoded, ends, first, len(chars))
                self.chunk_chars += int(chars[-1]) - before
                return
            self._take(encoded, ends, first, last + 1)
            self.chunk_chars = 0
            if self.buffered >= self.shard_tokens:
                self._flush()
            first = last + 1

    def _take(self, encoded: Encoded, ends: np.ndarray, lo: int, hi: int) -> None:
        start = int(ends[lo - 1]) if lo else 0
        tokens = encoded.tokens[start:int(ends[hi - 1])]
        lengths = encoded.lengths[lo:hi]
        keep = lengths > 0
        self.parts.append((tokens, lengths[keep], encoded.hashes[lo:hi][keep]))
        self.buffered += len(tokens)
        self.num_docs += int(keep.sum())
        self.num_tokens += len(tokens)

    def _flush(self) -> None:
        if not self.parts:
            return
        tokens = np.concatenate([p[0] for p in self.parts]).astype(self.dtype, copy=False)
        lengths = np.concatenate([p[1] for p in self.parts])
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        arrays = {"tokens": tokens, "offsets": offsets, "hashes": np.concatenate([p[2] for p in self.parts])}
        name = f"shard_{len(self.shards):05d}"
        files = {}
        for kind, array in arrays.items():
            path = self.directory / f"{name}.{kind}.npy"
            np.save(path, array)
            files[kind] = {"file": path.name, "bytes": path.stat().st_size, "crc32": crc32(path)}
        self.shards.append({"name": name, "num_docs": len(lengths), "num_tokens": len(tokens), "files": files})
        self.parts, self.buffered = [], 0
        if self.on_shard is not None:
            self.on_shard(self.directory, self.shards[-1])

    def finish(self, header: dict) -> dict:
        self._flush()
        manifest = {**header, "num_docs": self.num_docs, "num_tokens": self.num_tokens,
                    "bytes": sum(f["bytes"] for s in self.shards for f in s["files"].values()),
                    "shards": self.shards}
        write_json_atomic(self.directory / "manifest.json", manifest, indent=1)
        return manifest


def _on_a_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):   # replaced or closed stderr
        return False


class _Build:
    """Builds one cache entry, alone or as one process of several."""

    def __init__(self, source: TextSource, tokenizer: WordPieceTokenizer, entry: Entry, fingerprint: str,
                 workers: int, shard_tokens: int, show_progress: bool,
                 on_shard: Callable[[Path, dict], None] | None = None) -> None:
        self.source, self.tokenizer, self.entry, self.on_shard = source, tokenizer, entry, on_shard
        self.workers, self.shard_tokens, self.show_progress = workers, shard_tokens, show_progress
        self.dtype = np.uint16 if tokenizer.vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32
        self.parts = source.parts()
        self.parts_dir = entry.directory.with_name(f".{entry.directory.name}.parts")
        self.header = {"format": FORMAT_VERSION, "source": source.describe(), "source_fingerprint": fingerprint,
                       "tokenizer_hash": tokenizer.hash, "vocab_size": tokenizer.vocab_size,
                       "dtype": np.dtype(self.dtype).name}
        self.start = time.perf_counter()

    def alone(self, processes: int = 1) -> None:
        """Tokenizes every part straight into shard files, unless another run sharing the cache
        builds the entry meanwhile (one builder per entry: the others wait for its lock)."""
        with build_lock(self.entry.directory):
            if self.entry.check() is not None:
                log.info("token shards %s were built by another run meanwhile", self.entry.directory)
                return
            self._alone(processes)

    def _alone(self, processes: int) -> None:
        staging = self._staging()
        try:
            writer = _ShardWriter(staging, self.dtype, self.shard_tokens, self.on_shard)
            parts = range(len(self.parts))
            for _, encoded in self._encode(parts, f"tokenizing {self.source.name}"):
                writer.add(encoded)
            share = {"process": 0, "parts": list(parts), "tokens": writer.num_tokens,
                     "seconds": round(time.perf_counter() - self.start, 3)}
            self._publish(staging, writer, [share], processes)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def together(self, process_index: int, process_count: int, wait_seconds: float) -> None:
        """This process's share of a build by `process_count` processes sharing the cache."""
        owners = assign_parts([size for _, size in self.parts], process_count)
        if process_index != 0:
            if len(self.parts) > 1:
                self._tokenize_share(owners, process_index, process_count)
            self._wait(lambda: False, owners, wait_seconds, "process 0's manifest")
            return
        if len(self.parts) == 1:       # nothing to split: process 0 builds it, the others wait
            self.alone(processes=process_count)
        else:
            self._tokenize_share(owners, 0, process_count)
            if self._wait(lambda: len(self._parts_written()) == len(self.parts), owners, wait_seconds,
                          "the other processes' parts"):
                self._assemble(process_count)
        shutil.rmtree(self.parts_dir, ignore_errors=True)

    def _tokenize_share(self, owners: list[int], process_index: int, process_count: int) -> None:
        """Writes a part file for each part of this process's share that is not there yet."""
        mine = [i for i, owner in enumerate(owners) if owner == process_index]
        todo = [i for i in mine if i not in self._parts_written()]
        tokens = 0
        if todo:
            for index, encoded in self._encode_grouped(todo, f"tokenizing {self.source.name} (process "
                                                             f"{process_index} of {process_count})"):
                if self.entry.check() is not None:      # built meanwhile by a process working alone
                    return
                tokens += len(encoded.tokens)
                self._save_part(index, encoded, {"process": process_index,
                                                 "seconds": round(time.perf_counter() - self.start, 3)})
        seconds = time.perf_counter() - self.start
        log.info("process %d of %d tokenized %d of the %d parts of %s (%d more of its share already there): "
                 "%d tokens in %.1fs (%.2fM tokens/s)", process_index, process_count, len(todo), len(self.parts),
                 self.entry.directory.name, len(mine) - len(todo), tokens, seconds,
                 tokens / max(seconds, 1e-9) / 1e6)

    # ------------------------------------------------------------ steps
    def _encode(self, parts: Sequence[int], description: str) -> Iterator[tuple[int, Encoded]]:
        # The bar runs over the fraction of the parts read (ETA) when the source can tell. Only on
        # a terminal: in a log file its redraws pile up into one long line; there the build's
        # closing log line says what it did.
        progress = tqdm(desc=description, total=100.0, unit="%",
                        disable=not (self.show_progress and _on_a_terminal()), mininterval=1.0, dynamic_ncols=True,
                        bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f}% [{elapsed}<{remaining}{postfix}]")
        tokens = 0
        for position, encoded, fraction in encode_parts([self.parts[i] for i in parts], self.tokenizer,
                                                         self.dtype, self.workers):
            yield parts[position], encoded
            tokens += len(encoded.tokens)
            progress.update(100.0 * fraction - progress.n)
            rate = tokens / max(time.perf_counter() - self.start, 1e-9)
            progress.set_postfix_str(f"{tokens / 1e6:.1f}M tokens, {rate / 1e6:.2f}M tok/s", refresh=False)
        progress.update(100.0 - progress.n)
        progress.close()

    def _encode_grouped(self, parts: Sequence[int], description: str) -> Iterator[tuple[int, Encoded]]:
        """Each part's documents as one Encoded, encoding the next parts meanwhile."""
        pieces: list[Encoded] = []
        current = None
        for index, encoded in itertools.chain(self._encode(parts, description), [(None, None)]):
            if index != current and pieces:
                yield current, Encoded(*(np.concatenate(arrays) for arrays in zip(*pieces)))
                pieces = []
            current = index
            if encoded is not None:
                pieces.append(encoded)

    def _staging(self) -> Path:
        directory = self.entry.directory
        staging = directory.with_name(f".{directory.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        staging.mkdir(parents=True)
        return staging

    def _publish(self, staging: Path, writer: _ShardWriter, shares: list[dict], processes: int) -> None:
        if writer.num_docs == 0:
            raise ConfigError(f"corpus is empty: {self.source} yielded no documents with any tokens")
        manifest = writer.finish(self.header)
        seconds = time.perf_counter() - self.start
        write_json_atomic(staging / "build.json", {
            "seconds": round(seconds, 3), "tokens_per_second": round(writer.num_tokens / seconds),
            "processes": processes, "threads": self.workers, "shares": shares,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=1)
        move_into_place(staging, self.entry.directory, self.entry.expected)
        log.info("tokenized %d docs / %d tokens in %.1fs (%.2fM tokens/s) into %s", manifest["num_docs"],
                 manifest["num_tokens"], seconds, manifest["num_tokens"] / seconds / 1e6, self.entry.directory)

    def _part_path(self, index: int) -> Path:
        return self.parts_dir / f"part_{index:05d}.npz"

    def _parts_written(self) -> set[int]:
        try:
            names = os.listdir(self.parts_dir)
        except FileNotFoundError:
            return set()
        return {int(n[5:-4]) for n in names if n.startswith("part_") and n.endswith(".npz")}

    def _save_part(self, index: int, encoded: Encoded, meta: dict) -> None:
        path = self._part_path(index)
        path.parent.mkdir(parents=True, exist_ok=True)
        with replacing(path) as f:
            np.savez(f, **encoded._asdict(), meta=np.array(json.dumps(meta)))

    def _assemble(self, processes: int) -> None:
        """Process 0: every part, in order, into the shard files a single process writes."""
        staging = self._staging()
        try:
            writer = _ShardWriter(staging, self.dtype, self.shard_tokens, self.on_shard)
            shares: dict[int, dict] = {}
            for index in range(len(self.parts)):
                with np.load(self._part_path(index)) as saved:
                    encoded = Encoded(*(saved[field] for field in Encoded._fields))
                    meta = json.loads(str(saved["meta"]))
                writer.add(encoded)
                share = shares.setdefault(meta["process"], {"process": meta["process"], "parts": [],
                                                            "tokens": 0, "seconds": 0.0})
                share["parts"].append(index)
                share["tokens"] += len(encoded.tokens)
                share["seconds"] = max(share["seconds"], meta["seconds"])
            self._publish(staging, writer, [shares[p] for p in sorted(shares)], processes)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    # ------------------------------------------------------------ waiting
    def _wait(self, ready: Callable[[], bool], owners: list[int], wait_seconds: float, what: str) -> bool:
        """Polls until `ready()` (True) or the entry is complete (False, someone else built it); an
        error when nothing changed for wait_seconds."""
        last, since, logged, delay = None, time.monotonic(), time.monotonic(), 0.05
        while True:
            if self.entry.check() is not None:
                return False
            if ready():
                return True
            missing = self._missing(owners)
            now = time.monotonic()
            if missing != last:
                last, since = missing, now
            elif now - since > wait_seconds:
                raise TimeoutError(
                    f"token shards {self.entry.directory}: waited {wait_seconds:.0f}s for {what} with no "
                    f"progress; missing: {missing}. Is every process running with the same data settings, "
                    f"and does each see the cache directory {self.entry.directory.parent.parent}?")
            if now - logged > 60:
                log.info("waiting for %s of %s; missing: %s", what, self.entry.directory.name, missing)
                logged = now
            time.sleep(delay)
            delay = min(2 * delay, 2.0)

    def _missing(self, owners: list[int]) -> str:
        """Which process's share is not there yet, in words."""
        if len(self.parts) == 1:
            return "process 0's build of the whole corpus (a source of one part)"
        written = self._parts_written()
        by_owner: dict[int, list[int]] = {}
        for index, owner in enumerate(owners):
            if index not in written:
                by_owner.setdefault(owner, []).append(index)
        if not by_owner:
            return "process 0's layout of the written parts into shards"
        return "; ".join(f"process {owner}'s share ({len(parts)} of its {owners.count(owner)} parts: "
                         f"{', '.join(self._part_name(i) for i in parts[:3])}{', ...' if len(parts) > 3 else ''})"
                         for owner, parts in sorted(by_owner.items()))

    def _part_name(self, index: int) -> str:
        paths = getattr(self.parts[index][0], "paths", None)
        return os.path.basename(paths[0]) if paths else f"part {index}"
