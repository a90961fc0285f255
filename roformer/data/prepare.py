"""Building the token cache ahead of training, in this process or in several local ones."""
from __future__ import annotations

import dataclasses
import json
import logging
import multiprocessing
import os
import time

from roformer.data.config import DataConfig
from roformer.data.pipeline import prepare_corpus
from roformer.machine import cores_available


def prepare(data: DataConfig, *, process_index: int = 0, process_count: int = 1,
            show_progress: bool = True) -> dict:
    """Puts data's tokenizer and token shards into the cache (as process `process_index` of a
    job of `process_count` sharing it) and says what the cache entry holds."""
    start = time.perf_counter()
    tokenizer, corpus = prepare_corpus(data, process_index=process_index, process_count=process_count,
                                       show_progress=show_progress)
    build = corpus.directory / "build.json"
    return {"process_index": process_index, "process_count": process_count, "shards": str(corpus.directory),
            "content_id": corpus.content_id, "documents": corpus.num_docs, "tokens": corpus.num_tokens,
            "vocab_size": tokenizer.vocab_size, "seconds": round(time.perf_counter() - start, 3),
            "build": json.loads(build.read_text()) if build.is_file() else None}


def prepare_locally(data: DataConfig, processes: int, *, host_index: int = 0, host_count: int = 1,
                    show_progress: bool = True) -> dict:
    """`prepare` split over `processes` new local processes, each with its share of the cores
    (data.num_workers threads in all, 0 = every core); on host `host_index` of `host_count`
    running the same, they are processes host_index * processes + i of host_count * processes.
    `seconds` is the wall-clock time of the whole, process start-up included."""
    start = time.perf_counter()
    threads = max(1, (data.num_workers or cores_available()) // processes)
    count = host_count * processes
    indices = [host_index * processes + i for i in range(processes)]
    # spawn, not fork: the caller may hold threads (JAX, the Rust encoder's pool)
    context = multiprocessing.get_context("spawn")
    children = [context.Process(target=_prepare_share, args=(data, index, count, threads, show_progress and i == 0),
                                name=f"process {index} of {count}") for i, index in enumerate(indices)]
    for child in children:
        child.start()
    try:
        # a failed process fails the whole at once (the others would wait for its share)
        while not all(child.exitcode == 0 for child in children):
            failed = [child for child in children if child.exitcode not in (None, 0)]
            if failed:
                raise RuntimeError(f"{failed[0].name} failed (exit code {failed[0].exitcode}); see its log above")
            time.sleep(0.1)
    finally:
        for child in children:
            if child.is_alive():
                child.terminate()
            child.join()
    seconds = time.perf_counter() - start
    summary = prepare(data, show_progress=False)
    return {**summary, "process_index": indices[0], "process_count": count, "threads_per_process": threads,
            "seconds": round(seconds, 3)}


def _prepare_share(data: DataConfig, process_index: int, process_count: int, threads: int,
                   show_progress: bool) -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s process {process_index}: %(message)s")
    os.environ["RAYON_NUM_THREADS"] = str(threads)   # the Rust encoder's own pool, read on first use
    prepare(dataclasses.replace(data, num_workers=threads), process_index=process_index,
            process_count=process_count, show_progress=show_progress)
