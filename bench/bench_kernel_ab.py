"""Kernel source A/B: two or more versions of ``cpu_group_sparse.cpp`` on SmolLM2's decode layers, interleaved.

Each source is built as its own extension module (same flags as gmc's kernel) and called through
its ``forward`` entry with the stream product forced (one token, as decode does), so the versions
run side by side in one process. Per projection kind (q, k, v, o, gate, up, down; 30 layers each)
and the output head (all groups kept), every round times one pass over the set with each version
in turn, after reading 96 MB so that on a host whose last-level cache is smaller than that the
weights come from DRAM as in a decode step. The versions take turns first (A B, then B A): on a
host with a large L3 (480 MiB on a Xeon here) the flush evicts nothing, and the version timed second
in a round was about 20% faster whatever its source. A version's figure is therefore the mean of
two medians, over the rounds it went first and over those it went last (``balanced``): with one
median over an odd number of alternating rounds, the version listed first took its slower half's
median, and two builds of one source measured 1.24-1.5x apart on that Xeon (1.00-1.03x balanced).
Prints that ms per set, the GB/s of its values and scales, and the projections' sum for the
lowered and dense rows; ``--record NAME`` keeps them in bench/results/kernel.json with the host.

    mkdir -p /tmp/old && git archive HEAD~1 gmc/kernels | tar -x -C /tmp/old
    python bench/bench_kernel_ab.py /tmp/old/gmc/kernels/cpu_group_sparse.cpp gmc/kernels/cpu_group_sparse.cpp \\
        --artifact runs/quality/gm-1x256-50-short/artifact --quantize int8
    python bench/bench_kernel_ab.py gmc/kernels/cpu_group_sparse.cpp@x86-64-v3 --quantize int4 --tokens 256

A version is ``SOURCE`` or ``SOURCE@MARCH``: built for that ``-march`` (one of
``gmc.kernels.cpu_group_sparse.MARCHES``; x86-64-v3 runs the AVX2 code on an AVX-512 host), so one
source's builds compare side by side. ``--tokens`` above 1 times the op's own choice of product
for that many tokens (a prefill) instead of the stream.

A source includes the kernel core's headers (``group_sparse_core.h``, ``group_sparse_products.h``)
from its own directory, so an older version is the whole ``gmc/kernels`` folder of that revision.
Building a source takes 1-2 minutes the first time (cached by the source and the headers beside it
under ``$GMC_CACHE``); versions are named by their path.
Registering several builds makes torch warn that each overrides the op's CPU kernel: harmless
here, the versions are called directly.
"""
from __future__ import annotations

import argparse
import hashlib
import math
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
from bench_decode import all_kept, load, masks_for
from host import copy_bandwidth_gbs, host

from gmc.graph.pipeline import lower
from gmc.groups import parse_pattern
from gmc.kernels.cpu_group_sparse import MARCHES, build_directory, flags
from gmc.kernels.quantize import QUANTIZE, quantize

STREAM, AUTO = 1, 0  # the kernel's `forward` path argument: the decode product, the op's choice by tokens
FLUSH_FLOATS = 24 * 1024 * 1024  # 96 MB read between timed passes


def build(version: str):
    """``SOURCE[@MARCH]`` built as its own extension module."""
    from torch.utils.cpp_extension import load as load_extension

    path, _, target = version.partition("@")
    target = target or "native"
    if target not in MARCHES:
        raise SystemExit(f"bench_kernel_ab: -march {target!r} of {version} is not one of {', '.join(MARCHES)}")
    source = Path(path)
    digest = hashlib.sha256(source.read_bytes() + target.encode())
    for header in sorted(source.parent.glob("*.h")):  # the core the source includes
        digest.update(header.read_bytes())
    name = f"gmc_ab_{digest.hexdigest()[:12]}"
    return load_extension(name=name, sources=[str(source)], build_directory=str(build_directory(name)),
                          extra_cflags=flags(target), extra_ldflags=["-fopenmp"], verbose=False)


def balanced(seconds: list[float]) -> float:
    """A version's time from its rounds, which alternate the versions' order: the mean of the median
    over the rounds in the given order and the median over the reversed ones, so that every version
    weighs each place in the order alike."""
    if len(seconds) < 2:
        return seconds[0]
    return (statistics.median(seconds[0::2]) + statistics.median(seconds[1::2])) / 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sources", nargs="+", help="kernel versions to compare, SOURCE or SOURCE@MARCH (the first "
                                                    "is the base)")
    parser.add_argument("--artifact", default=None, help="masks artifact (default: random 1x256 masks at 50%%)")
    parser.add_argument("--quantize", choices=QUANTIZE, default="none",
                        help="weight-only values of the projections (the head is int8 under int4, as gmc lowers it)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=1, help="x's tokens (above 1: the op's product for them)")
    parser.add_argument("--record", default=None,
                        help="also keep the medians as record NAME of bench/results/kernel.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    modules = {version: build(version) for version in args.sources}
    pattern = parse_pattern("1x256")
    model, _, _ = load("smollm2-135m")
    _, packed = lower(model, masks_for(model, pattern, 0.5, args.artifact), pattern)
    head = [name for name, module in model.named_modules() if module is model.get_output_embeddings()]
    rows = {"lowered": {name: quantize(layer, args.quantize) for name, layer in packed.items()},
            "dense": {name: quantize(layer, args.quantize) for name, layer in all_kept(model, packed, pattern).items()}}
    head_layer = quantize(all_kept(model, head, pattern)[head[0]], "int8" if args.quantize == "int4" else args.quantize)
    sets = []
    for row, layers in rows.items():
        kinds: dict[str, list] = {}
        for name, layer in layers.items():
            kinds.setdefault(name.rsplit(".", 1)[-1], []).append(layer)
        sets += [(row, kind, group) for kind, group in kinds.items()] + [(row, "head", [head_layer])]
    flush = torch.ones(FLUSH_FLOATS)

    def one_pass(module, layers, x):
        for layer in layers:
            module.forward(x, layer.values, layer.row_idx, layer.row_ptr, layer.bias, layer.shape[0],
                           layer.spec.g_in, STREAM if args.tokens == 1 else AUTO, layer.scales)

    times: dict[tuple, list] = {}
    for round_ in range(args.rounds):
        order = list(modules.items()) if round_ % 2 == 0 else list(modules.items())[::-1]
        for row, kind, layers in sets:
            x = torch.randn(args.tokens, layers[0].shape[1])
            for version, module in order:
                one_pass(module, layers, x)  # warm the code, then evict the weights
                flush.mul_(1.0)
                start = time.perf_counter()
                one_pass(module, layers, x)
                times.setdefault((version, row, kind), []).append(time.perf_counter() - start)
    sums: dict[tuple, float] = {}
    rows_out = []
    base = args.sources[0]
    for row, kind, layers in sets:
        megabytes = sum(layer.values.nbytes + (layer.scales.nbytes if layer.scales is not None else 0)
                        for layer in layers) / 1e6
        cells = []
        for version in modules:
            seconds = balanced(times[(version, row, kind)])
            if kind != "head":
                sums[(version, row)] = sums.get((version, row), 0.0) + seconds
            cells.append(f"{version} {seconds * 1e3:6.3f} ms {megabytes / seconds / 1e3:5.2f} GB/s")
            rows_out.append({"set": f"{row} {kind}", "version": version, "mb": megabytes, "ms": seconds * 1e3,
                             "gb_s": megabytes / seconds / 1e3,
                             "x_base": balanced(times[(base, row, kind)]) / seconds})
        print(f"{row:7s} {kind:9s} {megabytes:6.2f} MB | " + " | ".join(cells))
    for version in modules:
        lowered, dense = sums[(version, "lowered")], sums[(version, "dense")]
        print(f"{version}: projections lowered {lowered * 1e3:.3f} ms, dense {dense * 1e3:.3f} ms, "
              f"dense / lowered {dense / lowered:.2f}x")
        for row in ("lowered", "dense"):
            rows_out.append({"set": f"{row} projections", "version": version, "mb": math.nan,
                             "ms": sums[(version, row)] * 1e3, "gb_s": math.nan,
                             "x_base": sums[(base, row)] / sums[(version, row)]})
    if args.record:
        from records import save_record

        save_record("kernel", {
            "name": args.record, "title": f"Kernel versions on SmolLM2-135M's layers, 1x256 at 50%, {args.quantize} "
                                          f"values, {args.tokens} token(s), {args.threads} thread(s)",
            "bench": "bench/bench_kernel_ab.py", "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
            # each version names its own -march: not the process's
            "host": {**{k: v for k, v in host().items() if k != "gmc_kernel_march"},
                     "copy_gbps": [round(copy_bandwidth_gbs(args.threads), 1)], "threads": [args.threads]},
            "columns": [{"key": "set", "title": "layers"}, {"key": "version", "title": "version"},
                        {"key": "mb", "title": "MB", "format": "{:.2f}"}, {"key": "ms", "title": "ms (median)",
                                                                          "format": "{:.3f}"},
                        {"key": "gb_s", "title": "GB/s", "format": "{:.2f}"},
                        {"key": "x_base", "title": "x first version", "format": "{:.2f}x"}],
            "rows": rows_out,
            "notes": [f"{args.rounds} rounds, versions alternating first; ms: the mean of the medians over the "
                      "rounds in each order; MB: values and scales of the set's layers."],
        })


if __name__ == "__main__":
    main()
