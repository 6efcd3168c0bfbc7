"""Compiled decode steps over weights (or a KV cache) on 2 MiB pages against the same on 4 KiB pages, interleaved.

``load_compiled`` reads a package's constants into one mapping advised onto transparent huge pages
(``gmc.huge_pages``). This bench loads each row's compiled directory twice in one process:
once so, once with safetensors' ``load_file`` (ordinary heap memory: 4 KiB pages under THP's
``madvise`` mode, most distributions' default), and times their decode steps in turn (the two
alternating which goes first) over positions 32..95 of a 32-token prompt, ``--reps`` times.
Then the KV cache the same way: one load (weights on huge pages) over a cache from
``KVCache.empty`` (huge pages) and one from ``torch.zeros``. Prints the median ms a token of each
and the ratio, and the huge-paged memory the process holds
(``AnonHugePages``: THP delivers huge pages only where it can, so a ratio near 1 with little of it
says the host had none to give). The rows are ``prefill_loop.py``'s (SmolLM2-135M, random 1x256
masks at 50%, the head int8 under int8 / int4), compiled into ``--scratch`` once.

    python bench/bench_huge_pages.py --march x86-64-v3 --threads 1 2 --record huge-pages-avx2
"""
from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from bench_decode import load
from bench_demo_spread import host_entry
from host import MARCH_HELP, run_as
from prefill_loop import steps
from records import save_record
from safetensors.torch import load_file

import gmc.formats.compiled as compiled_format
from gmc.graph.decode import KVCache, cache_shape
from gmc.kernels.cpu_group_sparse import MARCHES

PROMPT, POSITIONS = 32, range(32, 96)


def huge_paged_kib() -> int:
    """AnonHugePages of this process, KiB."""
    rollup = Path("/proc/self/smaps_rollup").read_text()
    return int(rollup.split("AnonHugePages:")[1].split()[0])


def both(directory: Path) -> dict:
    """The compiled steps of ``directory`` over weights on huge pages and on the heap's pages."""
    huge = compiled_format.load_compiled(directory)
    place = compiled_format.load_on_huge_pages
    compiled_format.load_on_huge_pages = lambda path: load_file(str(path))
    try:
        heap = compiled_format.load_compiled(directory)
    finally:
        compiled_format.load_on_huge_pages = place
    return {"2 MiB pages": huge, "4 KiB pages": heap}


def plain_cache(config) -> KVCache:
    """The KV cache in torch's own allocations (4 KiB pages under THP's ``madvise`` mode)."""
    layers, heads, dim = cache_shape(config)
    shape = (1, heads, POSITIONS.stop, dim)
    return KVCache([torch.zeros(shape) for _ in range(layers)], [torch.zeros(shape) for _ in range(layers)])


def timed(lms: dict, caches: dict, config, reps: int) -> dict:
    """Median decode ms a token of each loaded model over its cache, steps interleaved."""
    ids = torch.randint(0, config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    tokens = torch.randint(0, config.vocab_size, (reps, len(POSITIONS)), generator=torch.Generator().manual_seed(2))
    times = {name: [] for name in lms}
    with torch.no_grad():
        for name, lm in lms.items():
            lm.steps["prefill"](ids, torch.tensor(0), caches[name].keys, caches[name].values)
        for rep in range(reps):
            for i, position in enumerate(POSITIONS):
                order = list(lms) if (rep + i) % 2 == 0 else list(lms)[::-1]
                for name in order:
                    cache = caches[name]
                    start = time.perf_counter()
                    lms[name].steps["decode"](tokens[rep, i].view(1, 1), torch.tensor(position), cache.keys,
                                              cache.values)
                    times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", default=["lowered:int4", "dense:int4", "dense:int8"],
                        help="ROW:VALUES, ROW dense or lowered, VALUES none, int8 or int4")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--reps", type=int, default=20, help="passes over positions 32..95")
    parser.add_argument("--march", choices=MARCHES, default="native", help=MARCH_HELP)
    parser.add_argument("--scratch", default="/tmp/gmc-huge-pages", help="where the compiled rows are kept")
    parser.add_argument("--record", default=None, help="keep the run as record NAME in bench/results/huge_pages.json")
    args = parser.parse_args()
    run_as(args.march)
    model = load("smollm2-135m")[0]
    rows = []
    for spec in args.rows:
        row, _, values = spec.partition(":")
        options = SimpleNamespace(row=row, quantize=values or "none", tokens=POSITIONS.stop - 8, scratch=args.scratch)
        steps(options, model)  # compiles the row into --scratch once
        lms = both(Path(args.scratch) / f"{row}-{options.quantize}-{options.tokens}")
        placed = {t.data_ptr(): t.nbytes for t in lms["2 MiB pages"].constants.values()}  # tied ones once
        weights_mib = sum(placed.values()) / 2**20
        for threads in args.threads:
            torch.set_num_threads(threads)
            # the weights both ways over caches on huge pages; then the KV cache both ways under weights on them
            weights = timed(lms, {name: KVCache.empty(model.config, POSITIONS.stop) for name in lms}, model.config,
                            args.reps)
            huge = lms["2 MiB pages"]
            cache = timed({"2 MiB pages": huge, "4 KiB pages": huge},
                          {"2 MiB pages": KVCache.empty(model.config, POSITIONS.stop),
                           "4 KiB pages": plain_cache(model.config)}, model.config, args.reps)
            for placed, ms in (("weights", weights), ("KV cache", cache)):
                ratio = ms["4 KiB pages"] / ms["2 MiB pages"]
                rows.append({"row": f"{row} {options.quantize}", "placed": placed, "threads": threads,
                             "ms_4k": ms["4 KiB pages"], "ms_2m": ms["2 MiB pages"], "x_4k": ratio,
                             "constants_mib": weights_mib, "huge_paged_mib": huge_paged_kib() / 1024})
                print(f"{row} {options.quantize}, {placed}, {threads} thread(s): 4 KiB pages "
                      f"{ms['4 KiB pages']:.3f} ms, 2 MiB pages {ms['2 MiB pages']:.3f} ms a token ({ratio:.3f}x); "
                      f"the process holds {rows[-1]['huge_paged_mib']:.0f} MiB on huge pages, constants "
                      f"{weights_mib:.1f} MiB")
        del lms
    if args.record:
        save_record("huge_pages", {
            "name": args.record, "bench": "bench/bench_huge_pages.py",
            "title": "Compiled decode, weights or KV cache on 2 MiB against 4 KiB pages (SmolLM2-135M, random 1x256 "
                     "masks at 50%)",
            "command": shlex.join(["python", "bench/bench_huge_pages.py", *sys.argv[1:]]),
            "host": {**host_entry(max(args.threads)), "thp": Path("/sys/kernel/mm/transparent_hugepage/enabled")
                     .read_text().strip()},
            "columns": [{"key": "row", "title": "row"}, {"key": "placed", "title": "on 4 KiB or 2 MiB pages"},
                        {"key": "threads", "title": "threads"},
                        {"key": "ms_4k", "title": "4 KiB pages, ms a token", "format": "{:.3f}"},
                        {"key": "ms_2m", "title": "2 MiB pages, ms a token", "format": "{:.3f}"},
                        {"key": "x_4k", "title": "x 4 KiB pages", "format": "{:.3f}x"},
                        {"key": "constants_mib", "title": "constants MiB", "format": "{:.1f}"},
                        {"key": "huge_paged_mib", "title": "process on huge pages, MiB", "format": "{:.0f}"}],
            "rows": rows,
            "notes": [f"Median of {args.reps} x {len(POSITIONS)} decode steps each, the two sides (weights: two "
                      "loads over caches on huge pages; KV cache: one load on huge pages over a cache from "
                      "KVCache.empty and one from torch.zeros) alternating first; positions 32..95 after a "
                      "32-token prompt."],
        })


if __name__ == "__main__":
    main()
