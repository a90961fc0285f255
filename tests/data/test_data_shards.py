"""Token shard cache: built once, reused, invalidated by a changed source/tokenizer, rebuilt when damaged."""
import json
import zlib

import numpy as np
import pytest

from helpers import cache_entries
from roformer.data import shard_build, shards
from roformer.data.sources import FilesSource
from roformer.data.tokenizer import WordPieceTokenizer

DOCS = ["The quick brown fox jumps over the lazy dog.", "Rotary position embedding rotates queries.",
        "A third document, about packing and masking.", "Short one."]


@pytest.fixture(scope="module")
def tokenizer(shared_data):
    return WordPieceTokenizer.from_vocab_file(shared_data / "vocab" / "bert-base-uncased-vocab.txt")


@pytest.fixture
def corpus_file(tmp_path):
    path = tmp_path / "corpus" / "docs.txt"
    path.parent.mkdir()
    path.write_text("\n\n".join(DOCS) + "\n")
    return path


@pytest.fixture
def builds(monkeypatch):
    """Counts real shard builds (calls of the tokenizing loop)."""
    calls = []
    real = shard_build.encode_parts

    def counting(parts, *args, **kwargs):
        calls.append(parts)
        return real(parts, *args, **kwargs)

    monkeypatch.setattr(shard_build, "encode_parts", counting)
    return calls


def _load(corpus_file, tokenizer, cache, **kwargs):
    return shard_build.load_or_build(FilesSource(str(corpus_file)), tokenizer, cache, show_progress=False, **kwargs)


def test_build_contents_and_manifest(corpus_file, tokenizer, tmp_path):
    corpus = _load(corpus_file, tokenizer, tmp_path / "cache")
    assert corpus.num_docs == len(DOCS)
    for i, doc in enumerate(DOCS):
        ids = corpus.gather(np.array([i]), np.array([0]), corpus.doc_len[[i]])
        assert ids.tolist() == tokenizer.encode(doc, add_special_tokens=False).ids
    m = corpus.manifest
    assert m["num_tokens"] == int(corpus.doc_len.sum()) and m["num_docs"] == len(DOCS)
    assert m["tokenizer_hash"] == tokenizer.hash and m["dtype"] == "uint16"
    assert m["source"]["files"][0][0] == str(corpus_file)
    assert m["bytes"] == sum(p.stat().st_size for p in corpus.directory.glob("shard_*.npy"))
    assert len(set(corpus.doc_hash.tolist())) == len(DOCS)


def test_multiple_shards_gather_across_files(corpus_file, tokenizer, tmp_path, monkeypatch):
    monkeypatch.setattr(shards, "CHUNK_CHARS", 1)                  # one document per encoder call
    corpus = _load(corpus_file, tokenizer, tmp_path / "cache", shard_tokens=10)
    assert len(corpus.manifest["shards"]) >= 3
    docs = np.arange(len(DOCS))[::-1]
    got = corpus.gather(docs, np.zeros(len(DOCS), dtype=np.int64), corpus.doc_len[docs])
    expected = sum((tokenizer.encode(DOCS[d], add_special_tokens=False).ids for d in docs), [])
    assert got.tolist() == expected


def test_reuse_and_invalidation(corpus_file, tokenizer, tmp_path, builds):
    cache = tmp_path / "cache"
    first = _load(corpus_file, tokenizer, cache)
    again = _load(corpus_file, tokenizer, cache)
    assert len(builds) == 1 and again.directory == first.directory
    # a different tokenizer (cased) -> a different cache entry
    cased = WordPieceTokenizer.from_vocab_file(tokenizer_vocab_path(tokenizer, tmp_path), lowercase=False)
    other = _load(corpus_file, cased, cache)
    assert len(builds) == 2 and other.directory != first.directory
    # a changed source -> rebuilt with the new document
    corpus_file.write_text(corpus_file.read_text() + "\nA fifth, new document.\n")
    changed = _load(corpus_file, tokenizer, cache)
    assert len(builds) == 3 and changed.num_docs == len(DOCS) + 1


def tokenizer_vocab_path(tokenizer, tmp_path):
    tokenizer.save(tmp_path / "vocab_copy")
    return tmp_path / "vocab_copy" / "vocab.txt"


@pytest.mark.parametrize("damage", ["truncate", "flip_byte", "no_manifest", "bad_manifest", "missing_file"])
def test_damaged_cache_is_detected_and_rebuilt(corpus_file, tokenizer, tmp_path, builds, damage, caplog):
    cache = tmp_path / "cache"
    good = _load(corpus_file, tokenizer, cache)
    expected = good.gather(np.arange(len(DOCS)), np.zeros(len(DOCS), dtype=np.int64), good.doc_len)
    directory = good.directory
    del good
    tokens = directory / "shard_00000.tokens.npy"
    if damage == "truncate":
        tokens.write_bytes(tokens.read_bytes()[:-6])
    elif damage == "flip_byte":
        data = bytearray(tokens.read_bytes())
        data[-3] ^= 0xFF
        tokens.write_bytes(bytes(data))
    elif damage == "no_manifest":
        (directory / "manifest.json").unlink()
    elif damage == "bad_manifest":
        (directory / "manifest.json").write_text('{"format": 1, "shards": [')
    else:
        (directory / "shard_00000.offsets.npy").unlink()
    problem = shards.open_shards(directory, {})[1]
    assert problem
    with caplog.at_level("WARNING"):
        rebuilt = _load(corpus_file, tokenizer, cache)
    assert len(builds) == 2 and "rebuilding" in caplog.text
    got = rebuilt.gather(np.arange(len(DOCS)), np.zeros(len(DOCS), dtype=np.int64), rebuilt.doc_len)
    assert got.tolist() == expected.tolist()


def test_leftover_partial_build_is_ignored(corpus_file, tokenizer, tmp_path, builds):
    cache = tmp_path / "cache"
    corpus = _load(corpus_file, tokenizer, cache)
    stale = cache / "shards" / f".{corpus.directory.name}.partial-1-deadbeef"
    stale.mkdir()
    (stale / "shard_00000.tokens.npy").write_bytes(b"garbage")
    assert _load(corpus_file, tokenizer, cache).num_docs == len(DOCS)
    assert len(builds) == 1
    build = json.loads((corpus.directory / "build.json").read_text())
    assert build["tokens_per_second"] > 0 and build["processes"] == 1


def test_empty_corpus_is_an_error(tmp_path, tokenizer):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n   \n")
    with pytest.raises(ValueError, match=r"corpus is empty: .*empty\.txt"):
        _load(empty, tokenizer, tmp_path / "cache")
    stubs = tmp_path / "stubs.txt"
    stubs.write_text('<doc id="1" url="u" title="A">\nA\n\n</doc>\n')
    with pytest.raises(ValueError, match="corpus is empty"):
        _load(stubs, tokenizer, tmp_path / "cache")
    assert not cache_entries(tmp_path / "cache" / "shards")     # no half-built entry left behind


def test_token_ids_beyond_the_vocabulary_make_a_cache_entry_unusable(tiny_run, tiny_cache, tmp_path):
    from roformer.data.shards import open_shards

    entry = cache_entries(tiny_cache / "shards")[0]
    damaged = tmp_path / entry.name
    damaged.mkdir()
    for path in entry.iterdir():
        (damaged / path.name).write_bytes(path.read_bytes())
    manifest = json.loads((damaged / "manifest.json").read_text())
    assert open_shards(damaged, {})[0] is not None
    meta = manifest["shards"][0]["files"]["tokens"]
    tokens = np.load(damaged / meta["file"])
    tokens[3] = manifest["vocab_size"] + 7   # what a damaged or crafted entry holds
    np.save(damaged / meta["file"], tokens)
    meta["bytes"] = (damaged / meta["file"]).stat().st_size
    meta["crc32"] = zlib.crc32((damaged / meta["file"]).read_bytes())
    (damaged / "manifest.json").write_text(json.dumps(manifest))
    corpus, problem = open_shards(damaged, {})
    assert corpus is None and f"beyond the vocabulary of {manifest['vocab_size']}" in problem
