"""BERT-style WordPiece tokenizer on HF `tokenizers` (Rust, batch-parallel).

The pipeline matches `transformers.BertTokenizerFast`: BertNormalizer (clean text,
CJK split, lowercase + accent strip when uncased), BertPreTokenizer, WordPiece with
"##" continuations, `[CLS] A [SEP] (B [SEP])` post-processing.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
from tokenizers import Encoding, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from roformer.errors import ConfigError
from roformer.files import write_text_atomic

log = logging.getLogger(__name__)

PAD, UNK, CLS, SEP, MASK = "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"
# [PAD] first so padding is id 0, as the batch format and ModelConfig.pad_token_id expect.
SPECIAL_TOKENS = (PAD, UNK, CLS, SEP, MASK)


def _bert_pipeline(tokenizer: Tokenizer, lowercase: bool) -> Tokenizer:
    tokenizer.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=lowercase)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    return tokenizer


def _add_post_processor(tokenizer: Tokenizer, where: str) -> Tokenizer:
    cls_id, sep_id = tokenizer.token_to_id(CLS), tokenizer.token_to_id(SEP)
    if cls_id is None or sep_id is None:
        raise ConfigError(f"{where}: vocabulary has no {CLS} or {SEP} token")
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{CLS}:0 $A:0 {SEP}:0", pair=f"{CLS}:0 $A:0 {SEP}:0 $B:1 {SEP}:1",
        special_tokens=[(CLS, cls_id), (SEP, sep_id)])
    return tokenizer


class WordPieceTokenizer:
    """Wraps a `tokenizers.Tokenizer` with the ids and lookup tables the pipeline needs."""

    def __init__(self, tokenizer: Tokenizer, *, where: str = "tokenizer") -> None:
        self.tokenizer = tokenizer
        ids = {tok: tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS}
        missing = [tok for tok, i in ids.items() if i is None]
        if missing:
            raise ConfigError(f"{where}: vocabulary lacks the special tokens {missing}")
        self.pad_id, self.unk_id, self.cls_id = ids[PAD], ids[UNK], ids[CLS]
        self.sep_id, self.mask_id = ids[SEP], ids[MASK]
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        # Every "[...]" entry counts as special (covers BERT's [unusedN] too): never masked,
        # never drawn as a random replacement.
        self.special_ids = np.array(sorted({i for t, i in vocab.items() if t in SPECIAL_TOKENS or
                                            (len(t) > 2 and t[0] == "[" and t[-1] == "]")}), dtype=np.int64)
        self.is_special = np.zeros(self.vocab_size, dtype=bool)
        self.is_special[self.special_ids] = True
        # "##xyz" pieces continue the previous word (whole-word masking groups them).
        self.is_continuation = np.zeros(self.vocab_size, dtype=bool)
        self.is_continuation[[i for t, i in vocab.items() if t.startswith("##")]] = True
        self.hash = hashlib.sha256(tokenizer.to_str().encode()).hexdigest()

    # ------------------------------------------------------------ constructors
    @classmethod
    def from_vocab_file(cls, path: str | os.PathLike, *, lowercase: bool = True) -> "WordPieceTokenizer":
        """A BERT vocab.txt (one token per line); lowercase=False for cased vocabularies."""
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"data.vocab: vocabulary file not found: {path}")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise ConfigError(f"data.vocab: cannot read {path}: {err}") from err
        vocab = _line_numbered_vocab(text, path)
        if not vocab or UNK not in vocab:
            raise ConfigError(f"data.vocab: {path} is not a WordPiece vocab.txt (no {UNK} line)")
        tokenizer = Tokenizer(models.WordPiece(vocab, unk_token=UNK, max_input_chars_per_word=100))
        tokenizer = _add_post_processor(_bert_pipeline(tokenizer, lowercase), str(path))
        tokenizer.add_special_tokens([t for t in SPECIAL_TOKENS if t in vocab])
        return cls(tokenizer, where=f"data.vocab={path}")

    @classmethod
    def from_tokenizer_json(cls, path: str | os.PathLike) -> "WordPieceTokenizer":
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"data.vocab: tokenizer file not found: {path}")
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as err:  # the Rust side raises plain Exception
            raise ConfigError(f"data.vocab: {path} is not a tokenizers JSON file: {err}") from err
        return cls(tokenizer, where=f"data.vocab={path}")

    @classmethod
    def from_path(cls, path: str | os.PathLike, *, lowercase: bool = True) -> "WordPieceTokenizer":
        """`.json` -> tokenizer.json, anything else -> vocab.txt; a directory -> the one inside."""
        path = Path(path).expanduser()
        if path.is_dir():
            for name in ("tokenizer.json", "vocab.txt"):
                if (path / name).is_file():
                    path = path / name
                    break
            else:
                raise ConfigError(f"data.vocab: directory {path} has no tokenizer.json or vocab.txt")
        if path.suffix == ".json":
            return cls.from_tokenizer_json(path)
        return cls.from_vocab_file(path, lowercase=lowercase)

    @classmethod
    def train(cls, documents: Iterable[str], *, vocab_size: int, lowercase: bool = True,
              min_frequency: int = 2, show_progress: bool = True) -> "WordPieceTokenizer":
        """Learns a WordPiece vocabulary (BERT special tokens first, [PAD] = 0). The trainer's
        progress bar shows only on a terminal: into a log it writes blank lines."""
        if vocab_size < len(SPECIAL_TOKENS) + 1:
            raise ConfigError(f"data.vocab_size={vocab_size}: must exceed the {len(SPECIAL_TOKENS)} special tokens")
        tokenizer = _bert_pipeline(Tokenizer(models.WordPiece(unk_token=UNK, max_input_chars_per_word=100)),
                                   lowercase)
        trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                            special_tokens=list(SPECIAL_TOKENS),
                                            continuing_subword_prefix="##",
                                            show_progress=show_progress and sys.stdout.isatty())
        tokenizer.train_from_iterator(documents, trainer=trainer)
        if tokenizer.get_vocab_size() <= len(SPECIAL_TOKENS):
            raise ConfigError("tokenizer training found no text: the corpus is empty")
        return cls(_add_post_processor(tokenizer, "trained tokenizer"))

    # ------------------------------------------------------------ use
    @property
    def lowercase(self) -> bool:
        """Whether the normalizer lowercases (and strips accents): an uncased vocabulary."""
        return normalizer_lowercases(self.tokenizer)

    def encode(self, text: str, pair: str | None = None, *, add_special_tokens: bool = True) -> Encoding:
        return self.tokenizer.encode(text, pair, add_special_tokens=add_special_tokens)

    def encode_ids(self, texts: Sequence[str], *, add_special_tokens: bool = False) -> list[list[int]]:
        """Token ids of many texts, encoded by the Rust batch encoder on all cores."""
        # encode_batch_fast skips character offsets (about 2x faster); older tokenizers lack it.
        encode = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)
        return [e.ids for e in encode(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def save(self, directory: str | os.PathLike) -> Path:
        """Writes tokenizer.json and a BERT vocab.txt; returns the tokenizer.json path."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        vocab = self.tokenizer.get_vocab(with_added_tokens=True)
        by_id = sorted(vocab.items(), key=lambda kv: kv[1])
        write_text_atomic(directory / "vocab.txt", "".join(t + "\n" for t, _ in by_id), encoding="utf-8")
        path = directory / "tokenizer.json"
        write_text_atomic(path, self.tokenizer.to_str(pretty=True), encoding="utf-8")
        return path


def normalizer_lowercases(tokenizer: Tokenizer) -> bool:
    """Whether `tokenizer`'s (BERT) normalizer lowercases its input."""
    normalizer = json.loads(tokenizer.to_str()).get("normalizer") or {}
    return bool(normalizer.get("lowercase", False))


def _line_numbered_vocab(text: str, path: Path) -> dict[str, int]:
    """token -> id of a vocab.txt: the id is the line number (from 0), as in transformers.

    A model's embedding rows are indexed by line, so ids must not depend on what other
    lines hold. A repeated token takes the id of its last line, as transformers'
    BertTokenizer does; the line it shadows keeps its id with a placeholder token that no
    text encodes to ("[...]" is split by the pre-tokenizer), so ids stay line numbers in
    the tokenizer, its vocab_size and the vocab.txt `save` writes.
    """
    # Lines end at "\n" only (as transformers reads them), not at str.splitlines()'s other breaks.
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    vocab: dict[str, int] = {}
    shadowed: list[tuple[str, int, int]] = []
    for index, token in enumerate(lines):
        if token in vocab:
            shadowed.append((token, vocab[token], index))
        vocab[token] = index
    if shadowed:
        named = ", ".join(f"{token!r} on lines {a + 1} and {b + 1} (id {b}; id {a} unused)"
                          for token, a, b in shadowed[:3])
        more = f" and {len(shadowed) - 3} more" if len(shadowed) > 3 else ""
        log.warning("data.vocab: %s repeats %s%s: ids are line numbers, so later tokens keep theirs, and a "
                    "repeated token takes its last line's id, as transformers' BertTokenizer does",
                    path, named, more)
        for _token, earlier, _ in shadowed:
            placeholder = f"[duplicate-line-{earlier + 1}]"
            while placeholder in vocab:
                placeholder = f"[{placeholder}]"
            vocab[placeholder] = earlier
    return vocab


def load_tokenizer(vocab: str, *, lowercase: bool = True) -> WordPieceTokenizer:
    """The tokenizer named by data.vocab (a vocab.txt, a tokenizer.json or a directory)."""
    if not vocab:
        raise ConfigError("data.vocab is empty: give a vocab.txt / tokenizer.json path, or use "
                          "roformer.data.pipeline to train one on the source")
    return WordPieceTokenizer.from_path(vocab, lowercase=lowercase)
