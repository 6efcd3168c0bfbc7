"""The host a bench ran on, as its records state it: CPU model, cores, torch, and a copy bandwidth
measured in the same run (bench scripts import this as ``host``: ``python bench/NAME.py``)."""
from __future__ import annotations

import os
import platform
import statistics
import time
from pathlib import Path

import torch


def host() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__}


def copy_bandwidth_gbs(threads: int, repeats: int = 5) -> float:
    """GB/s read + written by a 256 MiB ``copy_`` on ``threads`` threads (median); leaves torch on them."""
    torch.set_num_threads(threads)
    source = torch.ones(256 * 2**20 // 4)
    target = torch.empty_like(source)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        target.copy_(source)
        times.append(time.perf_counter() - start)
    return 2 * source.numel() * 4 / statistics.median(times) / 1e9
