"""Training batches made ahead in worker processes, for a process that takes many batch
streams per step (vmapped seeds: roformer.train.seeds).

Making one MLM batch (packing rows, masking) is a fraction of a millisecond of Python and
numpy, which one stream's train step hides; K seeds stacked in one step need K of them per
step from one thread, which can take longer than the step on an accelerator. Here each
stream is the `BatchIterator` the caller would have used (the same batches in the same
order), held by one of `workers` processes (`python -m roformer.data.workers`, so a caller's
script needs no `__main__` guard), which makes the batches the caller asks for, `ahead` per
stream in flight, and sends them back pickled over its stdout. `state(i)` is stream i's
iterator state after the last batch taken, so a checkpoint saves what the iterator itself
would have said. A worker ends when its stdin closes (the caller closed it, or died).
"""
from __future__ import annotations

import collections
import fcntl
import os
import pickle
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from roformer.data.config import DataConfig

PIPE_BYTES = 1 << 20   # a worker's stdout pipe (Linux F_SETPIPE_SZ): room for batches made ahead
_F_SETPIPE_SZ = 1031


@dataclass(frozen=True)
class StreamSpec:
    """What rebuilds a stream in a worker: make_pretrain_data's arguments and the iterator
    state to continue from (`BatchIterator.get_state()` of the caller's iterator)."""
    data: DataConfig
    seq_len: int
    batch_size: int
    seed: int
    state: dict


class WorkerStreams:
    """Streams made in `workers` processes (stream i in worker i % workers); `take(i)` is
    `next()` of stream i."""

    def __init__(self, specs: list[StreamSpec], workers: int, *, ahead: int = 2):
        if workers < 1:
            raise ValueError(f"workers={workers}: at least one")
        self._ahead = ahead
        self._owner = [i % workers for i in range(len(specs))]
        package_root = str(Path(__file__).resolve().parents[2])   # this roformer, installed or not
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
        self._processes = []
        try:
            for w in range(workers):
                process = subprocess.Popen([sys.executable, "-m", "roformer.data.workers"], stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE, env=env)
                try:
                    fcntl.fcntl(process.stdout.fileno(), _F_SETPIPE_SZ, PIPE_BYTES)
                except OSError:   # not Linux, or above the system's limit: the default pipe
                    pass
                self._processes.append(process)
                self._send(w, {i: spec for i, spec in enumerate(specs) if self._owner[i] == w})
        except BaseException:
            self.close()
            raise
        self._ready = {i: collections.deque() for i in range(len(specs))}   # (batch, state) arrived
        self._asked = [0] * len(specs)                                      # requested, not yet arrived
        self._state = [spec.state for spec in specs]

    def take(self, index: int) -> dict:
        self._top_up(index)
        while not self._ready[index]:
            got, batch, state = self._receive(self._owner[index])
            self._ready[got].append((batch, state))
            self._asked[got] -= 1
        batch, self._state[index] = self._ready[index].popleft()
        self._top_up(index)
        return batch

    def state(self, index: int) -> dict:
        return self._state[index]

    def _top_up(self, index: int) -> None:
        for _ in range(self._ahead - self._asked[index] - len(self._ready[index])):
            self._send(self._owner[index], index)
            self._asked[index] += 1

    def _send(self, worker: int, message) -> None:
        process = self._processes[worker]
        try:
            pickle.dump(message, process.stdin)
            process.stdin.flush()
        except BrokenPipeError:
            self._receive(worker)   # a failed worker's traceback, if it left one
            raise RuntimeError(f"batch worker {worker} exited with status {process.wait()}") from None

    def _receive(self, worker: int):
        process = self._processes[worker]
        try:
            got = pickle.load(process.stdout)
        except EOFError:
            raise RuntimeError(f"batch worker {worker} exited with status {process.wait()}") from None
        if got[0] is None:
            raise RuntimeError(f"batch worker {worker} failed:\n{got[1]}")
        return got

    def close(self) -> None:
        """End the workers. They hold no state, and batches made ahead are dropped: closing both
        pipes ends a worker that waits for a request or is writing a batch nobody will read."""
        for process in self._processes:
            for pipe in (process.stdin, process.stdout):
                try:
                    pipe.close()
                except OSError:
                    pass
        for process in self._processes:
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _work() -> None:
    """A worker: read its streams, then make a batch of stream i for every i read, until
    stdin ends. SIGTERM and SIGINT are the caller's to handle (it saves a checkpoint, then
    closes the workers)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Results go to the pipe the caller reads; anything a library prints goes to stderr.
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    requests = sys.stdin.buffer
    try:
        from roformer.data.pipeline import make_pretrain_data

        streams = {}
        for index, spec in pickle.load(requests).items():
            data = make_pretrain_data(spec.data, seq_len=spec.seq_len, batch_size=spec.batch_size, seed=spec.seed,
                                      show_progress=False)
            streams[index] = data.train_iterator()
            streams[index].set_state(spec.state)
        while True:
            try:
                index = pickle.load(requests)
            except EOFError:
                return
            batch = next(streams[index])
            pickle.dump((index, batch, streams[index].get_state()), out, protocol=pickle.HIGHEST_PROTOCOL)
            out.flush()
    except BrokenPipeError:
        return   # the caller is gone
    except BaseException:  # noqa: BLE001 - the caller raises it, with this traceback
        import traceback

        pickle.dump((None, traceback.format_exc(), None), out)
        out.flush()


if __name__ == "__main__":
    _work()
