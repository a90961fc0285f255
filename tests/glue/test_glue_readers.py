"""GLUE readers: the real shared files (official counts), written files for the tasks
not in shared data, HF datasets and TFDS sources, and bad input."""
import re

import pytest

from roformer.glue.readers import Example, GlueDataError, read_split
from roformer.glue.tasks import GLUE_TASKS, TASKS, get_task, parse_task_list

pytestmark = pytest.mark.fast   # the fast lane (docs/testing.md)

# Official row counts (shared/data/README.md) plus the test-split sizes of the same files.
OFFICIAL_COUNTS = {
    ("sst2", "train"): 67349, ("sst2", "validation"): 872, ("sst2", "test"): 1821,
    ("cola", "train"): 8551, ("cola", "validation"): 1043, ("cola", "test"): 1063,
    ("mrpc", "train"): 3668, ("mrpc", "validation"): 408, ("mrpc", "test"): 1725,
    ("stsb", "train"): 5749, ("stsb", "validation"): 1500, ("stsb", "test"): 1379,
    ("wnli", "train"): 635, ("wnli", "validation"): 71, ("wnli", "test"): 146,
    ("qnli", "validation"): 5463, ("qnli", "test"): 5463,
    ("ax", "test"): 1104,
}


@pytest.fixture(scope="module")
def glue_dir(shared_data):
    return str(shared_data / "glue")


@pytest.mark.parametrize("task,split", sorted(OFFICIAL_COUNTS))
def test_local_reader_official_counts(glue_dir, task, split):
    examples = read_split(TASKS[task], split, data_dir=glue_dir)
    assert len(examples) == OFFICIAL_COUNTS[(task, split)]
    spec = TASKS[task]
    for e in examples[:50]:
        assert e.text_a.strip()
        assert (e.text_b is None) == (len(spec.hf_text_fields) == 1)
        if split.startswith("test"):
            assert e.label is None
        elif spec.is_regression:
            assert 0.0 <= e.label <= 5.0
        else:
            assert e.label in range(spec.num_labels)
    if split.startswith("test"):  # the submission index column
        assert [e.idx for e in examples] == list(range(len(examples)))


def test_local_reader_known_rows(glue_dir):
    # CoLA has no header: the first line is data (label 1 = acceptable).
    cola = read_split(TASKS["cola"], "train", data_dir=glue_dir)
    assert cola[0] == Example(0, "Our friends won't buy this analysis, let alone the next "
                                 "one we propose.", None, 1)
    # MRPC's header starts with a byte-order mark; quotes are text, not CSV quoting.
    mrpc = read_split(TASKS["mrpc"], "train", data_dir=glue_dir)
    assert mrpc[0].label == 1 and mrpc[0].text_a.startswith("Amrozi accused his brother , whom")
    assert '" the witness "' in mrpc[0].text_a
    stsb = read_split(TASKS["stsb"], "validation", data_dir=glue_dir)
    assert stsb[1] == Example(1, "A young child is riding a horse.", "A child is riding a horse.",
                              4.75)
    qnli = read_split(TASKS["qnli"], "validation", data_dir=glue_dir)
    assert qnli[0].label == TASKS["qnli"].labels.index("entailment")
    assert qnli[1].label == TASKS["qnli"].labels.index("not_entailment")


def _write(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join("\t".join(r) + "\n" for r in rows), encoding="utf-8")


MNLI_TRAIN_HEADER = ["index", "promptID", "pairID", "genre", "sentence1_binary_parse",
                     "sentence2_binary_parse", "sentence1_parse", "sentence2_parse", "sentence1",
                     "sentence2", "label1", "gold_label"]
MNLI_DEV_HEADER = MNLI_TRAIN_HEADER[:-1] + ["label2", "label3", "label4", "label5", "gold_label"]


def _mnli_row(i, a, b, label, dev=False):
    labels = [label] * (5 if dev else 1)
    return [str(i), "1", f"{i}e", "fiction", "(x)", "(y)", "(X)", "(Y)", a, b, *labels, label]


@pytest.fixture
def written_glue(tmp_path):
    """Official-layout files for the tasks the shared data lacks (MNLI, QQP, RTE, QNLI train)."""
    root = tmp_path / "glue"
    _write(root / "MNLI" / "train.tsv", [MNLI_TRAIN_HEADER,
           _mnli_row(0, "A man sleeps.", "A person rests.", "entailment"),
           _mnli_row(1, "It is \"sunny\".", "It rains.", "contradiction"),
           _mnli_row(2, "She left.", "She was sad.", "neutral")])
    for name in ("dev_matched", "dev_mismatched"):
        _write(root / "MNLI" / f"{name}.tsv", [MNLI_DEV_HEADER,
               _mnli_row(0, "Dogs bark.", "Animals make noise.", "entailment", dev=True),
               _mnli_row(1, "Cats sleep.", "Cats run.", "contradiction", dev=True)])
    test_header = MNLI_TRAIN_HEADER[:-2]
    for name in ("test_matched", "test_mismatched"):
        _write(root / "MNLI" / f"{name}.tsv", [test_header,
               _mnli_row(0, "Birds fly.", "Birds move.", "x")[:-2],
               _mnli_row(1, "Fish swim.", "Fish walk.", "x")[:-2]])
    qqp_header = ["id", "qid1", "qid2", "question1", "question2", "is_duplicate"]
    _write(root / "QQP" / "train.tsv", [qqp_header, ["7", "1", "2", "How old?", "What age?", "1"],
                                         ["8", "3", "4", "Why?", "Where?", "0"]])
    _write(root / "QQP" / "dev.tsv", [qqp_header, ["9", "5", "6", "Who?", "Which one?", "0"]])
    _write(root / "QQP" / "test.tsv", [["id", "question1", "question2"], ["0", "A?", "B?"],
                                        ["1", "C?", "D?"]])
    rte_header = ["index", "sentence1", "sentence2", "label"]
    _write(root / "RTE" / "train.tsv", [rte_header, ["0", "A cat sat.", "A cat exists.",
                                                      "entailment"],
                                         ["1", "No dogs.", "Dogs.", "not_entailment"]])
    _write(root / "RTE" / "dev.tsv", [rte_header, ["0", "X.", "Y.", "not_entailment"]])
    _write(root / "RTE" / "test.tsv", [rte_header[:-1], ["0", "P.", "Q."]])
    _write(root / "QNLI" / "train.tsv", [["index", "question", "sentence", "label"],
                                          ["0", "Who?", "Him.", "entailment"]])
    return root


def test_local_reader_written_mnli_qqp_rte(written_glue):
    mnli = TASKS["mnli"]
    train = read_split(mnli, "train", data_dir=written_glue)
    assert [e.label for e in train] == [0, 2, 1]  # entailment, contradiction, neutral
    assert train[1].text_a == 'It is "sunny".'
    assert [e.label for e in read_split(mnli, "validation_mismatched",
                                        data_dir=written_glue)] == [0, 2]
    test_m = read_split(mnli, "test_matched", data_dir=written_glue)
    assert [(e.idx, e.text_b, e.label) for e in test_m] == [(0, "Birds move.", None),
                                                            (1, "Fish walk.", None)]
    qqp = read_split(TASKS["qqp"], "train", data_dir=written_glue)
    assert [(e.text_a, e.text_b, e.label) for e in qqp] == [("How old?", "What age?", 1),
                                                            ("Why?", "Where?", 0)]
    assert [e.idx for e in read_split(TASKS["qqp"], "test", data_dir=written_glue)] == [0, 1]
    rte = read_split(TASKS["rte"], "train", data_dir=written_glue)
    assert [e.label for e in rte] == [0, 1]
    assert read_split(TASKS["qnli"], "train", data_dir=written_glue)[0].label == 0


@pytest.mark.parametrize("row,message", [
    (["1", "A cat.", "entailment"], r"train\.tsv:3: expected 4 tab-separated columns, got 3"),
    (["1", "A cat.", "A dog.", "maybe"], r"train\.tsv:3: RTE label 'maybe' is not one of"),
])
def test_malformed_row_names_file_and_line(written_glue, row, message):
    path = written_glue / "RTE" / "train.tsv"
    path.write_text(path.read_text().splitlines(keepends=True)[0]
                    + "0\tA.\tB.\tentailment\n" + "\t".join(row) + "\n")
    with pytest.raises(GlueDataError, match=message):
        read_split(TASKS["rte"], "train", data_dir=written_glue)


def test_non_numeric_stsb_score_names_file_and_line(tmp_path):
    header = ["index", "genre", "filename", "year", "old_index", "source1", "source2",
              "sentence1", "sentence2", "score"]
    _write(tmp_path / "STS-B" / "train.tsv", [header, ["0", "g", "f", "y", "0", "n", "n", "A.",
                                                       "B.", "4.2"],
                                              ["1", "g", "f", "y", "1", "n", "n", "C.", "D.",
                                               "high"]])
    with pytest.raises(GlueDataError, match=r"STS-B[/\\]train\.tsv:3: STS-B score 'high' is not"):
        read_split(TASKS["stsb"], "train", data_dir=tmp_path)


def test_bytes_that_are_not_utf8_name_file_line_and_byte(written_glue):
    path = written_glue / "RTE" / "train.tsv"
    header = path.read_text().splitlines(keepends=True)[0]
    path.write_bytes(header.encode() + b"0\tA.\tB.\tentailment\n1\tCaf\xe9 au lait.\tB.\tentailment\n")
    with pytest.raises(GlueDataError) as error:
        read_split(TASKS["rte"], "train", data_dir=written_glue)
    assert str(error.value).startswith(f"{path}:3: byte 0xe9 at column 6 is not UTF-8 text")


def test_missing_split_names_exact_file(glue_dir):
    expected = f"{glue_dir}/QNLI/train.tsv"
    with pytest.raises(GlueDataError, match=f"no file {re.escape(expected)}$"):
        read_split(TASKS["qnli"], "train", data_dir=glue_dir)


def test_task_names_and_lists():
    assert get_task("SST-2").name == "sst2" and get_task("STS-B").name == "stsb"
    assert parse_task_list("all") == list(GLUE_TASKS)
    assert parse_task_list("mrpc, CoLA,mrpc") == ["mrpc", "cola"]
    with pytest.raises(ValueError, match="unknown GLUE task 'sst3'; did you mean 'sst2'"):
        parse_task_list("sst2,sst3")
    with pytest.raises(ValueError, match="unknown GLUE task 'mrcp'; did you mean 'mrpc'"):
        get_task("mrcp")
    with pytest.raises(ValueError, match=r"unknown GLUE task 'xyzzy'; choose from"):   # nothing close
        get_task("xyzzy")


def test_hf_datasets_reader(tmp_path):
    """A local copy of the `nyu-mll/glue` hub layout (parquet per config + README configs):
    the reader's own `load_dataset` call runs unchanged, only the path differs."""
    import datasets

    root = tmp_path / "glue_hub"
    rows = {"premise": ["A man sleeps.", "Cats run."], "hypothesis": ["He rests.", "Cats sit."],
            "label": [0, 2], "idx": [0, 1]}
    (root / "mnli").mkdir(parents=True)
    datasets.Dataset.from_dict(rows).to_parquet(root / "mnli" / "train-00000-of-00001.parquet")
    datasets.Dataset.from_dict({**rows, "label": [-1, -1]}).to_parquet(
        root / "mnli" / "test_matched-00000-of-00001.parquet")
    (root / "README.md").write_text("---\nconfigs:\n- config_name: mnli\n  data_files:\n"
                                    "  - split: train\n    path: mnli/train-*\n"
                                    "  - split: test_matched\n    path: mnli/test_matched-*\n---\n")
    kwargs = dict(source="hf", hf_path=str(root), hf_cache_dir=str(tmp_path / "cache"))
    train = read_split(TASKS["mnli"], "train", **kwargs)
    assert train == [Example(0, "A man sleeps.", "He rests.", 0),
                     Example(1, "Cats run.", "Cats sit.", 2)]
    test = read_split(TASKS["mnli"], "test_matched", **kwargs)
    assert [e.label for e in test] == [None, None]
    with pytest.raises(GlueDataError, match="cannot load split 'validation_matched'"):
        read_split(TASKS["mnli"], "validation_matched", **kwargs)


def test_tfds_reader_and_builder_schema():
    """The registry matches TFDS's glue builder (feature names, ClassLabel order), and the
    reader decodes what `tfds.data_source('glue/<task>')` returns (mocked: no network)."""
    import tensorflow_datasets as tfds
    import tensorflow_datasets.text.glue  # noqa: F401

    for task in TASKS.values():
        features = tfds.builder(task.tfds_name).info.features
        assert set(task.hf_text_fields) | {"label", "idx"} == set(features.keys()), task.name
        if task.labels and task.labels[0] != "0":
            assert tuple(features["label"].names) == task.labels, task.name

    rows = [{"sentence1": b"A cat sat.", "sentence2": b"A cat.", "label": 1, "idx": 4},
            {"sentence1": b"Dogs.", "sentence2": b"No dogs.", "label": -1, "idx": 5}]
    calls = []

    def fake_source(builder, split, **_):
        calls.append((builder.name, builder.builder_config.name, split))
        return rows

    with tfds.testing.mock_data(as_data_source_fn=fake_source):
        examples = read_split(TASKS["rte"], "validation", source="tfds")
    assert calls == [("glue", "rte", "validation")]
    assert examples == [Example(4, "A cat sat.", "A cat.", 1),
                        Example(5, "Dogs.", "No dogs.", None)]


def test_submission_files_cover_registry():
    from roformer.glue.submission import SUBMISSION_FILES

    files = sorted(f for t in TASKS.values() for f in t.test_splits.values())
    assert files == sorted(SUBMISSION_FILES)
