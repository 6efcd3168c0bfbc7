"""Timing GPU kernels the way they run in a decode step (bench scripts import this as ``cuda_timing``).

- Each measured thing is captured as one CUDA graph and replayed, so a short kernel's time is its
  own and not the launch path's (``triton.testing.do_bench`` launches from Python and flushes L2
  with a memset before every call, which inflates microsecond kernels on both sides).
- A graph holds the call on ``copies`` copies of its weights, one after another, enough to span
  several times the L2 cache: a layer is read from HBM, as in a model whose layers do not fit in
  L2, and not from the cache (an H100's 50 MB holds a whole LLaMA-2-7B projection).
- Graphs compared with each other are replayed interleaved (A, B, A, B, ...) and each reports the
  median of its replays, divided by its copies: host or clock drift moves both sides alike.

Off CUDA (the interpreter, ``--tiny`` runs) the wall clock of one call stands in: those numbers
check the code path, not speed.
"""
from __future__ import annotations

import math
import statistics
import time
from typing import Callable, Mapping, Sequence

import torch

L2_SPAN = 3  # a graph's copies together span at least this many L2 caches


def l2_bytes(device: torch.device) -> int:
    return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 * 2**20)


def copies_for(call_bytes: int, device: torch.device, most: int = 32) -> int:
    """How many copies of a call's tensors make its graph read past the L2 cache."""
    if device.type != "cuda":
        return 1
    return max(1, min(most, math.ceil(L2_SPAN * l2_bytes(device) / max(call_bytes, 1))))


def graphed_ms(runs: Mapping[str, Sequence[Callable[[], object]]], replays: int = 30) -> dict[str, float]:
    """Milliseconds a call, each name's calls (one per copy) captured as one graph, replays interleaved."""
    if not torch.cuda.is_available():  # CPU: the interpreter, or a CPU-only check of the script
        return {name: _wall_ms(calls[0]) for name, calls in runs.items()}
    graphs = {}
    for name, calls in runs.items():
        for call in calls:  # compile and warm up outside the graph
            call()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for call in calls:
                call()
        graph.replay()
        graphs[name] = graph
    torch.cuda.synchronize()
    times = {name: [] for name in runs}
    for _ in range(replays):
        for name, graph in graphs.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end))
    return {name: statistics.median(t) / len(runs[name]) for name, t in times.items()}


def _wall_ms(call) -> float:
    start = time.perf_counter()
    call()
    return (time.perf_counter() - start) * 1e3


def copy_gbps(device: torch.device, nbytes: int = 2**30, replays: int = 20) -> float:
    """GB/s of a device-to-device copy, bytes read plus bytes written: the HBM roofline a kernel is held to."""
    source = torch.empty(nbytes // 4, dtype=torch.float32, device=device).normal_()
    target = torch.empty_like(source)
    ms = graphed_ms({"copy": [lambda: target.copy_(source)]}, replays)["copy"]
    return 2 * nbytes / ms / 1e6


def gemm_tflops(device: torch.device, n: int = 8192, dtype=torch.bfloat16) -> float:
    """TFLOP/s of an ``n``-cubed product through cuBLAS on random data."""
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    ms = graphed_ms({"gemm": [lambda: a @ b]}, 10)["gemm"]
    return 2 * n**3 / ms / 1e9
