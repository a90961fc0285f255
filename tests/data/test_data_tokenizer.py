"""WordPiece tokenizer: parity with transformers' BERT tokenizers, vocab training, CLI, errors."""
import itertools
import json

import numpy as np
import pytest

from helpers import needs_transformers
from roformer.data.__main__ import tokenizer_main
from roformer.data.sources import FilesSource
from roformer.data.tokenizer import SPECIAL_TOKENS, WordPieceTokenizer, load_tokenizer

pytestmark = pytest.mark.fast   # the fast lane (docs/testing.md)


@pytest.fixture(scope="module")
def bert_vocab(shared_data):
    return shared_data / "vocab" / "bert-base-uncased-vocab.txt"


@pytest.fixture(scope="module")
def wiki_lines(shared_data):
    """Real Wikipedia lines (bodies, headings, accents, CJK, symbols) from two files."""
    source = FilesSource(str(shared_data / "wikipedia_en" / "wiki_0[45]"))
    lines = [ln for doc in source.documents() for ln in doc.splitlines()]
    assert len(lines) > 3000
    return lines


@pytest.fixture(scope="module")
def ours(bert_vocab):
    return WordPieceTokenizer.from_vocab_file(bert_vocab)


@needs_transformers
def test_ids_equal_bert_tokenizer_fast_on_wikipedia(ours, bert_vocab, wiki_lines):
    from transformers import BertTokenizerFast

    # transformers 5 takes the vocab file as `vocab=`; `vocab_file=` is silently ignored
    # there (it would build a 5-token vocabulary), hence the size check.
    reference = BertTokenizerFast(vocab=str(bert_vocab))
    assert reference.backend_tokenizer.get_vocab_size() == 30522
    lines = wiki_lines[:4000]
    expected = reference(lines)["input_ids"]
    got = [e.ids for e in ours.tokenizer.encode_batch(lines)]
    assert got == expected
    assert sum(map(len, got)) > 100_000
    # pairs (as GLUE uses them): ids and token types
    pair = reference(lines[:50], lines[50:100])
    encodings = ours.tokenizer.encode_batch(list(zip(lines[:50], lines[50:100])))
    assert [e.ids for e in encodings] == pair["input_ids"]
    assert [e.type_ids for e in encodings] == pair["token_type_ids"]


@needs_transformers
def test_ids_equal_pure_python_bert_tokenizer(ours, bert_vocab, wiki_lines):
    """An independent implementation: transformers' original Python BasicTokenizer + WordPiece."""
    from transformers.models.bert.tokenization_bert_legacy import BertTokenizerLegacy

    reference = BertTokenizerLegacy(vocab_file=str(bert_vocab))
    lines = wiki_lines[4000:4400]
    assert [reference(ln)["input_ids"] for ln in lines] == [e.ids for e in ours.tokenizer.encode_batch(lines)]


@pytest.fixture(scope="module")
def duplicate_vocab(bert_vocab, tmp_path_factory):
    """The BERT vocab with line 2051 ("##a", id 2050) replaced by a second "the" (line 1997)."""
    lines = bert_vocab.read_text(encoding="utf-8").split("\n")
    assert lines[1996] == "the" and lines[2050] != "the"
    lines[2050] = "the"
    path = tmp_path_factory.mktemp("dup") / "vocab.txt"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def test_duplicate_vocab_line_keeps_ids_equal_to_line_numbers(duplicate_vocab, ours, wiki_lines, caplog, tmp_path):
    with caplog.at_level("WARNING", logger="roformer.data.tokenizer"):
        dup = WordPieceTokenizer.from_vocab_file(duplicate_vocab)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1
    assert "'the' on lines 1997 and 2051" in warnings[0] and str(duplicate_vocab) in warnings[0]
    # every token whose line did not change keeps the clean file's id (issue: 2102/2413/4999)
    assert dup.encode_ids(["the city of london knight"]) == [[2050, 2103, 1997, 2414, 5000]]
    assert ours.encode_ids(["city of london knight"]) == [[2103, 1997, 2414, 5000]]
    assert dup.vocab_size == ours.vocab_size == 30522
    assert dup.is_special[1996] and not dup.is_special[2050]   # the shadowed id is never drawn
    # the same ids as a clean file whose line 1997 no text matches and whose line 2051 is "the"
    clean = duplicate_vocab.read_text(encoding="utf-8").split("\n")
    clean[1996] = "[no-text-matches-this]"
    (tmp_path / "clean.txt").write_text("\n".join(clean), encoding="utf-8")
    lines = wiki_lines[:300]
    assert dup.encode_ids(lines) == WordPieceTokenizer.from_vocab_file(tmp_path / "clean.txt").encode_ids(lines)
    # saving keeps every id on its line, and the saved tokenizer reloads to the same ids
    dup.save(tmp_path / "saved")
    saved = (tmp_path / "saved" / "vocab.txt").read_text(encoding="utf-8").split("\n")[:-1]
    assert len(saved) == 30522 and saved[2050] == "the" and saved[2103] == "city"
    assert load_tokenizer(str(tmp_path / "saved")).encode_ids(lines) == dup.encode_ids(lines)


@needs_transformers
def test_duplicate_vocab_line_ids_equal_transformers(duplicate_vocab, wiki_lines):
    from transformers import BertTokenizer

    reference = BertTokenizer(vocab=str(duplicate_vocab))
    dup = WordPieceTokenizer.from_vocab_file(duplicate_vocab)
    lines = ["the city of london knight", *wiki_lines[:500]]
    assert reference("the city of london knight")["input_ids"] == [101, 2050, 2103, 1997, 2414, 5000, 102]
    assert [e.ids for e in dup.tokenizer.encode_batch(lines)] == reference(lines)["input_ids"]


def test_special_ids_and_lookup_tables(ours):
    assert (ours.pad_id, ours.unk_id, ours.cls_id, ours.sep_id, ours.mask_id) == (0, 100, 101, 102, 103)
    assert ours.vocab_size == 30522
    assert ours.is_special[[0, 1, 100, 101, 102, 103, 998]].all()      # [unusedN] count as special
    assert not ours.is_special[1996]                                     # "the"
    assert ours.is_continuation[ours.tokenizer.token_to_id("##ing")]
    assert not ours.is_continuation[ours.tokenizer.token_to_id("the")]
    assert ours.encode("Hello [MASK] world").tokens == ["[CLS]", "hello", "[MASK]", "world", "[SEP]"]
    assert ours.encode_ids(["Hello world"]) == [[7592, 2088]]           # shards store no specials


def test_tokenizer_json_round_trip_and_hash(ours, tmp_path, wiki_lines):
    path = ours.save(tmp_path / "tok")
    again = load_tokenizer(str(path))
    assert again.hash == ours.hash
    assert again.encode_ids(wiki_lines[:200]) == ours.encode_ids(wiki_lines[:200])
    assert (tmp_path / "tok" / "vocab.txt").read_text().splitlines()[:1] == ["[PAD]"]
    assert load_tokenizer(str(tmp_path / "tok")).hash == ours.hash      # a directory works too
    cased = WordPieceTokenizer.from_vocab_file(tmp_path / "tok" / "vocab.txt", lowercase=False)
    assert cased.hash != ours.hash


def test_train_cli_writes_a_usable_vocabulary(tmp_path, capsys):
    out = tmp_path / "vocab"
    assert tokenizer_main(["train", "--source", "embedded", "--vocab-size", "1500", "--out", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    trained = load_tokenizer(str(out / "tokenizer.json"))
    from_txt = load_tokenizer(str(out / "vocab.txt"))
    assert [trained.tokenizer.id_to_token(i) for i in range(5)] == list(SPECIAL_TOKENS)
    assert 1000 < trained.vocab_size <= 1500
    text = "The assert statement raises AssertionError when the expression is false."
    ids = trained.encode(text).ids
    assert ids[0] == trained.cls_id and ids[-1] == trained.sep_id
    assert trained.unk_id not in ids
    assert from_txt.encode(text).ids == ids
    assert tokenizer_main(["encode", "--vocab", str(out), "assert x"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["tokens"][0] == "[CLS]" and printed["ids"] == trained.encode("assert x").ids


def test_bad_vocab_inputs_raise_clear_errors(tmp_path):
    with pytest.raises(ValueError, match=r"vocabulary file not found: .*missing\.txt"):
        load_tokenizer(str(tmp_path / "missing.txt"))
    with pytest.raises(ValueError, match=r"tokenizer file not found: .*missing\.json"):
        load_tokenizer(str(tmp_path / "missing.json"))
    not_vocab = tmp_path / "words.txt"
    not_vocab.write_text("hello\nworld\n")
    with pytest.raises(ValueError, match=r"words\.txt is not a WordPiece vocab\.txt"):
        load_tokenizer(str(not_vocab))
    no_mask = tmp_path / "nomask.txt"
    no_mask.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "a", "b"]) + "\n")
    with pytest.raises(ValueError, match=r"nomask\.txt.*lacks the special tokens \['\[MASK\]'\]"):
        load_tokenizer(str(no_mask))
    with pytest.raises(ValueError, match="data.vocab is empty"):
        load_tokenizer("")


def test_batch_encoding_is_order_preserving(ours, wiki_lines):
    lines = wiki_lines[:300]
    batched = ours.encode_ids(lines)
    single = [ours.encode(ln, add_special_tokens=False).ids for ln in lines]
    assert batched == single
    flat = np.fromiter(itertools.chain.from_iterable(batched), dtype=np.int64)
    assert flat.max() < ours.vocab_size
