"""The host a bench ran on, as its records state it: CPU model, ISA, cores, torch, and a copy bandwidth
measured in the same run (bench scripts import this as ``host``: ``python bench/NAME.py``). The
measurements are gmc's own (``gmc.runtime.host``, what ``gmc bench`` and ``gmc env`` report), but for
the read bandwidth, which a bench that profiles one row states beside its time."""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch

from gmc.kernels.cpu_group_sparse import ENV_SWITCH
from gmc.runtime import host as _gmc_host


def host() -> dict:
    """CPU model, its instruction-set extensions (AVX2, AVX-512, VNNI, AMX: what decides the kernels'
    code paths), torch's CPU capability, cores and torch (``gmc.runtime.host.host``)."""
    return _gmc_host.host()


def copy_bandwidth_gbs(threads: int, repeats: int = 5) -> float:
    """GB/s read + written by a 256 MiB ``copy_`` on ``threads`` threads (median); leaves torch on them."""
    bandwidth = _gmc_host.copy_bandwidth_gbs(threads, repeats)
    torch.set_num_threads(threads)
    return bandwidth


def read_bandwidth_gbs(threads: int, repeats: int = 5, mib: int = 256) -> float:
    """GB/s read by ``amax`` over a ``mib`` MiB fp32 tensor on ``threads`` threads (median): what a step
    that only reads its weights could reach, where a copy also writes; leaves torch on ``threads``."""
    torch.set_num_threads(threads)
    source = torch.ones(mib * 2**20 // 4)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        source.amax()
        times.append(time.perf_counter() - start)
    return source.numel() * 4 / statistics.median(times) / 1e9


# What an AVX2-only host runs, emulated on an AVX-512 one: torch's and MKL's and oneDNN's AVX2 code
# (Inductor's generated kernels follow ATEN_CPU_CAPABILITY too).
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
MARCH_HELP = ("build gmc's kernel for this -march (x86-64-v3: the AVX2 code paths, with torch's AVX2 paths and "
              "llama.cpp's AVX2 build): both builds' rows from one AVX-512 host")


def run_as(march: str) -> None:
    """Re-run this script (same arguments) with gmc's kernel built for ``march`` (``GMC_CPU_KERNEL``)
    and, for ``x86-64-v3``, ``AVX2_ENV``, unless it already runs so: the variables must be set
    before torch and MKL start."""
    if march == "native" or os.environ.get(ENV_SWITCH) == march:
        return
    env = {**os.environ, ENV_SWITCH: march, **(AVX2_ENV if march == "x86-64-v3" else {})}
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, *sys.argv], env)
