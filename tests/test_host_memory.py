"""roformer.host_memory: freed host memory stays in the process, so repeated XLA:CPU
executions stop page-faulting their buffers in; when it applies and when it does not."""
import os
import platform
import subprocess
import sys

import pytest

from roformer import host_memory

from helpers import patient

glibc_only = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt settings are glibc's")

# A child that mallocs and frees 64 MB from a second thread (as XLA's threads do a step's
# buffers), then prints whether the settings were applied and glibc's mallinfo2: bytes in
# mmapped blocks, in the heap, and free in the heap.
CHILD = """
import ctypes, threading
from roformer.host_memory import retain_host_memory
applied = retain_host_memory()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
size = 64 << 20
def use_and_free():
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    libc.free(block)
worker = threading.Thread(target=use_and_free)
worker.start()
worker.join()
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc.mallinfo2.restype = MallInfo2
info = libc.mallinfo2()
print(applied, info.hblkhd, info.arena, info.fordblks)
"""


def _child(choice: str) -> tuple[bool, int, int, int]:
    env = {**os.environ, host_memory.ENV: choice, "JAX_PLATFORMS": "cpu"}
    env.pop("GLIBC_TUNABLES", None)
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True,
                          timeout=patient(60), check=True)
    applied, mmapped, heap, free = done.stdout.split()
    return applied == "True", int(mmapped), int(heap), int(free)


@glibc_only
def test_freed_buffers_stay_in_the_process_heap():
    """Default glibc serves a thread's 64 MB block by mmap and unmaps it on free (the next
    step faults it in again); retained, it comes from the heap and stays there, free for reuse."""
    applied, mmapped, heap, free = _child("0")
    assert not applied
    assert free < 64 << 20 and mmapped < 64 << 20
    applied, mmapped, heap, free = _child("")
    assert applied
    assert mmapped < 64 << 20 <= free <= heap


class FakeLibc:
    """Records mallopt calls instead of changing this test process's malloc."""
    def __init__(self):
        self.calls = []

    def mallopt(self, param, value):
        self.calls.append((param.value, value.value))
        return 1


@glibc_only
def test_applies_only_where_jax_is_cpu_only_unless_forced(monkeypatch):
    libc = FakeLibc()
    monkeypatch.setattr(host_memory.ctypes, "CDLL", lambda name: libc)
    monkeypatch.delenv(host_memory.ENV, raising=False)
    monkeypatch.setenv("JAX_PLATFORMS", "cuda,cpu")
    assert not host_memory.cpu_only()
    assert host_memory.retain_host_memory() is False
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert host_memory.cpu_only()
    monkeypatch.setenv(host_memory.ENV, "0")
    assert host_memory.retain_host_memory() is False
    assert libc.calls == []
    monkeypatch.setenv("JAX_PLATFORMS", "tpu")
    monkeypatch.setenv(host_memory.ENV, "1")
    assert host_memory.retain_host_memory() is True
    # one arena, no mmap, no trimming (glibc's M_ARENA_MAX, M_MMAP_MAX, M_TRIM_THRESHOLD)
    assert libc.calls == [(-8, 1), (-4, 0), (-1, 2**31 - 1)]


def test_an_installed_accelerator_plugin_counts_as_not_cpu_only(monkeypatch):
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setattr(host_memory.importlib.metadata, "entry_points",
                        lambda group: ["xla_cuda12"] if group == "jax_plugins" else [])
    assert not host_memory.cpu_only()
    monkeypatch.setattr(host_memory.importlib.metadata, "entry_points", lambda group: [])
    found = {"libtpu"}
    monkeypatch.setattr(host_memory.importlib.util, "find_spec", lambda name: object() if name in found else None)
    assert not host_memory.cpu_only()
    found.clear()
    assert host_memory.cpu_only()
