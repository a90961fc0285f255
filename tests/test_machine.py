"""roformer.machine: the cores this process may use, the processor's name, the matmul peak."""
import os

import pytest

from roformer import machine
from roformer.machine import cpu_identity, describe_cpu

pytestmark = pytest.mark.fast   # the fast lane (docs/testing.md)

X86_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx fma avx2 sha_ni vaes

processor\t: 1
model name\t: something else
flags\t\t: avx512f
"""
ARM_CPUINFO = """processor\t: 0
BogoMIPS\t: 50.00
Features\t: fp asimd evtstrm aes sve
CPU implementer\t: 0x41
CPU part\t: 0xd40
"""


def test_cpu_identity_names_the_first_processor_and_its_vector_extensions():
    x86 = cpu_identity(X86_CPUINFO)
    assert x86 == {"model_name": "AMD EPYC", "family": "25", "model": "1", "vector": "avx avx2 fma"}
    assert describe_cpu(x86) == "AMD EPYC, family 25 model 1, avx avx2 fma"
    assert cpu_identity(ARM_CPUINFO) == {"vector": "asimd sve"}
    assert describe_cpu(cpu_identity(ARM_CPUINFO)) == "asimd sve"
    assert cpu_identity("") == {}



@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this OS")
def test_the_cores_available_follow_the_cpu_affinity():
    everything = os.sched_getaffinity(0)
    one = min(everything)
    try:
        os.sched_setaffinity(0, {one})
        assert machine.available_cores() == {one} and machine.cores_available() == 1
    finally:
        os.sched_setaffinity(0, everything)
    assert machine.cores_available() == len(everything)


def test_the_matmul_probe_multiplies_and_counts_its_flops():
    call, flops = machine.matmul_probe(8)
    assert call().shape == (8, 8) and flops == 2 * 8 ** 3
