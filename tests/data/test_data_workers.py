"""Batch streams made in worker processes (roformer.data.workers): the same batches and
iterator states as the streams' own iterators, resumed streams included; a worker that fails
or dies is an error in the caller, not a hang."""
import os
import signal

import numpy as np
import pytest

from roformer.data import DataConfig, make_pretrain_data
from roformer.data.workers import StreamSpec, WorkerStreams

from helpers.train import make_config

SEQ_LEN, BATCH = 32, 4


@pytest.fixture(scope="module")
def data_cfg(tmp_path_factory):
    return DataConfig.from_mapping(make_config(tmp_path_factory.mktemp("workers_cache")).data)


def iterator(data_cfg, seed, skip=0):
    it = make_pretrain_data(data_cfg, seq_len=SEQ_LEN, batch_size=BATCH, seed=seed, show_progress=False).train_iterator()
    for _ in range(skip):
        next(it)
    return it


def test_worker_streams_give_each_iterators_batches_and_states(data_cfg):
    # Seed 2 continues from a state 5 batches in (a resumed run); 3 streams over 2 workers.
    starts = {0: 0, 1: 0, 2: 5}
    specs = [StreamSpec(data_cfg, SEQ_LEN, BATCH, seed, iterator(data_cfg, seed, skip).get_state())
             for seed, skip in starts.items()]
    streams = WorkerStreams(specs, 2)
    try:
        own = {seed: iterator(data_cfg, seed, skip) for seed, skip in starts.items()}
        for _ in range(6):
            for index in (2, 0, 1) if _ % 2 else (0, 1, 2):   # in any order
                got, want = streams.take(index), next(own[index])
                assert sorted(got) == sorted(want)
                assert all(np.array_equal(got[k], want[k]) for k in want)
                assert streams.state(index) == own[index].get_state()
        for _ in range(3):   # one stream alone (a seed catching up) does not wait on the others
            assert np.array_equal(streams.take(1)["input_ids"], next(own[1])["input_ids"])
    finally:
        streams.close()
    assert all(p.poll() is not None for p in streams._processes)


def test_a_worker_that_fails_or_dies_is_an_error_not_a_hang(data_cfg):
    state = iterator(data_cfg, 0).get_state()
    streams = WorkerStreams([StreamSpec(data_cfg, SEQ_LEN, BATCH, 0, {**state, "stream_id": "another"})], 1)
    try:
        with pytest.raises(RuntimeError, match="failed:(.|\n)*stream_id"):
            streams.take(0)
    finally:
        streams.close()
    streams = WorkerStreams([StreamSpec(data_cfg, SEQ_LEN, BATCH, 0, state)], 1)
    try:
        streams.take(0)
        os.kill(streams._processes[0].pid, signal.SIGKILL)
        streams._processes[0].wait()
        with pytest.raises(RuntimeError, match="exited"):
            for _ in range(5):   # batches made ahead come first
                streams.take(0)
    finally:
        streams.close()
