"""One compiled row of ``bench_decode.py`` alone: its prefill in a loop, for timing it without the
other rows in the process and for a profiler to attach to.

    python bench/prefill_loop.py --march x86-64-v3 --threads 2 --seconds 40     # dense int4, 256 tokens
    perf record -g -p PID -o perf.data -- sleep 12                               # while it loops
    python bench/prefill_loop.py --quantize int8 --tokens 1 --threads 1          # the decode products

The row is built as ``bench_decode.py`` builds it (SmolLM2-135M, random 1x256 masks at 50%, the
head int8 under int8 / int4, ``lower_decode`` -> AOTInductor) and compiled once into ``--scratch``;
a later run with the same row loads it from there. Prints the median prefill ms over the loop and
what the run's threads read of memory (``host.read_bandwidth_gbs``: the ceiling of a step that
streams its weights; one token from an empty cache runs the decode products);
``--record NAME`` adds the run as a row of record NAME in bench/results/prefill_loop.json (the row of
the same settings replaced), with the host and its copy bandwidth measured after the loop.
"""
from __future__ import annotations

import argparse
import copy
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
from bench_decode import all_kept, compiled_row, load, masks_for
from bench_demo_spread import host_entry
from host import MARCH_HELP, read_bandwidth_gbs, run_as
from records import RESULTS, save_record

from gmc.formats.compiled import load_compiled
from gmc.graph.decode import KVCache
from gmc.graph.pipeline import lower
from gmc.groups import parse_pattern
from gmc.kernels.cpu_group_sparse import MARCHES
from gmc.kernels.quantize import quantize


def steps(args, model) -> dict:
    """The row's compiled steps for ``model`` (SmolLM2): loaded from ``--scratch`` when compiled there before
    (for the same ``--march``: Inductor's kernels in the package follow the CPU capability it ran under)."""
    label = f"{args.row}-{args.quantize}-{args.tokens}" + ("" if args.march == "native" else f"-{args.march}")
    directory = Path(args.scratch) / label
    if directory.is_dir():
        return load_compiled(directory).steps
    pattern = parse_pattern("1x256")
    dense = copy.deepcopy(model)
    _, packed = lower(model, masks_for(model, pattern, 0.5, None), pattern)
    traced, layers = (dense, all_kept(dense, packed, pattern)) if args.row == "dense" else (model, packed)
    if args.quantize != "none":
        layers = {name: quantize(layer, args.quantize) for name, layer in layers.items()}
    return compiled_row(label, traced, layers, args.tokens + 8, args.scratch, 0, True,
                        quantized=args.quantize).steps


def row_arguments(parser: argparse.ArgumentParser, row: str) -> None:
    """The options that pick and build a compiled row (what ``steps`` reads), ``row`` the default row."""
    parser.add_argument("--row", choices=["dense", "lowered"], default=row)
    parser.add_argument("--quantize", choices=["none", "int8", "int4"], default="int4")
    parser.add_argument("--march", choices=MARCHES, default="native", help=MARCH_HELP)
    parser.add_argument("--scratch", default="/tmp/gmc-prefill-loop", help="where the compiled row is kept")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    row_arguments(parser, "dense")
    parser.add_argument("--tokens", type=int, default=256, help="prefill length")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=20.0, help="how long to loop (at least 5 prefills)")
    parser.add_argument("--record", default=None, help="add this run to record NAME (bench/results/prefill_loop.json)")
    args = parser.parse_args()
    run_as(args.march)
    model = load("smollm2-135m")[0]
    config = model.config
    prefill = steps(args, model)["prefill"]
    torch.set_num_threads(args.threads)
    ids = torch.randint(0, config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(1))
    cache = KVCache.empty(config, args.tokens + 8, torch.float32)
    times, end = [], time.time() + args.seconds
    with torch.no_grad():
        while time.time() < end or len(times) < 5:
            start = time.perf_counter()
            prefill(ids, torch.tensor(0), cache.keys, cache.values)
            times.append(time.perf_counter() - start)
    median_ms = statistics.median(times[1:]) * 1e3
    read_gbps = read_bandwidth_gbs(args.threads)
    print(f"{args.row} {args.quantize}, {args.tokens} tokens, {args.threads} threads, -march={args.march}: "
          f"median {median_ms:.2f} ms over {len(times)} prefills; {args.threads} thread(s) read "
          f"{read_gbps:.1f} GB/s")
    if args.record:
        row = {"row": args.row, "quantize": args.quantize, "tokens": args.tokens, "threads": args.threads,
               "march": args.march, "median_ms": median_ms, "prefills": len(times), "read_gbps": read_gbps,
               "command": shlex.join(["python", "bench/prefill_loop.py", *sys.argv[1:]])}
        save_record("prefill_loop", record(args.record, row))


COLUMNS = [{"key": "row", "title": "row"}, {"key": "quantize", "title": "values"},
           {"key": "tokens", "title": "tokens"}, {"key": "threads", "title": "threads"},
           {"key": "march", "title": "gmc kernel -march"}, {"key": "median_ms", "title": "prefill ms (median)",
                                                            "format": "{:.2f}"},
           {"key": "prefills", "title": "prefills"},
           {"key": "read_gbps", "title": "read GB/s, same threads", "format": "{:.1f}"},
           {"key": "command", "title": "command"}]


def record(name: str, row: dict) -> dict:
    """Record ``name`` with ``row`` added (replacing a row of the same settings), the host measured now."""
    path = RESULTS / "prefill_loop.json"
    old = next((r for r in json.loads(path.read_text()) if r["name"] == name), None) if path.is_file() else None
    same = ("row", "quantize", "tokens", "threads", "march")
    rows = [r for r in (old or {}).get("rows", []) if any(r[k] != row[k] for k in same)] + [row]
    return {"name": name, "bench": "bench/prefill_loop.py",
            "title": "One compiled row's prefill alone (SmolLM2-135M, random 1x256 masks at 50%)",
            "command": row["command"], "host": host_entry(2),
            "columns": COLUMNS, "rows": rows}


if __name__ == "__main__":
    main()
