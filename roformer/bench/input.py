"""input: tokenization and masked-batch production speed of the pretraining input pipeline.

Measures, on the shared Wikipedia files by default:
  raw encode     the Rust batch encoder alone on the documents held in memory, in the
                 same chunks the shard builder hands it
  shards build   the cached tokenization (read + parse + encode + write + checksum), fresh cache
  batches        packed, masked batches from the shards (packing + gather + MLM masking),
                 for each --seq-len, median over --rounds
  prepare        the shard build split over --processes new local processes (fresh cache,
                 start-up included), each with its share of the cores
  streams        one batch of each of --streams streams per step (vmapped seeds), the
                 caller's time: made in the calling process, or taken from --stream-workers
                 worker processes (roformer.data.workers), back to back and with a pause of
                 --stream-pause seconds before each step (a train step's time, in which the
                 workers make the next batches ahead)
"""
from __future__ import annotations

import dataclasses
import os
import resource
import statistics
import tempfile
import time
from types import SimpleNamespace

from roformer import cli
from roformer.config_files import shared_data
from roformer.data import DataConfig, make_pretrain_data
from roformer.data.prepare import prepare_locally
from roformer.data.shard_build import load_or_build
from roformer.data.shards import chunk_documents
from roformer.data.sources import FilesSource
from roformer.data.tokenizer import load_tokenizer
from roformer.data.workers import StreamSpec, WorkerStreams



def define_flags(command: cli.CommandFlags) -> None:
    SHARED_DATA = shared_data()
    command.define("--files", default=str(SHARED_DATA / "wikipedia_en" / "wiki_*"),
                   help="glob of text / WikiExtractor files to tokenize")
    command.define("--vocab", default=str(SHARED_DATA / "vocab" / "bert-base-uncased-vocab.txt"))
    command.define("--seq-len", type=int, many=True, default=[128, 512])
    command.define("--batch-size", type=int, default=64)
    command.define("--batches", type=int, default=100, help="batches per timing round")
    command.define("--rounds", type=int, default=5)
    command.define("--packing", choices=["packed", "document"], default="packed")
    command.define("--whole-word", type=bool, help="whole-word masking")
    command.define("--num-workers", type=int, default=0, help="tokenizer threads (0 = all cores)")
    command.define("--processes", type=int, many=True, default=[1, 2],
                   help="local process counts to build the shards with (prepare rows)")
    command.define("--streams", type=int, default=16, help="batch streams for the streams rows (0: none)")
    command.define("--stream-workers", type=int, many=True, default=[2], help="worker processes for the streams rows")
    command.define("--stream-pause", type=float, default=0.02, help="seconds before each step, made-ahead rows")


def run(args: SimpleNamespace) -> dict:
    tokenizer = load_tokenizer(args.vocab)
    source = FilesSource(args.files)
    rows = []
    load_before = os.getloadavg()[0]

    start = time.perf_counter()
    docs = list(source.documents())
    read_seconds = time.perf_counter() - start
    chunks = list(chunk_documents(iter(docs)))
    start, cpu = time.perf_counter(), time.process_time()
    num_tokens = sum(len(ids) for chunk in chunks for ids in tokenizer.encode_ids(chunk))
    encode_seconds, encode_cpu = time.perf_counter() - start, time.process_time() - cpu
    chars = sum(map(len, docs))
    del docs, chunks
    rows.append(_row("raw encode (Rust batch, in memory)", "", num_tokens, encode_seconds, encode_cpu))

    with tempfile.TemporaryDirectory(prefix="roformer-bench-input-") as cache:
        start, cpu = time.perf_counter(), time.process_time()
        corpus = load_or_build(source, tokenizer, cache, num_workers=args.num_workers, show_progress=False)
        build_seconds, build_cpu = time.perf_counter() - start, time.process_time() - cpu
        rows.append(_row("shards build (read+encode+write)", f"{len(source.paths)} files",
                         corpus.num_tokens, build_seconds, build_cpu))
        start = time.perf_counter()
        load_or_build(source, tokenizer, cache, show_progress=False)
        reuse_seconds = time.perf_counter() - start

        cfg = DataConfig(source="files", files=args.files, vocab=args.vocab, cache_dir=cache, packing=args.packing,
                         whole_word_masking=args.whole_word, num_workers=args.num_workers)
        for seq_len in args.seq_len:
            data = make_pretrain_data(cfg, seq_len=seq_len, batch_size=args.batch_size, seed=0,
                                      show_progress=False)
            iterator = data.train_iterator()
            next(iterator)                      # builds the epoch plan outside the timing
            times, cpus, real = [], [], []
            for _ in range(args.rounds):
                start, cpu = time.perf_counter(), time.process_time()
                batches = [next(iterator) for _ in range(args.batches)]
                times.append(time.perf_counter() - start)
                cpus.append(time.process_time() - cpu)
                real.append(sum(float((b["segment_ids"] > 0).mean()) for b in batches) / len(batches))
            tokens = args.batches * args.batch_size * seq_len
            label = f"L={seq_len} B={args.batch_size} {args.packing}" + (" wwm" if args.whole_word else "")
            row = _row("masked batches from shards", label, tokens, statistics.median(times),
                       statistics.median(cpus))
            row["non_pad_fraction"] = round(statistics.mean(real), 4)
            start = time.perf_counter()
            data.epoch_plan(1)
            row["epoch_plan_s"] = round(time.perf_counter() - start, 3)
            rows.append(row)
        if args.streams:
            rows += _stream_rows(cfg, args)

    for processes in args.processes:
        with tempfile.TemporaryDirectory(prefix="roformer-bench-input-") as cache:
            children = resource.getrusage(resource.RUSAGE_CHILDREN)
            done = prepare_locally(dataclasses.replace(cfg, cache_dir=cache), processes, show_progress=False)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = after.ru_utime + after.ru_stime - children.ru_utime - children.ru_stime
        rows.append(_row("prepare (spawned processes)", f"{processes} x {done['threads_per_process']} threads",
                         done["tokens"], done["seconds"], cpu))

    # The development machine is shared: the load average says how contended the cores were,
    # and tokens per CPU-second is the load-independent cost of each stage.
    return {"rows": rows, "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
            "corpus": {"files": len(source.paths), "documents": corpus.num_docs,
                                     "tokens": corpus.num_tokens, "chars": chars,
                                     "read_parse_s": round(read_seconds, 3), "cache_reuse_s": round(reuse_seconds, 3)}}


def _stream_rows(cfg: DataConfig, args: SimpleNamespace) -> list[dict]:
    """The caller's time for one batch of each of `args.streams` streams per step, at the
    first --seq-len: made in this process, and taken from worker processes."""
    seq_len, count = args.seq_len[0], args.streams
    iterators = [make_pretrain_data(cfg, seq_len=seq_len, batch_size=args.batch_size, seed=seed,
                                    show_progress=False).train_iterator() for seed in range(count)]
    for iterator in iterators:
        next(iterator)   # the epoch plan, outside the timing
    steps = max(1, args.batches // count)
    tokens = steps * count * args.batch_size * seq_len
    label = f"{count} streams L={seq_len} B={args.batch_size}"

    def timed(take, pause: float) -> tuple[float, float]:
        seconds, cpus = [], []
        for _ in range(args.rounds):
            spent, cpu = 0.0, time.process_time()
            for _ in range(steps):
                time.sleep(pause)
                start = time.perf_counter()
                for index in range(count):
                    take(index)
                spent += time.perf_counter() - start
            seconds.append(spent)
            cpus.append(time.process_time() - cpu)
        return statistics.median(seconds), statistics.median(cpus)

    rows = [_row("stream batches, caller's time", f"{label}, in process", tokens,
                 *timed(lambda i: next(iterators[i]), 0.0))]
    for workers in args.stream_workers:
        streams = WorkerStreams([StreamSpec(cfg, seq_len, args.batch_size, seed, iterators[seed].get_state())
                                 for seed in range(count)], workers)
        try:
            for index in range(count):
                streams.take(index)   # the workers' start and data, outside the timing
            rows.append(_row("stream batches, caller's time", f"{label}, {workers} workers back to back", tokens,
                             *timed(streams.take, 0.0)))
            rows.append(_row("stream batches, caller's time",
                             f"{label}, {workers} workers, made ahead ({args.stream_pause:g} s pause)", tokens,
                             *timed(streams.take, args.stream_pause)))
        finally:
            streams.close()
    return rows


def _row(stage: str, setting: str, tokens: int, seconds: float, cpu_seconds: float) -> dict:
    return {"stage": stage, "setting": setting, "tokens": tokens, "seconds": round(seconds, 3),
            "M_tokens_per_s": round(tokens / seconds / 1e6, 3),
            "M_tokens_per_cpu_s": round(tokens / max(cpu_seconds, 1e-9) / 1e6, 3),
            "non_pad_fraction": None, "epoch_plan_s": None}
