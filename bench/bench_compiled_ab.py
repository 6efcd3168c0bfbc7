"""Compiled decode steps A/B: packages built by different versions of gmc, timed in one process.

``build`` compiles SmolLM2's prefill/decode programs of one kind with the code checked out now;
``time`` loads several such directories (or ``bench_versions.py``'s rows) and times them
interleaved: decode steps at positions 32..71, one step of each in turn (``--back-to-back``: each
package's steps in a row, the packages in turn), and with ``--prefill N``
N-token prefills, one of each in turn, ``--rounds`` rounds; it prints each one's median ms and its
ratio to the first directory (above 1: faster than the first). The CPU kernel library every
package calls is the one loaded now (the packages link to it by soname), so the A/B isolates what
the compiled programs do differently. ``--record NAME`` keeps the run in bench/results/compiled_ab.json.

    python bench/bench_compiled_ab.py build /tmp/ab/after-int8 --kind lowered-int8 \\
        --artifact runs/quality/gm-1x256-50-short/artifact
    python bench/bench_compiled_ab.py time /tmp/ab/before-int8 /tmp/ab/after-int8 --threads 1

Kinds: ``lowered-int8`` / ``dense-int8`` (every projection and the head weight-only int8 on gmc's
kernel, dense keeping all groups: bench_decode.py's int8 rows), ``lowered-int4`` (the kept values
int4, the head int8: bench_decode.py's lowered int4 row), ``lowered-bf16`` (bf16 model and packed
values). ``build --skip-pass NAME ...`` leaves passes of the lowering list out (the A/B of a pass:
``--skip-pass fuse_attention``). docs/lowering.md has the figures.
"""
from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time

import torch
from bench_decode import all_kept, load, masks_for
from bench_demo_spread import host_entry
from records import save_record

import gmc.graph.pipeline as pipeline
from gmc.formats.compiled import load_compiled
from gmc.graph.decode import KVCache
from gmc.graph.pipeline import lower, lower_decode
from gmc.groups import parse_pattern
from gmc.kernels.quantize import quantize, quantize_int8
from gmc.lower.compile import compile_programs

KINDS = ("lowered-int8", "dense-int8", "lowered-int4", "lowered-bf16")
MAX_LEN = 300
PROMPT, STEPS, PREFILLS = 32, 40, 2


def build(directory: str, kind: str, artifact: str | None, skip: tuple[str, ...] = ()) -> None:
    if skip:  # this process only: the list the lowering runs
        pipeline.LOWER = tuple(p for p in pipeline.LOWER if p.__name__ not in skip)
    pattern = parse_pattern("1x256")
    model, _, _ = load("smollm2-135m")
    _, packed = lower(model, masks_for(model, pattern, 0.5, artifact), pattern)
    head = [name for name, module in model.named_modules() if module is model.get_output_embeddings()]
    if kind == "lowered-bf16":
        model.to(torch.bfloat16)
        packed = {name: layer.to(dtype=torch.bfloat16) for name, layer in packed.items()}
    elif kind == "lowered-int4":  # the head int8 (lower_decode's packed_head)
        packed = {name: quantize(layer, "int4") for name, layer in packed.items()}
    else:
        layers = packed if kind == "lowered-int8" else all_kept(model, packed, pattern)
        packed = {name: quantize_int8(layer) for name, layer in {**layers, **all_kept(model, head, pattern)}.items()}
    compile_programs(lower_decode(model, packed, MAX_LEN), directory, MAX_LEN)


@torch.no_grad()
def time_steps(directories: list[str], prefill: int, rounds: int,
               back_to_back: bool = False) -> dict[str, dict[str, list[float]]]:
    """Per directory and measure (``decode``, and ``prefill`` when ``prefill`` > 0) the median ms of each round;
    ``back_to_back``: each package's decode steps in a row rather than one step of each in turn."""
    config = load("smollm2-135m")[0].config
    compiled = {name: load_compiled(name) for name in directories}
    caches = {name: KVCache.empty(config, c.max_len, c.dtype) for name, c in compiled.items()}
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, config.vocab_size, (1, PROMPT), generator=generator)
    long_ids = torch.randint(0, config.vocab_size, (1, prefill), generator=generator)
    token = torch.tensor([[5]])
    medians = {name: {"decode": [], **({"prefill": []} if prefill else {})} for name in directories}
    with torch.no_grad():
        for round_ in range(rounds):
            order = list(compiled.items())[:: 1 if round_ % 2 == 0 else -1]
            times = {name: [] for name in directories}
            for name, c in order:
                c.steps["prefill"](prompt, torch.tensor(0), caches[name].keys, caches[name].values)
            if back_to_back:  # each package's steps in a row, the packages in turn
                for name, c in order:
                    for position in range(PROMPT, PROMPT + STEPS):
                        start = time.perf_counter()
                        c.steps["decode"](token, torch.tensor(position), caches[name].keys, caches[name].values)
                        times[name].append(time.perf_counter() - start)
            for position in range(PROMPT, PROMPT + STEPS) if not back_to_back else ():
                for name, c in order:
                    start = time.perf_counter()
                    c.steps["decode"](token, torch.tensor(position), caches[name].keys, caches[name].values)
                    times[name].append(time.perf_counter() - start)
            for name in directories:
                medians[name]["decode"].append(statistics.median(times[name]) * 1e3)
            for _ in range(PREFILLS if prefill else 0):
                for name, c in order:
                    start = time.perf_counter()
                    c.steps["prefill"](long_ids, torch.tensor(0), caches[name].keys, caches[name].values)
                    times[name].append(time.perf_counter() - start)
            for name in directories if prefill else []:
                medians[name]["prefill"].append(statistics.median(times[name][STEPS:]) * 1e3)
    return medians


def summary(medians: dict[str, dict[str, list[float]]], threads: int) -> list[dict]:
    """One row per directory and measure: median over rounds, and the ratio to the first directory."""
    first = next(iter(medians.values()))
    rows = []
    for name, measures in medians.items():
        for measure, ms in measures.items():
            ratios = [a / b for a, b in zip(first[measure], ms)]
            rows.append({"threads": threads, "package": name, "measure": measure, "ms": statistics.median(ms),
                         "x_first": statistics.median(ratios), "x_min": min(ratios), "x_max": max(ratios)})
    return rows


NOTE = ("Medians of each round's decode steps (positions 32..71) and prefills, the package order alternating "
        "from round to round; x the first package: the first package's ms over this one's, round by round "
        "(above 1: faster).")
ORDER_TITLES = {False: "interleaved", True: "back to back"}
ORDERS = {False: "Decode steps interleaved: one step of each package in turn.",
          True: "Decode steps back to back: each package's 40 steps in a row, the packages in turn."}


def record(name: str, rows: list[dict], threads: int, back_to_back: bool) -> None:
    """The run as record ``name`` of bench/results/compiled_ab.json."""
    save_record("compiled_ab", {
        "name": name, "bench": "bench/bench_compiled_ab.py",
        "title": f"Compiled packages in one process, {ORDER_TITLES[back_to_back]} (SmolLM2-135M)",
        "command": shlex.join(["python", "bench/bench_compiled_ab.py", *sys.argv[1:]]),
        "host": host_entry(threads),
        "columns": [{"key": "threads", "title": "threads"}, {"key": "package", "title": "package"},
                    {"key": "measure", "title": "decode step or prefill"},
                    {"key": "ms", "title": "ms (median of rounds)", "format": "{:.2f}"},
                    {"key": "x_first", "title": "x the first package", "format": "{:.3f}x"},
                    {"key": "x_min", "title": "lowest round", "format": "{:.3f}x"},
                    {"key": "x_max", "title": "highest round", "format": "{:.3f}x"}],
        "rows": rows, "notes": [NOTE, ORDERS[back_to_back]]})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    building = commands.add_parser("build", help="compile one kind's programs into DIRECTORY")
    building.add_argument("directory")
    building.add_argument("--kind", choices=KINDS, required=True)
    building.add_argument("--artifact", default=None, help="masks artifact (default: random 1x256 masks at 50%%)")
    building.add_argument("--skip-pass", nargs="+", default=(), choices=[p.__name__ for p in pipeline.LOWER],
                          help="leave these passes of the lowering list out")
    timing = commands.add_parser("time", help="median ms per decode step (and prefill) of each directory, interleaved")
    timing.add_argument("directories", nargs="+")
    timing.add_argument("--threads", type=int, nargs="+", default=[1])
    timing.add_argument("--prefill", type=int, default=0, help="also time prefills of this many tokens")
    timing.add_argument("--rounds", type=int, default=3)
    timing.add_argument("--back-to-back", action="store_true",
                        help="each package's decode steps in a row (as a user's loop runs them), not interleaved")
    timing.add_argument("--record", default=None, help="keep the run as record NAME in bench/results/compiled_ab.json")
    args = parser.parse_args()
    if args.command == "build":
        build(args.directory, args.kind, args.artifact, args.skip_pass)
        return
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        rows += summary(time_steps(args.directories, args.prefill, args.rounds, args.back_to_back), threads)
        for row in rows[-len(args.directories) * (2 if args.prefill else 1):]:
            print(f"{threads} thread(s)  {row['measure']:7}  {row['ms']:8.3f} ms  {row['x_first']:.3f}x the first "
                  f"(rounds {row['x_min']:.3f}-{row['x_max']:.3f})  {row['package']}", flush=True)
    if args.record:
        record(args.record, rows, max(args.threads), args.back_to_back)


if __name__ == "__main__":
    main()
