"""The pretraining input pipeline: source -> tokenizer -> shards -> packed rows -> masked batches.

Determinism: the held-out split depends only on document content; epoch e of the
training stream visits the training documents in the permutation drawn from
(seed, e), process i of n taking every n-th document of it (disjoint across
processes); batch k is masked with a generator seeded by (seed, process, k). An
iterator's state is therefore just (epoch, row, step), and a restored iterator
reproduces the uninterrupted stream exactly.
"""
from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import jax
import numpy as np

from roformer.data import shard_build
from roformer.data import shards as shards_lib
from roformer.data.cache_lock import build_lock
from roformer.data.config import MIN_SEQ_LEN, DataConfig
from roformer.data.masking import MlmMasker
from roformer.data.packing import PACKINGS, PackPlan, build_rows, plan_rows
from roformer.data.sources import TextSource, make_source, sha256_json
from roformer.data.tokenizer import WordPieceTokenizer, load_tokenizer
from roformer.errors import ConfigError
from roformer.files import stale_staging, staging_name, writing

log = logging.getLogger(__name__)

# Held-out batches use their own fixed seed, so every run (any training seed) is
# evaluated on exactly the same masked batches.
EVAL_SEED = 20210420


def heldout_documents(doc_hash: np.ndarray, fraction: float) -> np.ndarray:
    """Boolean [num_docs]: documents whose content hash falls below `fraction`.

    Identical texts share a hash, so a duplicated document never lands on both
    sides. With fraction > 0 at least one document is held out.
    """
    held = heldout_by_hash(doc_hash, fraction)
    if fraction > 0 and not held.any() and len(held) > 1:
        unit = _hash_unit(doc_hash)
        held[unit == unit.min()] = True
    return held


def _hash_unit(doc_hash: np.ndarray) -> np.ndarray:
    """Each content hash as a number in [0, 1)."""
    return (doc_hash >> np.uint64(11)).astype(np.float64) * 2.0**-53


def heldout_by_hash(doc_hash: np.ndarray, fraction: float) -> np.ndarray:
    """Boolean [num_docs]: documents whose content hash falls below `fraction`, each decided
    alone (a stream of documents is split as it arrives: roformer.data.streaming)."""
    if not 0.0 <= fraction < 1.0:
        raise ConfigError(f"data.heldout_fraction={fraction}: must be in [0, 1)")
    return _hash_unit(doc_hash) < fraction


def check_stream_settings(*, seq_len: int, batch_size: int, packing: str, process_index: int,
                          process_count: int) -> None:
    """The batch stream's settings, refused in one line when out of range."""
    if seq_len < MIN_SEQ_LEN:
        raise ConfigError(f"seq_len={seq_len}: must be >= {MIN_SEQ_LEN}")
    if batch_size < 1:
        raise ConfigError(f"batch_size={batch_size}: must be >= 1")
    if packing not in PACKINGS:
        raise ConfigError(f"data.packing={packing!r}: expected one of {PACKINGS}")
    if not 0 <= process_index < process_count:
        raise ConfigError(f"process_index={process_index} must be in [0, process_count={process_count})")


class PretrainData:
    """Tokenizer, shards and split of one corpus, plus the batch streams over it."""

    def __init__(self, corpus: shards_lib.TokenCorpus, tokenizer: WordPieceTokenizer, masker: MlmMasker, *,
                 seq_len: int, batch_size: int, packing: str, heldout_fraction: float, seed: int,
                 process_index: int = 0, process_count: int = 1) -> None:
        self.set_stream_settings(tokenizer, masker, seq_len=seq_len, batch_size=batch_size, packing=packing,
                                 heldout_fraction=heldout_fraction, seed=seed, process_index=process_index,
                                 process_count=process_count)
        self.corpus = corpus
        if corpus.num_docs < 2:
            # The split keeps documents whole (no text on both sides), so one document cannot
            # give both training and held-out data, whatever data.heldout_fraction is.
            raise ConfigError(
                f"the corpus is a single document ({corpus.num_tokens} tokens) and training needs at least two, "
                "since the held-out split is by document: split the text into documents (in a plain-text "
                "file a blank line ends one) or add files to data.files")
        held = heldout_documents(corpus.doc_hash, heldout_fraction)
        self.train_docs = np.flatnonzero(~held)
        self.heldout_docs = np.flatnonzero(held)
        if len(self.train_docs) < process_count:
            raise ConfigError(f"corpus has {len(self.train_docs)} training documents, fewer than "
                              f"process_count={process_count}: use a larger corpus")
        self.manifest = {
            "source": corpus.manifest["source"], "shards": str(corpus.directory),
            "tokenizer_hash": tokenizer.hash, "vocab_size": self.vocab_size,
            "num_docs": corpus.num_docs, "num_tokens": corpus.num_tokens,
            "train_docs": len(self.train_docs), "heldout_docs": len(self.heldout_docs),
            "train_tokens": int(corpus.doc_len[self.train_docs].sum()),
            "heldout_tokens": int(corpus.doc_len[self.heldout_docs].sum()),
            "seq_len": seq_len, "packing": packing, "max_predictions_per_seq": masker.max_predictions,
        }
        # Anything that changes the stream changes this id; a saved iterator state
        # from a different setup is refused instead of silently continuing elsewhere.
        # The corpus enters by content, so moving or re-touching the text files is fine.
        # corpus_id: what a run may not change between phases (text, tokenizer, split,
        # masking); stream_id adds the batch shape, which a new phase may change.
        self.corpus_id = sha256_json([
            corpus.content_id, packing, heldout_fraction, masker.mask_rate, masker.whole_word])[:16]
        self.stream_id = sha256_json([
            corpus.content_id, seq_len, batch_size, packing, heldout_fraction, masker.mask_rate,
            masker.max_predictions, masker.whole_word])[:16]

    def set_stream_settings(self, tokenizer: WordPieceTokenizer, masker: MlmMasker, *, seq_len: int,
                            batch_size: int, packing: str, heldout_fraction: float, seed: int, process_index: int,
                            process_count: int) -> None:
        """The batch streams' settings, refused in one line when out of range, and the
        tokenizer's ids the rows use: the part of the setup that does not read the corpus, so
        a corpus still being built (roformer.data.streaming) shares it."""
        check_stream_settings(seq_len=seq_len, batch_size=batch_size, packing=packing,
                              process_index=process_index, process_count=process_count)
        heldout_by_hash(np.zeros(0, np.uint64), heldout_fraction)   # its range check
        self.tokenizer, self.masker = tokenizer, masker
        self.seq_len, self.batch_size, self.packing, self.seed = seq_len, batch_size, packing, int(seed)
        self.heldout_fraction = heldout_fraction
        self.process_index, self.process_count = process_index, process_count
        self.vocab_size = tokenizer.vocab_size
        self.pad_id, self.cls_id = tokenizer.pad_id, tokenizer.cls_id
        self.sep_id, self.mask_id = tokenizer.sep_id, tokenizer.mask_id

    def unigram_loss(self) -> float:
        """Entropy (nats) of the training documents' non-special token distribution: the
        held-out MLM loss of a model that ignores context and predicts token frequencies.
        Masked targets are drawn uniformly among non-special tokens, so this is the
        context-free baseline every MLM loss on this corpus and vocabulary is measured against."""
        counts = np.zeros(self.vocab_size, np.int64)
        for shard in self.corpus.tokens:
            counts += np.bincount(shard, minlength=self.vocab_size)[:self.vocab_size]
        held = self.heldout_docs
        counts -= np.bincount(self.corpus.gather(held, np.zeros_like(held), self.corpus.doc_len[held]),
                              minlength=self.vocab_size)[:self.vocab_size]
        counts[self.tokenizer.is_special] = 0
        p = counts[counts > 0] / counts.sum()
        return float(-(p * np.log(p)).sum())

    def train_iterator(self) -> "BatchIterator":
        return BatchIterator(self)

    def close(self) -> None:
        """Nothing to end here (a corpus still being built stops its build: roformer.data.streaming)."""

    def epoch_plan(self, epoch: int) -> PackPlan:
        """This process's rows for one pass over its share of the training documents."""
        order = np.random.default_rng([self.seed, epoch]).permutation(self.train_docs)
        return plan_rows(order[self.process_index::self.process_count], self.corpus.doc_len,
                         self.seq_len, self.packing)

    def rows(self, plan: PackPlan, lo: int, hi: int) -> dict[str, np.ndarray]:
        return build_rows(plan, self.corpus, lo, hi, cls_id=self.cls_id, sep_id=self.sep_id, pad_id=self.pad_id)

    def make_batch(self, rows: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
        """Masks packed rows into the batch format the training step consumes."""
        masked = self.masker(rows["input_ids"], rng)
        batch = {
            "input_ids": masked["input_ids"],
            "token_type_ids": np.zeros_like(rows["input_ids"]),
            "positions": rows["positions"],
            "segment_ids": rows["segment_ids"],
            "masked_positions": masked["masked_positions"],
            "masked_labels": masked["masked_labels"],
            "masked_weights": masked["masked_weights"],
        }
        if self.packing == "document":
            # One document per row from column 0, right-padded: attention takes the padding
            # as lengths, with no [L, L] mask (roformer.train.steps.padding_inputs).
            batch["lengths"] = (rows["segment_ids"] != 0).sum(axis=1).astype(np.int32)
        return batch

    def shuffle_within_pieces(self, batch: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
        """The same masked batch with the tokens of every piece (one document's run inside a
        row) permuted, carrying the prediction slots along.

        [CLS], [SEP] and padding stay where they are, positions and segments are unchanged,
        and the same tokens are predicted: only their order differs. The held-out loss on
        such batches minus the plain one measures how much a model uses word order (a
        permutation-equivariant model, e.g. no position information, scores both alike)."""
        ids, segments = batch["input_ids"], batch["segment_ids"]
        B, L = ids.shape
        movable = (segments != 0) & (ids != self.cls_id) & (ids != self.sep_id)
        targets = np.flatnonzero(movable)                   # sorted by (row, piece, column)
        piece = (np.arange(B)[:, None] * (L + 1) + segments).ravel()[targets]
        sources = targets[np.lexsort((rng.random(len(targets)), piece))]   # random order per piece
        new_ids = ids.ravel().copy()
        new_ids[targets] = ids.ravel()[sources]
        moved_to = np.tile(np.arange(L), B)                 # new column of every old slot
        moved_to[sources] = targets % L
        slots = np.take_along_axis(moved_to.reshape(B, L), batch["masked_positions"].astype(np.int64), axis=1)
        return {**batch, "input_ids": new_ids.reshape(B, L), "masked_positions": slots.astype(np.int32)}

    def eval_documents(self, rows: int) -> np.ndarray:
        """This process's held-out documents, in corpus order, from which the first `rows`
        held-out rows are packed (all of them here)."""
        return self.heldout_docs[self.process_index::self.process_count]

    def eval_batches(self, num_batches: int, *, shuffled: bool = False) -> list[dict]:
        """The first num_batches held-out batches (cycling if the held-out set is smaller), fixed masks;
        `shuffled`: the same batches with each piece's tokens permuted (`shuffle_within_pieces`)."""
        needed = num_batches * self.batch_size
        mine = self.eval_documents(needed)
        if len(mine) == 0:
            held = len(self.heldout_docs)
            raise ConfigError(f"data.heldout_fraction={self.heldout_fraction} holds out {held} of the corpus's "
                              f"{self.corpus.num_docs} documents, none for process {self.process_index} of "
                              f"{self.process_count}: raise data.heldout_fraction")
        plan = plan_rows(mine, self.corpus.doc_len, self.seq_len, self.packing)
        rows = self.rows(plan, 0, min(plan.num_rows, needed))
        batches = []
        for b in range(num_batches):
            index = np.arange(b * self.batch_size, (b + 1) * self.batch_size) % plan.num_rows
            picked = {k: v[index] for k, v in rows.items()}
            batch = self.make_batch(picked, np.random.default_rng([EVAL_SEED, self.process_index, b]))
            if shuffled:
                batch = self.shuffle_within_pieces(batch, np.random.default_rng([EVAL_SEED, self.process_index, b, 1]))
            batches.append(batch)
        return batches


class BatchIterator:
    """Infinite stream of masked training batches; get_state/set_state resume it exactly."""

    def __init__(self, data: PretrainData) -> None:
        self._data = data
        self.epoch, self.row, self.step = 0, 0, 0
        self.phase = 0   # how many batch-shape changes the stream has gone through
        self._plan: PackPlan | None = None
        self._plan_epoch = -1

    def __iter__(self) -> "BatchIterator":
        return self

    def _current_plan(self) -> PackPlan:
        if self._plan_epoch != self.epoch:
            self._plan, self._plan_epoch = self._data.epoch_plan(self.epoch), self.epoch
        return self._plan

    def _next_plan(self) -> None:
        """Past the end of the current plan: an epoch boundary, continue with the next permutation."""
        self.epoch, self.row = self.epoch + 1, 0

    def __next__(self) -> dict[str, np.ndarray]:
        data = self._data
        parts = []
        needed = data.batch_size
        while needed:
            plan = self._current_plan()
            take = min(needed, plan.num_rows - self.row)
            if take:
                parts.append(data.rows(plan, self.row, self.row + take))
            self.row += take
            needed -= take
            if self.row == plan.num_rows:
                self._next_plan()
        rows = parts[0] if len(parts) == 1 else {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        batch = data.make_batch(rows, np.random.default_rng([data.seed, data.process_index, self.step]))
        self.step += 1
        return batch

    def get_state(self) -> dict:
        d = self._data
        return {"epoch": self.epoch, "row": self.row, "step": self.step, "phase": self.phase, "seed": d.seed,
                "process_index": d.process_index, "process_count": d.process_count,
                "corpus_id": d.corpus_id, "stream_id": d.stream_id}

    def set_state(self, state: dict) -> None:
        """Continue exactly where `state` left off (same corpus, settings and batch shape)."""
        self._check(state, ("stream_id",))
        self.epoch, self.row, self.step = int(state["epoch"]), int(state["row"]), int(state["step"])
        self.phase = int(state.get("phase", 0))

    def start_phase(self, state: dict) -> None:
        """Begin this stream's batch shape as a new phase after `state` (a stream of another
        seq_len / batch_size over the same corpus and masking).

        The new phase starts at the beginning of the next epoch's document permutation, so
        it does not replay, in the same order, the documents the previous phase was just
        given; mask seeds continue from the previous phase's batch count."""
        self._check(state, ("corpus_id",))
        self.epoch, self.row, self.step = int(state["epoch"]) + 1, 0, int(state["step"])
        self.phase = int(state.get("phase", 0)) + 1

    def resume(self, state: dict) -> bool:
        """set_state when `state` is of this stream, else start_phase; True for a new phase."""
        if state.get("stream_id") == self._data.stream_id:
            self.set_state(state)
            return False
        self.start_phase(state)
        return True

    def _check(self, state: dict, ids: tuple[str, ...]) -> None:
        d = self._data
        for key, mine in (("seed", d.seed), ("process_index", d.process_index),
                          ("process_count", d.process_count), *((k, getattr(d, k)) for k in ids)):
            if state.get(key) != mine:
                raise ConfigError(
                    f"data iterator state has {key}={state.get(key)!r} but this pipeline has {key}={mine!r}: "
                    "it was saved with a different corpus, tokenizer or data setting. Between phases only "
                    "train.seq_len, train.batch_size and data.max_predictions_per_seq may change")


# ---------------------------------------------------------------- construction

def resolve_tokenizer(data: DataConfig, source: TextSource, cache_dir: Path, *,
                      show_progress: bool = True) -> WordPieceTokenizer:
    """data.vocab when given; else a WordPiece vocab trained on the source (cached)."""
    if data.vocab:
        return load_tokenizer(data.vocab, lowercase=data.lowercase)
    key = sha256_json([source.fingerprint(), data.vocab_size, data.lowercase])[:20]
    directory = cache_dir / "tokenizers" / f"{source.name}-{key}"
    tokenizer = _cached_tokenizer(directory)
    if tokenizer is None:
        # one run trains it, others sharing the cache wait and read it (training is not
        # deterministic: they must not each keep their own)
        with build_lock(directory):
            tokenizer = _cached_tokenizer(directory, quiet=True)
            if tokenizer is None:
                for stale in stale_staging(directory.parent):   # trainings killed before the rename
                    shutil.rmtree(stale, ignore_errors=True)
                shutil.rmtree(directory, ignore_errors=True)   # an unusable entry
                with writing(f"the tokenizer cache entry {directory}"):
                    _train_tokenizer(data, source, directory, show_progress)
                tokenizer = WordPieceTokenizer.from_tokenizer_json(directory / "tokenizer.json")
    return tokenizer


def _cached_tokenizer(directory: Path, *, quiet: bool = False) -> WordPieceTokenizer | None:
    """The tokenizer of cache entry `directory`; None when there is none, or (said in a
    warning unless `quiet`) when it cannot be read, e.g. a file truncated by a full disk."""
    path = directory / "tokenizer.json"
    if not directory.exists():
        return None
    try:
        return WordPieceTokenizer.from_tokenizer_json(path)
    except ConfigError as error:
        if not quiet:
            log.warning("tokenizer cache entry %s is unusable (%s); rebuilding it", directory,
                        error.__cause__ or error)
        return None


def _train_tokenizer(data: DataConfig, source: TextSource, directory: Path, show_progress: bool) -> None:
    log.info("training a %d-token WordPiece vocabulary on %s", data.vocab_size, source)
    tokenizer = WordPieceTokenizer.train(source.documents(), vocab_size=data.vocab_size, lowercase=data.lowercase,
                                         show_progress=show_progress)
    staging = staging_name(directory)
    tokenizer.save(staging)
    try:
        os.replace(staging, directory)
    except OSError:  # another process finished first (a cache where flock is refused): use theirs
        shutil.rmtree(staging, ignore_errors=True)


def cache_directory(data: DataConfig) -> Path:
    """Where data's tokenizers and token shards are cached."""
    return Path(data.cache_dir or shards_lib.default_cache_dir()).expanduser()


def corpus_tokenizer(data: DataConfig, *, show_progress: bool = True) -> WordPieceTokenizer:
    """The tokenizer a run on `data` uses: data.vocab, or the one trained on its source (cached)."""
    return resolve_tokenizer(data, make_source(data), cache_directory(data), show_progress=show_progress)


def prepare_corpus(data: DataConfig, *, process_index: int = 0, process_count: int = 1,
                   show_progress: bool = True) -> tuple[WordPieceTokenizer, shards_lib.TokenCorpus]:
    """The tokenizer and token shards of data's corpus, built into the cache if missing.

    In a job of `process_count` processes sharing the cache directory, each process
    tokenizes its share of the source's files (see shard_build.load_or_build)."""
    if not isinstance(data, DataConfig):
        raise TypeError(f"expected a DataConfig, got {type(data).__name__}: convert a config's data "
                        "section with DataConfig.from_mapping(config.data)")
    cache_dir = cache_directory(data)
    source = make_source(data)
    tokenizer = resolve_tokenizer(data, source, cache_dir, show_progress=show_progress)
    corpus = shard_build.load_or_build(source, tokenizer, cache_dir, process_index=process_index,
                                      process_count=process_count, num_workers=data.num_workers,
                                      show_progress=show_progress)
    return tokenizer, corpus


def max_predictions(data: DataConfig, seq_len: int) -> int:
    """Masked slots per row: data.max_predictions_per_seq, or round(mask_rate * seq_len) + 1."""
    return data.max_predictions_per_seq or round(data.mask_rate * seq_len) + 1


def batch_format(data: DataConfig, *, seq_len: int, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
    """The shape and dtype of every array of a `batch_size`-row batch `PretrainData.make_batch`
    makes, known from the config alone: a step can be compiled for it before any data exists
    (roformer.launch_check)."""
    slots = max_predictions(data, seq_len)
    rows, masked = (batch_size, seq_len), (batch_size, slots)
    spec = {"input_ids": rows, "token_type_ids": rows, "positions": rows, "segment_ids": rows,
            "masked_positions": masked, "masked_labels": masked}
    out = {name: jax.ShapeDtypeStruct(shape, np.int32) for name, shape in spec.items()}
    out["masked_weights"] = jax.ShapeDtypeStruct(masked, np.float32)
    if data.packing == "document":
        out["lengths"] = jax.ShapeDtypeStruct((batch_size,), np.int32)
    return out


def make_pretrain_data(data: DataConfig, *, seq_len: int, batch_size: int, seed: int,
                       process_index: int = 0, process_count: int = 1,
                       show_progress: bool = True) -> PretrainData:
    """Builds (or reuses) everything for MLM pretraining on data's corpus; this process reads
    its share (`process_index` of `process_count`) of every batch stream."""
    if seq_len < MIN_SEQ_LEN:
        raise ConfigError(f"seq_len={seq_len}: must be >= {MIN_SEQ_LEN}")
    if data.max_predictions_per_seq > seq_len:   # before a batch of that many slots is allocated
        raise ConfigError(f"data.max_predictions_per_seq={data.max_predictions_per_seq} is more than the "
                          f"{seq_len} positions of a sequence (train.seq_len): at most one prediction per position; "
                          "0 takes round(data.mask_rate * seq_len) + 1")
    if isinstance(data, DataConfig) and data.trains_while_building:   # (prepare_corpus refuses a raw section)
        from roformer.data import streaming   # imported here: it builds on this module

        return streaming.make_streamed_data(data, seq_len=seq_len, batch_size=batch_size, seed=seed,
                                            process_index=process_index, process_count=process_count,
                                            show_progress=show_progress)
    tokenizer, corpus = prepare_corpus(data, process_index=process_index, process_count=process_count,
                                       show_progress=show_progress)
    masker = make_masker(data, tokenizer, seq_len)
    return PretrainData(corpus, tokenizer, masker, seq_len=seq_len, batch_size=batch_size, packing=data.packing,
                        heldout_fraction=data.heldout_fraction, seed=seed,
                        process_index=process_index, process_count=process_count)


def make_masker(data: DataConfig, tokenizer: WordPieceTokenizer, seq_len: int) -> MlmMasker:
    """The MLM masker of data's settings for rows of `seq_len`."""
    max_predictions = data.max_predictions_per_seq or round(data.mask_rate * seq_len) + 1
    return MlmMasker(is_special=tokenizer.is_special, is_continuation=tokenizer.is_continuation,
                     mask_id=tokenizer.mask_id, mask_rate=data.mask_rate, max_predictions=max_predictions,
                     whole_word=data.whole_word_masking)
