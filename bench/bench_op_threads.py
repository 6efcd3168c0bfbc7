"""The op on SmolLM2's projections at 1 and 2 threads: does a second thread help decode?

For each projection kind (q, k, v, o, gate, up, down) the op runs once on each of the model's 30
layers of that kind (one token, as decode does), at 1 thread and at 2 in turn, ``--rounds``
times; per kind: the best median microseconds per call and the packed GB/s. The q/k/v/o sets
(6-22 MB in all) partly stay in the 32 MiB L3, the MLP sets (50-60 MB) do not.

    python bench/bench_op_threads.py --artifact runs/quality/gm-1x256-50-short/artifact
    python bench/bench_op_threads.py --artifact runs/quality/gm-1x256-50-short/artifact --int8 --dense

``--int8`` / ``--int4``: the packed values weight-only int8 / int4 (``quantize``); ``--dense``: every group kept
(``pack_dense``: the dense baseline on the same kernel); ``--dtype bfloat16``: bf16 values and x.

docs/lowering.md ("Decode on two threads") has the table before and after the stream split its
k rows across threads.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from bench_decode import all_kept, load, masks_for

from gmc.graph.pipeline import lower
from gmc.groups import parse_pattern
from gmc.kernels.group_sparse_linear import cpu_backend, group_sparse_linear
from gmc.kernels.quantize import quantize


def per_call_us(layers, x: torch.Tensor, threads: int, repeats: int = 5) -> float:
    torch.set_num_threads(threads)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for layer in layers:
            group_sparse_linear(x, layer.values, layer.row_idx, layer.row_ptr, layer.bias, layer.shape[0],
                                layer.spec.g_in, layer.scales)
        times.append((time.perf_counter() - start) / len(layers))
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", default=None, help="masks artifact (default: random 1x256 masks at 50%%)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--int8", action="store_true", help="weight-only int8 values (x stays --dtype)")
    parser.add_argument("--int4", action="store_true", help="weight-only int4 values (x stays --dtype)")
    parser.add_argument("--dense", action="store_true", help="every group kept: the dense baseline on the kernel")
    args = parser.parse_args()
    pattern = parse_pattern("1x256")
    dtype = getattr(torch, args.dtype)
    model, _, _ = load("smollm2-135m")
    model.to(dtype)
    _, packed = lower(model, masks_for(model, pattern, 0.5, args.artifact), pattern)
    if args.dense:
        packed = all_kept(model, packed, pattern)
    how = "int4" if args.int4 else "int8" if args.int8 else None
    if how:
        packed = {name: quantize(layer, how) for name, layer in packed.items()}
    kinds: dict[str, list] = {}
    for name, layer in packed.items():
        kinds.setdefault(name.rsplit(".", 1)[-1], []).append(layer)
    values = how or args.dtype
    print(f"op CPU path: {cpu_backend()}; torch {torch.__version__}; x {args.dtype}, values {values}, "
          f"{'every group kept' if args.dense else 'lowered'}\n")
    print("| projection | packed MB per layer | 1 thread us | 2 threads us | 2 vs 1 | GB/s 1 / 2 threads |")
    print("|---|---|---|---|---|---|")
    for kind, layers in kinds.items():
        x = torch.randn(1, layers[0].shape[1], dtype=dtype)
        best = {1: float("inf"), 2: float("inf")}
        for _ in range(args.rounds):
            for threads in (1, 2):
                best[threads] = min(best[threads], per_call_us(layers, x, threads))
        mb = statistics.mean(layer.values.numel() * layer.values.element_size()
                             + (0 if layer.scales is None else layer.scales.numel() * layer.scales.element_size())
                             for layer in layers) / 1e6
        print(f"| {kind} | {mb:.2f} | {best[1]:.1f} | {best[2]:.1f} | {best[1] / best[2]:.2f}x | "
              f"{mb * 1e-3 / (best[1] * 1e-6):.1f} / {mb * 1e-3 / (best[2] * 1e-6):.1f} |")


if __name__ == "__main__":
    main()
