"""GPU benchmark: Triton ``group_sparse_linear`` vs cuBLAS dense ``F.linear`` (LLaMA-2-7B shapes).

Reports median (20th, 80th percentile) milliseconds from ``triton.testing.do_bench`` and the
effective bandwidth of the lowered op (kept weight bytes + activations / time). Dense and lowered
are measured in the same run. ``--tiny`` runs one small shape, also on CPU under the interpreter:

    python bench/bench_triton_op.py                           # on a CUDA GPU, fp16
    TRITON_INTERPRET=1 python bench/bench_triton_op.py --tiny # anywhere, checks the script runs
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from shapes import LLAMA2_7B, Shape

from gmc.groups import GroupSpec
from gmc.kernels.packed import pack

TINY = (Shape("tiny 96x576", 96, 576),)


@dataclass(frozen=True)
class Grid:
    shapes: tuple[Shape, ...] = LLAMA2_7B
    tokens: tuple[int, ...] = (1, 16, 256)
    sparsities: tuple[float, ...] = (0.3, 0.5, 0.7, 0.9)
    groups: tuple[str, ...] = ("1x256", "1x64", "32x32")

    def __post_init__(self):
        if not all(0.0 <= s < 1.0 for s in self.sparsities):
            raise ValueError("sparsities must be in [0, 1)")


def bench_ms(fn, interpret: bool) -> tuple[float, float, float]:
    """(median, p20, p80) milliseconds."""
    if not interpret:
        import triton.testing

        return tuple(triton.testing.do_bench(fn, quantiles=[0.5, 0.2, 0.8]))
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), min(times), max(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="one small shape (works under TRITON_INTERPRET=1)")
    parser.add_argument("--dtype", choices=("float16", "bfloat16", "float32"), default="float16")
    args = parser.parse_args()
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    from gmc.kernels.triton_group_sparse import triton_group_sparse_linear

    device = "cpu" if interpret else "cuda"
    if not interpret and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU: run with TRITON_INTERPRET=1 --tiny to check the script on CPU")
    dtype = getattr(torch, args.dtype)
    grid = Grid(shapes=TINY, tokens=(1, 7, 64), sparsities=(0.5,), groups=("1x256", "32x32")) if args.tiny else Grid()
    where = "interpreter on CPU: timings are meaningless, this run checks the script" if interpret else torch.cuda.get_device_name()
    print(f"{where}; {args.dtype}")
    print("| shape | tokens | group | sparsity | dense ms (p20-p80) | triton ms (p20-p80) | dense/triton | triton GB/s |")
    print("|---|---|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for shape in grid.shapes:
        weight = torch.randn(shape.d_out, shape.d_in, generator=gen).to(device=device, dtype=dtype)
        for tokens in grid.tokens:
            x = torch.randn(tokens, shape.d_in, generator=gen).to(device=device, dtype=dtype)
            dense = bench_ms(lambda: F.linear(x, weight), interpret)
            for group in grid.groups:
                spec = GroupSpec(*map(int, group.split("x")))
                for sparsity in grid.sparsities:
                    keep = torch.rand(spec.grid((shape.d_out, shape.d_in)), generator=gen) >= sparsity
                    p = pack(weight, keep, spec)
                    run = lambda: triton_group_sparse_linear(x, p.values, p.row_idx, p.row_ptr, None, shape.d_out, spec.g_in)
                    sparse = bench_ms(run, interpret)
                    moved = p.nbytes + x.numel() * x.element_size() + tokens * shape.d_out * 4
                    print(f"| {shape.name} | {tokens} | {group} | {sparsity:.1f} | {dense[0]:.3f} ({dense[1]:.3f}-{dense[2]:.3f}) "
                          f"| {sparse[0]:.3f} ({sparse[1]:.3f}-{sparse[2]:.3f}) | {dense[0] / sparse[0]:.2f}x "
                          f"| {moved / sparse[0] / 1e6:.1f} |", flush=True)


if __name__ == "__main__":
    main()
