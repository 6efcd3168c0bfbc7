"""The host a bench ran on, as its records state it: CPU model, ISA, cores, torch, and a copy bandwidth
measured in the same run (bench scripts import this as ``host``: ``python bench/NAME.py``). The
measurements are gmc's own (``gmc.runtime.host``, what ``gmc bench`` and ``gmc env`` report)."""
from __future__ import annotations

import torch

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
