"""CPU benchmark: ``gmc::group_sparse_linear`` vs dense ``F.linear`` on LLaMA-2-7B shapes.

For every (shape, tokens) the dense baseline is measured in the same run as the lowered op;
the table reports medians and the ratio dense / lowered (> 1 means the lowered op is faster).
Masks are random at the requested group sparsity (uniform over groups). Weights are fp32 unless
``--dtype`` says otherwise.

    python bench/bench_group_sparse_op.py --quick           # 1x256 at 50% only
    python bench/bench_group_sparse_op.py --threads 1       # the full grid of issue 4
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gmc.groups import GroupSpec
from gmc.kernels.group_sparse_linear import group_sparse_linear
from gmc.packed import pack


@dataclass(frozen=True)
class Shape:
    name: str
    d_out: int
    d_in: int


LLAMA2_7B = (
    Shape("q/k/v/o 4096x4096", 4096, 4096),
    Shape("gate/up 11008x4096", 11008, 4096),
    Shape("down 4096x11008", 4096, 11008),
)
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


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(grid: Grid, dtype: torch.dtype) -> list[dict]:
    rows = []
    gen = torch.Generator().manual_seed(0)
    for shape in grid.shapes:
        weight = torch.randn(shape.d_out, shape.d_in, generator=gen).to(dtype)  # [d_out, d_in]
        layers = {}
        for group in grid.groups:
            spec = GroupSpec(*map(int, group.split("x")))
            for sparsity in grid.sparsities:
                keep = torch.rand(spec.grid(tuple(weight.shape)), generator=gen) >= sparsity
                layers[group, sparsity] = pack(weight, keep, spec)
        for tokens in grid.tokens:
            x = torch.randn(tokens, shape.d_in, generator=gen).to(dtype)  # [T, d_in]
            dense = median_seconds(lambda: F.linear(x, weight), grid.repeats)
            for (group, sparsity), p in layers.items():
                args = (x, p.values, p.row_idx, p.row_ptr, None, shape.d_out, p.spec.g_in)
                sparse = median_seconds(lambda: group_sparse_linear(*args), grid.repeats)
                rows.append(dict(shape=shape.name, tokens=tokens, group=group, sparsity=sparsity,
                                 dense_ms=dense * 1e3, sparse_ms=sparse * 1e3, speedup=dense / sparse,
                                 bytes_ratio=p.nbytes / p.dense_nbytes))
                print(_format(rows[-1]), flush=True)
    return rows


def _format(row: dict) -> str:
    return (f"| {row['shape']} | {row['tokens']} | {row['group']} | {row['sparsity']:.1f} | "
            f"{row['dense_ms']:.2f} | {row['sparse_ms']:.2f} | {row['speedup']:.2f}x | {row['bytes_ratio']:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1x256 at 50%% only, 5 repeats")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    grid = Grid(groups=("1x256",), sparsities=(0.5,), repeats=5) if args.quick else Grid(repeats=args.repeats)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.dtype}; time = median of {grid.repeats}")
    print("| shape | tokens | group | sparsity | dense ms | lowered ms | dense/lowered | bytes ratio |")
    print("|---|---|---|---|---|---|---|---|")
    run(grid, getattr(torch, args.dtype))


if __name__ == "__main__":
    main()
