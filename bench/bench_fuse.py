"""Horizontal fusion A/B: compiled decode with and without ``fuse_siblings``, interleaved.

For each row kind (``lowered`` fp32, ``lowered-int8``, ``dense-int8``: every group kept, the int8
baseline) the same model is compiled twice by ``lower_decode(fuse=False | True)``; decode steps
of all programs then run in turn, one step each (``bench_decode.time_decode``), ``--rounds`` times per
thread count. Prints the median ms per token of each program.

    python bench/bench_fuse.py --artifact runs/quality/gm-1x256-50-short/artifact
"""
from __future__ import annotations

import argparse
import tempfile

import torch
from bench_decode import all_kept, compiled_row, load, masks_for, time_decode

from gmc.graph.pipeline import lower
from gmc.groups import parse_pattern
from gmc.kernels.quantize import quantize_int8

KINDS = ("lowered", "lowered-int8", "dense-int8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", default=None, help="masks artifact (default: random 1x256 masks at 50%%)")
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--max-len", type=int, default=300, help="static KV cache positions")
    args = parser.parse_args()
    pattern = parse_pattern("1x256")
    model, _, _ = load("smollm2-135m")
    _, packed = lower(model, masks_for(model, pattern, 0.5, args.artifact), pattern)
    sets = {"lowered": packed, "lowered-int8": {name: quantize_int8(layer) for name, layer in packed.items()},
            "dense-int8": {name: quantize_int8(layer) for name, layer in all_kept(model, packed, pattern).items()}}
    max_len = max(args.max_len, 32 + args.steps)
    prompt = torch.randint(0, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(1))
    with tempfile.TemporaryDirectory(prefix="gmc-bench-fuse-") as scratch:
        rows = [compiled_row(f"{kind} fuse={fuse}", model, sets[kind], max_len, scratch, 1, True, fuse)
                for kind in args.kinds for fuse in (False, True)]
        print("| threads | " + " | ".join(row.label for row in rows) + " |")
        print("|---" * (len(rows) + 1) + "|")
        for threads in args.threads:
            torch.set_num_threads(threads)
            for _ in range(args.rounds):
                time_decode(rows, model.config, max_len, torch.float32, prompt, args.steps, interleave=True)
                print(f"| {threads} | " + " | ".join(f"{row.decode_s * 1e3:.2f} ms" for row in rows) + " |", flush=True)


if __name__ == "__main__":
    main()
