"""CPU benchmark: ``gmc::group_sparse_linear`` vs dense ``F.linear`` on LLaMA-2-7B shapes.

For every case the dense baseline and the lowered op are called alternately (same noise for
both) after a cache flush (weights come from DRAM); the table reports medians and the ratio
dense / lowered (> 1 means the lowered op is faster).
Masks are random at the requested group sparsity (uniform over groups). Weights are fp32 unless
``--dtype`` says otherwise.

    python bench/bench_group_sparse_op.py --quick           # 1x256 at 50% only
    python bench/bench_group_sparse_op.py --threads 1       # every shape, token count, group and sparsity
    python bench/bench_group_sparse_op.py --quick --with-torch-fallback   # + the pure-torch path

The op runs its CPU implementation (``cpu_backend()`` is printed: the compiled C++ kernel, or
the torch fallback); ``--with-torch-fallback`` also times ``group_sparse_linear_torch`` in the
same interleaved loop.
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from shapes import LLAMA2_7B, Shape

from gmc.groups import GroupSpec
from gmc.kernels.group_sparse_linear import (
    cpu_backend,
    group_sparse_linear,
    group_sparse_linear_torch,
)
from gmc.kernels.packed import pack

TOKENS = (1, 16, 256)
SPARSITIES = (0.3, 0.5, 0.7, 0.9)
GROUPS = ("1x256", "1x64", "32x32")


@dataclass(frozen=True)
class Grid:
    shapes: tuple[Shape, ...] = LLAMA2_7B
    tokens: tuple[int, ...] = TOKENS
    sparsities: tuple[float, ...] = SPARSITIES
    groups: tuple[str, ...] = GROUPS
    repeats: int = 7

    def __post_init__(self):
        if self.repeats < 1 or not all(0.0 <= s < 1.0 for s in self.sparsities):
            raise ValueError("repeats must be >= 1 and sparsities in [0, 1)")


class CacheFlush:
    """Writes a buffer larger than the last-level cache (105 MB here) so that every timed call
    reads its weights from DRAM, as a decode step over a 7B model does."""

    def __init__(self, megabytes: int):
        self.scratch = torch.zeros(megabytes << 18) if megabytes > 0 else None  # fp32: 4 bytes each

    def __call__(self) -> None:
        if self.scratch is not None:
            self.scratch.add_(1.0)


def interleaved_medians(fns: dict, repeats: int, flush: CacheFlush) -> dict[str, float]:
    """Median seconds per function; calls alternate A, B, A, B so machine noise hits both."""
    for fn in fns.values():
        fn()  # warm-up
    times = {label: [] for label in fns}
    for _ in range(repeats):
        for label, fn in fns.items():
            flush()
            start = time.perf_counter()
            fn()
            times[label].append(time.perf_counter() - start)
    return {label: statistics.median(t) for label, t in times.items()}


def run(grid: Grid, dtype: torch.dtype, flush: CacheFlush, with_torch: bool = False) -> list[dict]:
    rows = []
    gen = torch.Generator().manual_seed(0)
    for shape in grid.shapes:
        weight = torch.randn(shape.d_out, shape.d_in, generator=gen).to(dtype)  # [d_out, d_in]
        for tokens in grid.tokens:
            x = torch.randn(tokens, shape.d_in, generator=gen).to(dtype)  # [T, d_in]
            for group in grid.groups:
                spec = GroupSpec(*map(int, group.split("x")))
                for sparsity in grid.sparsities:
                    keep = torch.rand(spec.grid(tuple(weight.shape)), generator=gen) >= sparsity
                    p = pack(weight, keep, spec)
                    args = (x, p.values, p.row_idx, p.row_ptr, None, shape.d_out, p.spec.g_in)
                    fns = {"dense": lambda: F.linear(x, weight), "sparse": lambda: group_sparse_linear(*args)}
                    if with_torch:
                        fns["torch"] = lambda: group_sparse_linear_torch(*args)
                    med = interleaved_medians(fns, grid.repeats, flush)
                    rows.append(dict(shape=shape.name, tokens=tokens, group=group, sparsity=sparsity,
                                     dense_ms=med["dense"] * 1e3, sparse_ms=med["sparse"] * 1e3,
                                     speedup=med["dense"] / med["sparse"], bytes_ratio=p.nbytes / p.dense_nbytes))
                    if with_torch:
                        rows[-1].update(torch_ms=med["torch"] * 1e3, torch_speedup=med["dense"] / med["torch"])
                    print(_format(rows[-1]), flush=True)
    return rows


def _format(row: dict) -> str:
    text = (f"| {row['shape']} | {row['tokens']} | {row['group']} | {row['sparsity']:.1f} | "
            f"{row['dense_ms']:.2f} | {row['sparse_ms']:.2f} | {row['speedup']:.2f}x | {row['bytes_ratio']:.3f} |")
    if "torch_ms" in row:
        text += f" {row['torch_ms']:.2f} | {row['torch_speedup']:.2f}x |"
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1x256 at 50%% only, 5 repeats")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--with-torch-fallback", action="store_true", help="also time the pure-torch CPU path")
    parser.add_argument("--flush-mb", type=int, default=256,
                        help="cache-flush buffer written before each call (0: off)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    grid = Grid(groups=("1x256",), sparsities=(0.5,), repeats=5) if args.quick else Grid(repeats=args.repeats)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.dtype}; time = median of {grid.repeats} "
          f"interleaved calls, {args.flush_mb} MB cache flush before each; CPU op path: {cpu_backend()}")
    extra = (" torch-path ms | dense/torch-path |", "---|---|") if args.with_torch_fallback else ("", "")
    print("| shape | tokens | group | sparsity | dense ms | lowered ms | dense/lowered | bytes ratio |" + extra[0])
    print("|---|---|---|---|---|---|---|---|" + extra[1])
    run(grid, getattr(torch, args.dtype), CacheFlush(args.flush_mb), args.with_torch_fallback)


if __name__ == "__main__":
    main()
