"""Shard builds split over the processes of a job: each tokenizes its share, the result is
byte for byte the single-process build; waits name a missing share; resumable; `prepare`."""
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from roformer.data import shard_build, shards
from roformer.data.sources import FilesSource
from roformer.data.tokenizer import WordPieceTokenizer

from helpers import cache_entries, patient

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tokenizer(shared_data):
    return WordPieceTokenizer.from_vocab_file(shared_data / "vocab" / "bert-base-uncased-vocab.txt")


@pytest.fixture
def wiki(shared_data):
    return str(shared_data / "wikipedia_en" / "wiki_0[0-3]")


@pytest.fixture
def encoded_by(monkeypatch):
    """The files each process (here: thread) tokenized."""
    calls: dict[str, list[str]] = {}
    real = shard_build.encode_parts

    def counting(parts, *args, **kwargs):
        calls.setdefault(threading.current_thread().name, []).extend(
            os.path.basename(part.paths[0]) for part, _ in parts)
        return real(parts, *args, **kwargs)

    monkeypatch.setattr(shard_build, "encode_parts", counting)
    return calls


def entry_files(directory: Path) -> dict[str, bytes]:
    """Every file of a cache entry but the build timings."""
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.name != "build.json"}


def build_together(pattern, tokenizer, caches, **kwargs):
    """load_or_build by len(caches) concurrent 'processes' (threads p0, p1, ...), process i using caches[i]."""
    results, errors = {}, {}

    def run(i):
        try:
            results[i] = shard_build.load_or_build(FilesSource(pattern), tokenizer, caches[i], process_index=i,
                                              process_count=len(caches), num_workers=1, show_progress=False,
                                              **kwargs)
        except Exception as err:  # noqa: BLE001 - handed to the test
            errors[i] = err

    threads = [threading.Thread(target=run, args=(i,), name=f"p{i}") for i in range(len(caches))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise next(iter(errors.values()))
    return [results[i] for i in range(len(caches))]


@pytest.mark.parametrize("processes", [2, 3])
def test_processes_tokenize_their_share_into_the_single_process_shards(wiki, tokenizer, tmp_path, monkeypatch,
                                                                       encoded_by, processes):
    monkeypatch.setattr(shards, "CHUNK_CHARS", 1 << 14)            # many chunks and shards per file
    alone = shard_build.load_or_build(FilesSource(wiki), tokenizer, tmp_path / "alone", shard_tokens=20_000,
                                 show_progress=False)
    assert len(alone.manifest["shards"]) > 4
    encoded_by.clear()
    together = build_together(wiki, tokenizer, [tmp_path / "shared"] * processes, shard_tokens=20_000)

    assert {c.directory for c in together} == {together[0].directory}
    assert together[0].directory.name == alone.directory.name         # same cache key
    assert together[0].content_id == alone.content_id
    assert entry_files(together[0].directory) == entry_files(alone.directory)   # manifest and shards
    sizes = [size for _, size in FilesSource(wiki).parts()]
    owners = shard_build.assign_parts(sizes, processes)
    names = [os.path.basename(p) for p in FilesSource(wiki).paths]
    for i in range(processes):
        share = sorted(names[j] for j, owner in enumerate(owners) if owner == i)
        assert sorted(encoded_by.get(f"p{i}", [])) == share            # each tokenized its share only
    build = json.loads((together[0].directory / "build.json").read_text())
    assert build["processes"] == processes
    assert {s["process"]: s["parts"] for s in build["shares"]} == {
        i: [j for j, owner in enumerate(owners) if owner == i] for i in set(owners)}
    assert [p.name for p in cache_entries(tmp_path / "shared" / "shards")] == [alone.directory.name]  # parts gone


def test_assignment_balances_sizes_and_is_deterministic():
    assert shard_build.assign_parts([5, 1, 1, 1, 1, 1], 2) == [0, 1, 1, 1, 1, 1]
    assert shard_build.assign_parts([1, 1, 1], 5) == [0, 1, 2]
    assert shard_build.assign_parts([3], 4) == [0]


def test_a_missing_share_is_named_and_the_build_resumes_from_the_parts_written(wiki, tokenizer, tmp_path,
                                                                                encoded_by):
    cache = tmp_path / "cache"
    source = FilesSource(wiki)
    owners = shard_build.assign_parts([size for _, size in source.parts()], 2)
    one = [os.path.basename(p) for p, owner in zip(source.paths, owners) if owner == 1]
    directory_name = f"files-{shards.cache_key(source.fingerprint(), tokenizer.hash)}"
    parts_dir = cache / "shards" / f".{directory_name}.parts"
    parts_dir.mkdir(parents=True)
    (parts_dir / "process_0_of_2").touch()          # process 0 was here, but stopped

    with pytest.raises(TimeoutError, match=r"process 0's share \(2 of its 2 parts: wiki_0"):
        shard_build.load_or_build(source, tokenizer, cache, process_index=1, process_count=2, num_workers=1,
                             wait_seconds=0.5, show_progress=False)
    assert sorted(encoded_by.pop("MainThread")) == sorted(one)
    # process 0 comes back alone: it tokenizes its own share only and finishes the entry
    corpus = shard_build.load_or_build(FilesSource(wiki), tokenizer, cache, process_index=0, process_count=2,
                                  num_workers=1, wait_seconds=0.5, show_progress=False)
    assert sorted(encoded_by.pop("MainThread")) == sorted(set(map(os.path.basename, source.paths)) - set(one))
    alone = shard_build.load_or_build(FilesSource(wiki), tokenizer, tmp_path / "alone", show_progress=False)
    assert entry_files(corpus.directory) == entry_files(alone.directory)
    assert not parts_dir.exists()


def test_processes_with_private_caches_each_build_alone(wiki, tokenizer, tmp_path, encoded_by, caplog):
    with caplog.at_level(logging.WARNING):
        first, second = build_together(wiki, tokenizer, [tmp_path / "host0", tmp_path / "host1"],
                                       handshake_seconds=0.3)
    assert "seems private to each host" in caplog.text
    assert sorted(encoded_by["p0"]) == sorted(encoded_by["p1"]) == ["wiki_00", "wiki_01", "wiki_02", "wiki_03"]
    assert entry_files(first.directory) == entry_files(second.directory)
    assert not (tmp_path / "host0" / "shards" / f".{first.directory.name}.parts").exists()


def test_a_single_part_source_is_built_by_process_0(tokenizer, tmp_path, shared_data, encoded_by):
    wiki = str(shared_data / "wikipedia_en" / "wiki_05")
    first, second = build_together(wiki, tokenizer, [tmp_path / "cache"] * 2)
    assert list(encoded_by) == ["p0"] and first.content_id == second.content_id


def test_prepare_command_on_two_processes(wiki, tokenizer, tmp_path, shared_data):
    """Two processes of `python -m roformer.data prepare`, as on two hosts sharing a cache."""
    cache = tmp_path / "cache"
    command = [sys.executable, "-m", "roformer.data", "prepare", "--config=configs/base.py",
               "--config.data.source=files", f"--config.data.files={wiki}",
               f"--config.data.vocab={shared_data / 'vocab' / 'bert-base-uncased-vocab.txt'}",
               f"--config.data.cache_dir={cache}",
               "--config.data.num_workers=1", "--process_count=2"]
    procs = [subprocess.Popen([*command, f"--process_index={i}"], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    outputs = [proc.communicate(timeout=patient(300)) for proc in procs]
    for proc, (_out, err) in zip(procs, outputs):
        assert proc.returncode == 0, err[-3000:]
    summaries = [json.loads(out.strip().splitlines()[-2]) for out, _ in outputs]   # the JSON, then one line
    for (out, _), summary in zip(outputs, summaries):
        assert out.strip().splitlines()[-1] == (f"done: {summary['documents']:,} documents, "
                                                f"{summary['tokens']:,} tokens in the cache entry {summary['shards']}")
    assert [s["process_index"] for s in summaries] == [0, 1]
    assert summaries[0]["content_id"] == summaries[1]["content_id"]
    shares = {s["process"]: len(s["parts"]) for s in summaries[0]["build"]["shares"]}
    assert shares == {0: 2, 1: 2}
    for i, (_, err) in enumerate(outputs):
        assert f"process {i} of 2 tokenized 2 of the 4 parts" in err
    alone = shard_build.load_or_build(FilesSource(wiki), tokenizer, tmp_path / "alone", show_progress=False)
    assert summaries[0]["content_id"] == alone.content_id
    assert entry_files(Path(summaries[0]["shards"])) == entry_files(alone.directory)


# A run that builds its cache entries (a trained tokenizer, then the token shards), recording
# each build in a marker file and holding it for a while (train_hold, encode_hold seconds), so
# another run starts meanwhile.
RUN = """
import logging, os, sys, time
from pathlib import Path
from roformer.data import DataConfig, pipeline, shard_build
from roformer.data.tokenizer import WordPieceTokenizer

files, vocab, cache, marks, train_hold, encode_hold = sys.argv[1:7]
logging.basicConfig(level=logging.INFO)

def marked(kind, real, hold):
    def run(*args, **kwargs):
        Path(marks, f"{kind}-{os.getpid()}").touch()
        time.sleep(float(hold))
        return real(*args, **kwargs)
    return run

shard_build.encode_parts = marked("encode", shard_build.encode_parts, encode_hold)
WordPieceTokenizer.train = marked("train", WordPieceTokenizer.train, train_hold)
data = DataConfig(source="files", files=files, vocab=vocab, vocab_size=500, cache_dir=cache, num_workers=1)
tokenizer, corpus = pipeline.prepare_corpus(data, show_progress=False)
print(tokenizer.hash, corpus.content_id)
"""


def start_run(files, cache, marks, train_hold=0, encode_hold=0, vocab=""):
    args = (files, vocab, cache, marks, train_hold, encode_hold)
    return subprocess.Popen([sys.executable, "-c", RUN, *map(str, args)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_marker(marks: Path, name: str, proc, timeout=120.0):
    deadline = time.monotonic() + patient(timeout)
    while not (marks / f"{name}-{proc.pid}").exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"the first run never started its {name} build"
        time.sleep(0.05)


def finish(proc, timeout=300):
    out, err = proc.communicate(timeout=patient(timeout))
    assert proc.returncode == 0, err[-3000:]
    return out.split(), err


@pytest.fixture
def small_corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(f"document {i}: rotary position embedding rotates query and key pairs "
                                  f"by angles proportional to position {i}." for i in range(200)) + "\n")
    return path


@pytest.mark.parametrize("given_vocab", [False, True])
def test_two_runs_sharing_a_fresh_cache_build_each_entry_once(small_corpus, tmp_path, shared_data, given_vocab):
    """The second run waits for the first one's lock and reads what it built (the vocabulary
    and the token shards), instead of training and tokenizing the same corpus again."""
    cache, marks = tmp_path / "cache", tmp_path / "marks"
    marks.mkdir()
    vocab = str(shared_data / "vocab" / "bert-base-uncased-vocab.txt") if given_vocab else ""
    first = start_run(small_corpus, cache, marks, train_hold=5, encode_hold=5, vocab=vocab)
    wait_for_marker(marks, "encode" if given_vocab else "train", first)
    second = start_run(small_corpus, cache, marks, vocab=vocab)
    (first_ids, _), (second_ids, second_log) = finish(first), finish(second)
    assert second_ids == first_ids       # the same vocabulary and token content
    built = sorted(p.name.split("-")[0] for p in marks.iterdir())
    # each entry built once, by one of the runs
    assert built == (["encode"] if given_vocab else ["encode", "train"]), built
    assert f"pid {first.pid}; waiting for it" in second_log


@pytest.mark.parametrize("stage", ["train", "encode"])
def test_a_killed_builder_does_not_block_the_next_run(small_corpus, tmp_path, stage):
    cache, marks = tmp_path / "cache", tmp_path / "marks"
    marks.mkdir()
    first = start_run(small_corpus, cache, marks, train_hold=600 if stage == "train" else 0, encode_hold=600)
    wait_for_marker(marks, stage, first)
    first.kill()
    first.communicate()
    second = start_run(small_corpus, cache, marks)
    finish(second, timeout=120)
    assert (marks / f"{stage}-{second.pid}").exists()
