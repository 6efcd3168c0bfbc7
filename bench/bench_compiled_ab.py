"""Compiled decode steps A/B: packages built by different versions of gmc, timed in one process.

``build`` compiles SmolLM2's prefill/decode programs of one kind with the code checked out now;
``time`` loads several such directories and times their decode steps interleaved (one step of
each in turn, positions 32..71, three rounds), printing each one's median ms per step. Build the
"before" directory at one commit and the "after" one at another, then time both in one process:
the CPU kernel library both call is the one loaded now (the packages link to it by soname), so
the A/B isolates what the compiled programs do differently.

    python bench/bench_compiled_ab.py build /tmp/ab/after-int8 --kind lowered-int8 \\
        --artifact runs/quality/gm-1x256-50-short/artifact
    python bench/bench_compiled_ab.py time /tmp/ab/before-int8 /tmp/ab/after-int8 --threads 1

Kinds: ``lowered-int8`` / ``dense-int8`` (every projection and the head weight-only int8 on gmc's
kernel, dense keeping all groups: bench_decode.py's int8 rows), ``lowered-bf16`` (bf16 model and
packed values). docs/lowering.md has the figures.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from bench_decode import all_kept, load, masks_for

from gmc.formats.compiled import load_compiled
from gmc.graph.decode import KVCache
from gmc.graph.pipeline import lower, lower_decode
from gmc.groups import parse_pattern
from gmc.kernels.quantize import quantize_int8
from gmc.lower.compile import compile_programs

KINDS = ("lowered-int8", "dense-int8", "lowered-bf16")
MAX_LEN = 300
PROMPT, STEPS, ROUNDS = 32, 40, 3


def build(directory: str, kind: str, artifact: str | None) -> None:
    pattern = parse_pattern("1x256")
    model, _, _ = load("smollm2-135m")
    _, packed = lower(model, masks_for(model, pattern, 0.5, artifact), pattern)
    head = [name for name, module in model.named_modules() if module is model.get_output_embeddings()]
    if kind == "lowered-bf16":
        model.to(torch.bfloat16)
        packed = {name: layer.to(dtype=torch.bfloat16) for name, layer in packed.items()}
    else:
        layers = packed if kind == "lowered-int8" else all_kept(model, packed, pattern)
        packed = {name: quantize_int8(layer) for name, layer in {**layers, **all_kept(model, head, pattern)}.items()}
    compile_programs(lower_decode(model, packed, MAX_LEN), directory, MAX_LEN)


@torch.no_grad()
def time_steps(directories: list[str]) -> dict[str, float]:
    config = load("smollm2-135m")[0].config
    compiled = {name: load_compiled(name) for name in directories}
    caches = {name: KVCache.empty(config, MAX_LEN, c.dtype) for name, c in compiled.items()}
    prompt = torch.randint(0, config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    for name, c in compiled.items():
        c.steps["prefill"](prompt, torch.tensor(0), caches[name].keys, caches[name].values)
    token, times = torch.tensor([[5]]), {name: [] for name in directories}
    for _ in range(ROUNDS):
        for position in range(PROMPT, PROMPT + STEPS):
            for name, c in compiled.items():
                start = time.perf_counter()
                c.steps["decode"](token, torch.tensor(position), caches[name].keys, caches[name].values)
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    building = commands.add_parser("build", help="compile one kind's programs into DIRECTORY")
    building.add_argument("directory")
    building.add_argument("--kind", choices=KINDS, required=True)
    building.add_argument("--artifact", default=None, help="masks artifact (default: random 1x256 masks at 50%%)")
    timing = commands.add_parser("time", help="median ms per decode step of each directory, interleaved")
    timing.add_argument("directories", nargs="+")
    timing.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if args.command == "build":
        build(args.directory, args.kind, args.artifact)
        return
    torch.set_num_threads(args.threads)
    for name, ms in time_steps(args.directories).items():
        print(f"{args.threads} thread(s)  {ms:7.3f} ms/step  {name}")


if __name__ == "__main__":
    main()
