"""Training while the token cache builds (`data.train_while_building`): a background build
writes the cache entry's shards, a ledger lists the finished ones (levanter's cache is the
model), and training reads them in an order that depends only on the documents.

The streamed order. The corpus's documents, in source order, fall into blocks: block k holds
the documents that start in tokens [k * B, (k + 1) * B) of the corpus (B = BLOCK_TOKENS), so
the blocks depend on the documents' lengths only, not on the shard files or the build's
speed. Epoch 0 reads blocks 0, 1, 2, ... in order, each block's training documents in a
permutation drawn from (seed, block); the reader waits for block k when it needs it (it is
known once the finished shards reach token (k + 1) * B, or the build ends). Epochs from 1 on
need the whole corpus and read it as a built cache is read. The iterator's state is (epoch,
block, row, step): a run stopped mid-build resumes exactly, whether the build is running,
starts over or has finished; a complete entry is read in the same order.

Held-out data: a document is held out when its content hash falls below
data.heldout_fraction (each decided alone, as it arrives). The evaluation batches are the
first held-out rows in corpus order, the same batches a built cache gives; building them
waits until the finished shards hold enough held-out rows (usually the first shard), so they
are fixed before the first step.
"""
from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import numpy as np

from roformer.data import shard_build
from roformer.data.config import DataConfig
from roformer.data.packing import PackPlan, plan_rows
from roformer.data.pipeline import (BatchIterator, PretrainData, cache_directory, heldout_by_hash, make_masker,
                                    resolve_tokenizer)
from roformer.data.shards import FILES, TokenCorpus, cache_key
from roformer.data.sources import TextSource, make_source, sha256_json
from roformer.data.tokenizer import WordPieceTokenizer
from roformer.errors import ConfigError, DataBuildError, UserError

log = logging.getLogger(__name__)

# A build for training writes shards this small so that the first is ready soon; the
# entry's shard layout does not enter the streamed order (blocks do).
STREAM_SHARD_TOKENS = 1 << 21
BLOCK_TOKENS = 1 << 21   # epoch 0 shuffles documents within blocks of about this many tokens
_BLOCK_SEED = 1905       # in the block shuffles' seeds, so none equals an epoch permutation's
LOG_EVERY_SECONDS = 30.0


class _Growing:
    """A numpy array appended to in amortised constant time; `view()` is the filled part."""

    def __init__(self, dtype) -> None:
        self._array = np.zeros(1024, dtype)
        self.size = 0

    def extend(self, values: np.ndarray) -> None:
        end = self.size + len(values)
        if end > len(self._array):
            bigger = np.zeros(max(end, 2 * len(self._array)), self._array.dtype)
            bigger[:self.size] = self._array[:self.size]
            self._array = bigger
        self._array[self.size:end] = values
        self.size = end

    def view(self) -> np.ndarray:
        return self._array[:self.size]


class _Stopped(Exception):
    """The run asked the build to stop."""


class ShardLedger:
    """The finished shards of one cache entry, in order, as its build writes them; readers
    wait on it for the documents they need, and get the build's failure as an error."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory           # where the complete entry will be
        self._changed = threading.Condition()   # re-entrant: `ready` tests may take snapshots
        self._tokens: list[np.ndarray] = []
        self._len, self._hash = _Growing(np.int64), _Growing(np.uint64)
        self._start, self._first_token, self._shard = _Growing(np.int64), _Growing(np.int64), _Growing(np.int32)
        self.num_tokens = 0
        self.corpus: TokenCorpus | None = None   # the complete entry, once there
        self.error: BaseException | None = None
        self.builder: BackgroundBuild | None = None
        self._snapshot: TokenCorpus | None = None
        self._started = self._logged = time.monotonic()

    def add(self, staging: Path, shard: dict) -> None:
        """A shard the build has just written (mapped now, while its files are in `staging`)."""
        arrays = {kind: np.load(staging / shard["files"][kind]["file"], mmap_mode="r") for kind in FILES}
        offsets = np.asarray(arrays["offsets"], dtype=np.int64)
        with self._changed:
            self._append(arrays["tokens"], offsets, np.asarray(arrays["hashes"]))
            shards, docs = len(self._tokens), self._len.size
        now = time.monotonic()
        if shards == 1 or now - self._logged >= LOG_EVERY_SECONDS:
            self._logged = now
            log.info("token cache: %d shards ready (%d documents, %.1fM tokens) after %.0fs; training reads them "
                     "while the rest tokenize", shards, docs, self.num_tokens / 1e6, now - self._started)

    def _append(self, tokens: np.ndarray, offsets: np.ndarray, hashes: np.ndarray) -> None:
        index = len(self._tokens)
        self._tokens.append(tokens)
        self._len.extend(np.diff(offsets))
        self._hash.extend(hashes)
        self._start.extend(offsets[:-1])
        self._first_token.extend(self.num_tokens + offsets[:-1])
        self._shard.extend(np.full(len(offsets) - 1, index, np.int32))
        self.num_tokens += int(offsets[-1])
        self._snapshot = None
        self._changed.notify_all()

    def finish(self, corpus: TokenCorpus) -> None:
        """The build is complete (or the entry was there already: then read as it is)."""
        with self._changed:
            built_here = bool(self._tokens)
            if not built_here:
                bounds = np.searchsorted(corpus.doc_shard, np.arange(len(corpus.tokens) + 1))
                for s, tokens in enumerate(corpus.tokens):
                    docs = slice(bounds[s], bounds[s + 1])
                    self._append(tokens, np.append(corpus.doc_start[docs], len(tokens)), corpus.doc_hash[docs])
            self.corpus, self._snapshot = corpus, None
            self._changed.notify_all()
        if built_here:
            log.info("token cache complete: %d shards, %d documents, %.1fM tokens in %.0fs (%s)", len(self._tokens),
                     self._len.size, self.num_tokens / 1e6, time.monotonic() - self._started, self.directory)

    def fail(self, error: BaseException) -> None:
        with self._changed:
            self.error = error
            self._changed.notify_all()

    @property
    def complete(self) -> bool:
        return self.corpus is not None

    def wait(self, ready: Callable[[], bool], what: str) -> None:
        """Returns once `ready()` holds or the build is complete; raises the build's failure."""
        told = None
        with self._changed:
            while True:
                if self.error is not None:
                    raise self._failure()
                if self.corpus is not None or ready():
                    return
                if self.builder is not None and not self.builder.alive:
                    raise RuntimeError(f"the build of the token cache {self.directory} ended without a result")
                now = time.monotonic()
                if told is None or now - told >= LOG_EVERY_SECONDS:
                    log.info("waiting for %s: %d shards (%.1fM tokens) of the token cache are ready", what,
                             len(self._tokens), self.num_tokens / 1e6)
                    told = now
                self._changed.wait(timeout=1.0)

    def _failure(self) -> Exception:
        error = self.error
        if isinstance(error, UserError):
            return error
        if isinstance(error, _Stopped):
            return RuntimeError(f"the build of the token cache {self.directory} was stopped")
        failure = DataBuildError(f"building the token cache {self.directory} failed: "
                                 f"{type(error).__name__}: {error}")
        failure.__cause__ = error
        return failure

    def snapshot(self) -> TokenCorpus:
        """The documents of the shards finished so far (the whole corpus once complete)."""
        with self._changed:
            if self._snapshot is None:
                manifest = self.corpus.manifest if self.corpus is not None else {"shards": [], "building": True}
                self._snapshot = TokenCorpus(self.directory, manifest, list(self._tokens), self._shard.view(),
                                             self._start.view(), self._len.view(), self._hash.view())
            return self._snapshot

    def block(self, index: int, block_tokens: int) -> tuple[int, int] | None:
        """(first, end) documents of block `index`, waiting until it is known; None past the
        corpus's last block."""
        end_token = (index + 1) * block_tokens
        self.wait(lambda: self.num_tokens >= end_token, f"block {index} (up to token {end_token:,})")
        with self._changed:
            starts = self._first_token.view()
            first, end = (int(i) for i in np.searchsorted(starts, [index * block_tokens, end_token]))
            if first >= len(starts) and self.corpus is not None:
                return None
            return first, end

    def close(self) -> None:
        """Stop the build if it still runs (what it wrote is discarded)."""
        if self.builder is not None:
            self.builder.stop()


class _StoppableSource(TextSource):
    """A source whose reading stops (raises _Stopped) once `stop` is set."""

    def __init__(self, source: TextSource, stop: threading.Event) -> None:
        self._source, self._stop = source, stop
        self.name = source.name

    def documents(self):
        for document in self._source.documents():
            if self._stop.is_set():
                raise _Stopped
            yield document

    def describe(self) -> dict:
        return self._source.describe()

    def progress(self) -> float | None:
        return self._source.progress()

    def parts(self) -> list[tuple[TextSource, int]]:
        return [(_StoppableSource(part, self._stop), size) for part, size in self._source.parts()]


_RUNNING: weakref.WeakSet = weakref.WeakSet()


class BackgroundBuild:
    """The build of one cache entry in a thread of this process (shard_build.load_or_build,
    with small shards), telling `ledger` of each shard as it is written."""

    def __init__(self, source: TextSource, tokenizer: WordPieceTokenizer, cache_dir: Path, ledger: ShardLedger, *,
                 num_workers: int = 0) -> None:
        self.ledger = ledger
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(source, tokenizer, cache_dir, num_workers),
                                        name=f"token cache build ({source.name})", daemon=True)
        ledger.builder = self
        _RUNNING.add(self)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self, source: TextSource, tokenizer: WordPieceTokenizer, cache_dir: Path, num_workers: int) -> None:
        try:
            corpus = shard_build.load_or_build(_StoppableSource(source, self._stop), tokenizer, cache_dir,
                                               num_workers=num_workers, shard_tokens=STREAM_SHARD_TOKENS,
                                               show_progress=False, on_shard=self.ledger.add)
        except BaseException as error:  # noqa: BLE001 - the training process raises it, in one line
            if not isinstance(error, (UserError, _Stopped)):
                log.error("building the token cache %s failed", self.ledger.directory, exc_info=True)
            self.ledger.fail(error)
        else:
            self.ledger.finish(corpus)

    def stop(self, timeout: float = 30.0) -> None:
        if not self._thread.is_alive():
            return
        self._stop.set()
        self._thread.join(timeout)
        if not self.ledger.complete:
            log.info("stopped building the token cache at %d documents (%.1fM tokens): the next run tokenizes "
                     "again (`python -m roformer.data prepare` builds the cache ahead)",
                     self.ledger.snapshot().num_docs, self.ledger.num_tokens / 1e6)


@atexit.register
def _stop_running_builds() -> None:
    for build in list(_RUNNING):
        build.stop(timeout=10.0)


def open_corpus(source: TextSource, tokenizer: WordPieceTokenizer, cache_dir: Path, *, num_workers: int = 0,
                process_index: int = 0, process_count: int = 1, show_progress: bool = True) -> ShardLedger:
    """The ledger of the source's token shards. A single process builds a missing entry in
    the background (or reads a complete one); the processes of a multi-process job build it
    (split over them, shard_build.load_or_build) before this returns, then read it in the
    same streamed order."""
    directory = Path(cache_dir) / "shards" / f"{source.name}-{cache_key(source.fingerprint(), tokenizer.hash)}"
    ledger = ShardLedger(directory)
    if process_count == 1:
        BackgroundBuild(source, tokenizer, Path(cache_dir), ledger, num_workers=num_workers)
    else:
        ledger.finish(shard_build.load_or_build(source, tokenizer, cache_dir, process_index=process_index,
                                                process_count=process_count, num_workers=num_workers,
                                                show_progress=show_progress))
    return ledger


class StreamedPretrainData(PretrainData):
    """PretrainData over a corpus that may still be building, read in the streamed order."""

    def __init__(self, ledger: ShardLedger, identity: str, tokenizer: WordPieceTokenizer, masker, *, seq_len: int,
                 batch_size: int, packing: str, heldout_fraction: float, seed: int, process_index: int = 0,
                 process_count: int = 1, description: dict | None = None) -> None:
        self.set_stream_settings(tokenizer, masker, seq_len=seq_len, batch_size=batch_size, packing=packing,
                                 heldout_fraction=heldout_fraction, seed=seed, process_index=process_index,
                                 process_count=process_count)
        self.ledger = ledger
        self.block_tokens = BLOCK_TOKENS
        self._description = description or {}
        self._train_docs: np.ndarray | None = None
        # The content id of the shards is known only once they are all built, so the stream
        # is named by what decides its content: the source's fingerprint and the tokenizer.
        common = [identity, "streamed", self.block_tokens, packing, heldout_fraction, masker.mask_rate,
                  masker.whole_word]
        self.corpus_id = sha256_json(common)[:16]
        self.stream_id = sha256_json([*common, seq_len, batch_size, masker.max_predictions])[:16]

    @property
    def corpus(self) -> TokenCorpus:
        return self.ledger.snapshot()

    def _whole_corpus(self) -> TokenCorpus:
        self.ledger.wait(lambda: False, "the whole corpus")
        return self.corpus

    @property
    def train_docs(self) -> np.ndarray:
        if self._train_docs is None:
            self._train_docs = np.flatnonzero(~heldout_by_hash(self._whole_corpus().doc_hash, self.heldout_fraction))
        return self._train_docs

    @property
    def heldout_docs(self) -> np.ndarray:
        return np.flatnonzero(heldout_by_hash(self._whole_corpus().doc_hash, self.heldout_fraction))

    @property
    def manifest(self) -> dict:
        """The corpus as far as it is built (`complete` says whether all of it)."""
        corpus = self.corpus
        held = heldout_by_hash(corpus.doc_hash, self.heldout_fraction)
        return {"source": self._description, "shards": str(self.ledger.directory),
                "tokenizer_hash": self.tokenizer.hash, "vocab_size": self.vocab_size,
                "num_docs": corpus.num_docs, "num_tokens": self.ledger.num_tokens,
                "train_docs": int((~held).sum()), "heldout_docs": int(held.sum()),
                "train_tokens": int(corpus.doc_len[~held].sum()), "heldout_tokens": int(corpus.doc_len[held].sum()),
                "seq_len": self.seq_len, "packing": self.packing, "max_predictions_per_seq": self.masker.max_predictions,
                "order": "streamed", "complete": self.ledger.complete}

    def unigram_loss(self) -> float:
        self._whole_corpus()
        return super().unigram_loss()

    def train_iterator(self) -> "StreamedBatchIterator":
        return StreamedBatchIterator(self)

    def close(self) -> None:
        self.ledger.close()

    def block_plan(self, block: int) -> PackPlan | None:
        """This process's rows of block `block` in epoch 0 (None past the last block)."""
        bounds = self.ledger.block(block, self.block_tokens)
        if bounds is None:
            return None
        first, end = bounds
        corpus = self.corpus
        docs = np.arange(first, end)
        docs = docs[~heldout_by_hash(corpus.doc_hash[first:end], self.heldout_fraction)]
        order = np.random.default_rng([self.seed, _BLOCK_SEED, block]).permutation(docs)
        return plan_rows(order[self.process_index::self.process_count], corpus.doc_len, self.seq_len, self.packing)

    def epoch_plan(self, epoch: int) -> PackPlan:
        if len(self.train_docs) < self.process_count:
            raise ConfigError(f"corpus has {len(self.train_docs)} training documents, fewer than "
                              f"process_count={self.process_count}: use a larger corpus")
        return super().epoch_plan(epoch)

    def eval_documents(self, rows: int) -> np.ndarray:
        """This process's held-out documents among those built, once they give more than
        `rows` rows (or the corpus is complete): the first `rows` rows are then final."""
        if self.heldout_fraction == 0:
            raise ConfigError("data.heldout_fraction=0 holds out no documents to evaluate on: raise "
                              "data.heldout_fraction")

        def mine() -> tuple[np.ndarray, TokenCorpus]:
            corpus = self.corpus
            held = np.flatnonzero(heldout_by_hash(corpus.doc_hash, self.heldout_fraction))
            return held[self.process_index::self.process_count], corpus

        def enough() -> bool:
            docs, corpus = mine()
            return plan_rows(docs, corpus.doc_len, self.seq_len, self.packing).num_rows > rows

        self.ledger.wait(enough, f"{rows} held-out rows")
        return mine()[0]


class StreamedBatchIterator(BatchIterator):
    """The training batches in the streamed order; its state adds the block of epoch 0."""

    def __init__(self, data: StreamedPretrainData) -> None:
        super().__init__(data)
        self.block = 0
        self._block_plan: tuple[int, PackPlan] | None = None

    def _current_plan(self) -> PackPlan:
        if self.epoch == 0:
            if self._block_plan is None or self._block_plan[0] != self.block:
                plan = self._data.block_plan(self.block)
                if plan is not None:
                    self._block_plan = (self.block, plan)
                else:   # past the last block: epoch 0 is over
                    self.epoch, self.block, self.row = 1, 0, 0
            if self.epoch == 0:
                return self._block_plan[1]
        return super()._current_plan()

    def _next_plan(self) -> None:
        if self.epoch == 0:
            self.block, self.row = self.block + 1, 0
        else:
            super()._next_plan()

    def get_state(self) -> dict:
        return {**super().get_state(), "block": self.block, "order": "streamed"}

    def set_state(self, state: dict) -> None:
        super().set_state(state)
        self.block = int(state.get("block", 0))

    def start_phase(self, state: dict) -> None:
        """A new batch shape starts at the next block of epoch 0 (or the next epoch), not
        replaying the documents the previous phase was just given, and without waiting for
        the whole corpus."""
        super().start_phase(state)
        if int(state["epoch"]) == 0:
            self.epoch, self.block = 0, int(state.get("block", 0)) + 1


def make_streamed_data(data: DataConfig, *, seq_len: int, batch_size: int, seed: int, process_index: int = 0,
                       process_count: int = 1, show_progress: bool = True) -> StreamedPretrainData:
    """make_pretrain_data for data.train_while_building: the tokenizer first (data.vocab, or
    trained on the source), then the shards build in the background while training reads them."""
    cache_dir = cache_directory(data)
    source = make_source(data)
    tokenizer = resolve_tokenizer(data, source, cache_dir, show_progress=show_progress)
    ledger = open_corpus(source, tokenizer, cache_dir, num_workers=data.num_workers, process_index=process_index,
                         process_count=process_count, show_progress=show_progress)
    return StreamedPretrainData(ledger, sha256_json([source.fingerprint(), tokenizer.hash]), tokenizer,
                                make_masker(data, tokenizer, seq_len), seq_len=seq_len, batch_size=batch_size,
                                packing=data.packing, heldout_fraction=data.heldout_fraction, seed=seed,
                                process_index=process_index, process_count=process_count,
                                description=source.describe())
