"""The op on SmolLM2's projections at 1 and 2 threads: does a second thread help decode?

For each projection kind (q, k, v, o, gate, up, down) the op runs once on each of the model's 30
layers of that kind (one token, as decode does), at 1 thread and at 2 in turn, ``--rounds``
times; per kind: the best median microseconds per call and the packed GB/s. The q/k/v/o sets
(6-22 MB in all) partly stay in the 32 MiB L3, the MLP sets (50-60 MB) do not.

    python bench/bench_op_threads.py --artifact runs/quality/gm-1x256-50-short/artifact

docs/lowering.md ("Decode on two threads") has the table before and after the stream split its
k rows across threads.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench_decode import load, masks_for
from gmc.groups import parse_pattern
from gmc.kernels.group_sparse_linear import cpu_backend, group_sparse_linear
from gmc.pipeline import lower


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
    args = parser.parse_args()
    pattern = parse_pattern("1x256")
    model, _, _ = load("smollm2-135m")
    _, packed = lower(model, masks_for(model, pattern, 0.5, args.artifact), pattern)
    kinds: dict[str, list] = {}
    for name, layer in packed.items():
        kinds.setdefault(name.rsplit(".", 1)[-1], []).append(layer)
    print(f"op CPU path: {cpu_backend()}; torch {torch.__version__}\n")
    print("| projection | packed MB per layer | 1 thread us | 2 threads us | 2 vs 1 | GB/s 1 / 2 threads |")
    print("|---|---|---|---|---|---|")
    for kind, layers in kinds.items():
        x = torch.randn(1, layers[0].shape[1])
        best = {1: float("inf"), 2: float("inf")}
        for _ in range(args.rounds):
            for threads in (1, 2):
                best[threads] = min(best[threads], per_call_us(layers, x, threads))
        mb = statistics.mean(layer.values.numel() * layer.values.element_size() for layer in layers) / 1e6
        print(f"| {kind} | {mb:.2f} | {best[1]:.1f} | {best[2]:.1f} | {best[1] / best[2]:.2f}x | "
              f"{mb * 1e-3 / (best[1] * 1e-6):.1f} / {mb * 1e-3 / (best[2] * 1e-6):.1f} |")


if __name__ == "__main__":
    main()
