"""Text sources: embedded corpus, local files (text / WikiExtractor / gzip), HF datasets, TFDS."""
import gzip
import os
import re
import shutil
import sys

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from roformer.data import DataConfig  # noqa: E402
from roformer.data.sources import EmbeddedSource, FilesSource, HFSource, TFDSSource, make_source  # noqa: E402

pytestmark = pytest.mark.fast   # the fast lane (docs/testing.md)


def test_embedded_source_is_real_text_split_into_sections():
    source = make_source(DataConfig(source="embedded"))
    docs = list(source.documents())
    assert len(docs) >= 150
    assert all(doc.strip() == doc and doc for doc in docs)
    assert sum(len(doc.split()) for doc in docs) > 50_000
    assert any(doc.startswith('The "assert" statement') for doc in docs)
    # heading underlines are dropped, the headings themselves kept
    assert not any(re.search(r"^\*{3,}$", doc, re.M) for doc in docs)
    assert docs == list(EmbeddedSource().documents())
    assert source.fingerprint() == EmbeddedSource().fingerprint()


def test_wikiextractor_real_file_skips_stubs_and_tags(shared_data):
    path = shared_data / "wikipedia_en" / "wiki_00"
    docs = list(FilesSource(str(path)).documents())
    raw = path.read_text(encoding="utf-8")
    blocks = re.findall(r"<doc [^>]*>\n(.*?)</doc>", raw, flags=re.S)
    with_body = [b for b in blocks if len([ln for ln in b.splitlines() if ln.strip()]) > 1]
    assert len(blocks) > len(with_body) > 100      # the file has stubs, and they are skipped
    assert len(docs) == len(with_body)
    assert not any("<doc" in d or "</doc>" in d for d in docs)
    # first block is the title-only stub "Marcus Claudius Tacitus"; the title line is dropped
    assert docs[0].startswith("Jarred Shaw (born September 28, 1990)")


def test_plain_text_gzip_and_format_detection(tmp_path):
    (tmp_path / "a.txt").write_text("Doc one line one.\nDoc one line two.\n\n\n  \nDoc two.\n")
    with gzip.open(tmp_path / "b.txt.gz", "wt", encoding="utf-8") as f:
        f.write('<doc id="1" url="u" title="T">\nT\n\nBody of T.\n</doc>\n<doc id="2" url="u" title="S">\nS\n</doc>\n')
    with gzip.open(tmp_path / "c.txt", "wt", encoding="utf-8") as f:  # gzip without the suffix
        f.write("\n\nGzipped plain doc.\n")
    docs = list(FilesSource(str(tmp_path / "*")).documents())
    assert docs == ["Doc one line one.\nDoc one line two.", "Doc two.", "Body of T.", "Gzipped plain doc."]
    forced = list(FilesSource(str(tmp_path / "a.txt"), "wikiextractor").documents())
    assert forced == []
    with pytest.raises(ValueError, match="file_format"):
        FilesSource(str(tmp_path / "a.txt"), "csv")


def test_a_byte_order_mark_does_not_hide_a_wikiextractor_file(tmp_path):
    """Saved with a UTF-8 byte-order mark, a WikiExtractor file is still read as one: its
    markup and titles never become training text."""
    text = '<doc id="1" url="u" title="T">\nT\n\nbody one\n</doc>\n<doc id="2" url="u" title="U">\nU\nbody two\n</doc>\n'
    (tmp_path / "wiki_00").write_bytes(b"\xef\xbb\xbf" + text.encode())
    assert list(FilesSource(str(tmp_path / "wiki_00")).documents()) == ["body one", "body two"]


def test_file_source_errors_name_the_file_or_setting(tmp_path):
    with pytest.raises(ValueError, match=r"glob '.*nothing-\*\.txt' matched no files"):
        FilesSource(str(tmp_path / "nothing-*.txt"))
    with pytest.raises(ValueError, match="data.source='nope'"):
        make_source(DataConfig(source="nope"))
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1\.txt is not valid UTF-8 \(byte 3 of its text"):
        list(FilesSource(str(bad)).documents())
    # Far into a file, plain or gzipped, the offset is the file's, not the decoded chunk's.
    late = ("ok line\n" * 12_500).encode() + b"\xff more\n"
    (tmp_path / "late.txt").write_bytes(late)
    (tmp_path / "late.gz").write_bytes(gzip.compress(late))
    for name in ("late.txt", "late.gz"):
        with pytest.raises(ValueError, match=rf"{name} is not valid UTF-8 \(byte 100,000 of its text"):
            list(FilesSource(str(tmp_path / name)).documents())
    broken = tmp_path / "dangling.txt"
    broken.symlink_to(tmp_path / "missing-target.txt")
    with pytest.raises(ValueError, match=r"cannot read .*dangling\.txt"):
        list(FilesSource(str(broken)).documents())
    packed = gzip.compress("".join(f"line {i} of a gzipped file\n" for i in range(3000)).encode())
    for name, payload in (("corrupt.gz", packed[:20] + packed[20:][::-1]), ("truncated.gz", packed[:len(packed) // 2])):
        (tmp_path / name).write_bytes(payload)
        with pytest.raises(ValueError, match=rf"cannot read .*{name}"):
            list(FilesSource(str(tmp_path / name)).documents())
    with pytest.raises(ValueError, match="data.hf_path is empty"):
        make_source(DataConfig(source="hf"))
    with pytest.raises(ValueError, match="data.tfds_name is empty"):
        make_source(DataConfig(source="tfds"))


def test_hf_datasets_local_text_builder_and_saved_dataset(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("first document\n\nsecond document\n   \nthird one\n")
    source = make_source(DataConfig(source="hf", hf_path="text", hf_data_files=str(corpus), hf_split="train"))
    assert list(source.documents()) == ["first document", "second document", "third one"]
    assert source.describe()["fingerprint"]           # content fingerprint of a non-streaming dataset
    streamed = HFSource("text", split="train", streaming=True, data_files=str(corpus))
    assert list(streamed.documents()) == ["first document", "second document", "third one"]

    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"content": ["alpha beta", "", "gamma"], "id": [1, 2, 3]}).save_to_disk(str(saved))
    assert list(HFSource(str(saved), text_column="content").documents()) == ["alpha beta", "gamma"]
    with pytest.raises(ValueError, match=r"hf_text_column='text'.*\['content', 'id'\]"):
        list(HFSource(str(saved)).documents())


def test_tfds_array_record_dataset_without_tensorflow(tmp_path):
    import tensorflow_datasets as tfds

    class RoformerTinyCorpus(tfds.core.GeneratorBasedBuilder):
        """Five documents, prepared locally in array_record format."""

        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(
                {"text": tfds.features.Text(), "title": tfds.features.Text()}))

        def _split_generators(self, dl_manager):
            return {"train": self._generate_examples(5)}

        texts = "document number {i} caf\u00e9"

        def _generate_examples(self, n):
            for i in range(n):
                yield i, {"text": self.texts.format(i=i), "title": f"t{i}"}

    RoformerTinyCorpus(data_dir=str(tmp_path)).download_and_prepare(file_format="array_record")
    source = TFDSSource("roformer_tiny_corpus", split="train", data_dir=str(tmp_path))
    docs = list(source.documents())
    assert sorted(docs) == [f"document number {i} caf\u00e9" for i in range(5)]
    assert docs == list(source.documents())             # fixed order
    assert source.describe()["num_records"] == 5
    assert "tensorflow" not in sys.modules
    # prepared again with other text, the same version and record count: another source, so
    # its cached tokens are not reused
    before = source.fingerprint()
    RoformerTinyCorpus.texts = "another text {i}"
    shutil.rmtree(tmp_path / "roformer_tiny_corpus")
    RoformerTinyCorpus(data_dir=str(tmp_path)).download_and_prepare(file_format="array_record")
    again = TFDSSource("roformer_tiny_corpus", split="train", data_dir=str(tmp_path))
    assert sorted(again.documents())[0] == "another text 0" and again.describe()["num_records"] == 5
    assert again.fingerprint() != before
    half = TFDSSource("roformer_tiny_corpus", split="train[:40%]", data_dir=str(tmp_path))
    assert len(list(half.documents())) == 2
    with pytest.raises(ValueError, match="tfds_text_key='body'"):
        list(TFDSSource("roformer_tiny_corpus", data_dir=str(tmp_path), text_key="body").documents())
    with pytest.raises(ValueError, match="data.tfds_name='no_such_dataset_xyz'"):
        list(TFDSSource("no_such_dataset_xyz", data_dir=str(tmp_path)).documents())
    # a TFRecord-prepared dataset (what reading it would need TensorFlow for) is refused clearly
    info = tmp_path / "roformer_tiny_corpus" / "1.0.0" / "dataset_info.json"
    info.write_text(info.read_text().replace('"fileFormat": "array_record"', '"fileFormat": "tfrecord"'))
    with pytest.raises(ValueError, match=r"roformer_tiny_corpus.*cannot open as a TFDS array_record"):
        list(TFDSSource("roformer_tiny_corpus", data_dir=str(tmp_path)).documents())


def test_sources_are_reiterable_in_fixed_order(shared_data):
    source = FilesSource(str(shared_data / "wikipedia_en" / "wiki_0[12]"))
    first = list(source.documents())
    assert first == list(source.documents())
    assert len(source.paths) == 2 and source.paths == sorted(source.paths)
    assert np.mean([len(d.split()) for d in first]) > 50


def test_files_source_reports_read_progress(tmp_path):
    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_text("\n\n".join(f"document {i} of {name}" for i in range(2000)))
    source = FilesSource(str(tmp_path / "*.txt"))
    seen = []
    for i, _ in enumerate(source.documents()):
        if i % 500 == 0:
            seen.append(source.progress())
    assert seen[0] < 0.5 < seen[-1] and seen == sorted(seen)
    assert source.progress() == 1.0
