"""Are two threads' equal shares of a decode step balanced? One compiled row's one-token step, timed
with the second thread's share of every split decode product set in turn, interleaved in one process.

    python bench/thread_shares.py --row lowered --quantize int4 --march x86-64-v3
    python bench/thread_shares.py --row dense --quantize int8 --march x86-64-v3 --record NAME

gmc's decode products on P threads cut a layer into P contiguous runs of equal cost (``k_cut`` for
float and int8 values, by their weights; ``tile_cut`` for int4, a tile weighed by its k rows plus
``INT4_TILE_COST_ROWS``; in gmc/kernels/group_sparse_products.h)
and add the P partial outputs in a fixed order, so a result never depends on which thread ran
faster. If one thread ran slower on equal shares (the other waiting for it at the join), giving it
less would shorten the step. This bench copies the gmc package into ``--scratch``, edits the two cuts
there so thread 1's share reads an exported variable (the edit is asserted to apply: a changed
kernel fails here, not silently), re-runs itself on that copy (the kernel builds once, ~40 s),
and times the row (built as ``bench/prefill_loop.py`` builds it, its compiled package shared with
that bench) at each share: ``--rounds`` rounds of ``--calls`` steps a share, the shares' order
reversed every other round, the first round dropped. Prints each share's median of round medians
and range; ``--record NAME`` keeps them as record NAME of bench/results/thread_shares.json, with
the host and its copy bandwidth measured after the loop.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import shlex
import shutil
import statistics
import sys
import time
from pathlib import Path

from host import run_as
from prefill_loop import row_arguments, steps

ENV_COPY = "GMC_THREAD_SHARES_COPY"  # set in the re-run: the copy's root, on PYTHONPATH
SHARE = "gmc_bench_share"           # the variable the edited cuts read (thread 1's share at P = 2)
# (original, edited) in gmc/kernels/group_sparse_products.h
EDITS = [
    ("constexpr int64_t MIN_PARALLEL_NNZ = 1 << 15;\n",
     "constexpr int64_t MIN_PARALLEL_NNZ = 1 << 15;\n"
     f'extern "C" {{ __attribute__((visibility("default"))) double {SHARE} = 0.5; }}\n'),
    ("  const int64_t into = std::clamp<int64_t>(total * q / P - before, 0, b.w * b.R);\n",
     f"  const int64_t at = P == 2 && q == 1 ? int64_t(total * {SHARE}) : total * q / P;\n"
     "  const int64_t into = std::clamp<int64_t>(at - before, 0, b.w * b.R);\n"),
    ("  const int64_t into = total * q / P - before;\n",
     f"  const int64_t at = P == 2 && q == 1 ? int64_t(total * {SHARE}) : total * q / P;\n"
     "  const int64_t into = at - before;\n"),
]


def edited_copy(scratch: Path) -> Path:
    """A copy of the gmc package under ``scratch`` whose decode cuts read SHARE; the copy's root."""
    import gmc

    root = scratch / "gmc-thread-shares"
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(Path(gmc.__file__).parent, root / "gmc", ignore=shutil.ignore_patterns("__pycache__"))
    header = root / "gmc" / "kernels" / "group_sparse_products.h"
    text = header.read_text()
    for old, new in EDITS:
        if text.count(old) != 1:
            raise SystemExit(f"thread_shares: the kernel's decode cut changed ({old.strip()!r} not found once "
                             f"in {header.name}); update EDITS")
        text = text.replace(old, new)
    header.write_text(text)
    return root


def share_variables() -> list:
    """SHARE in every gmc CPU kernel library this process has loaded."""
    libraries = sorted({line.split()[-1] for line in open("/proc/self/maps")
                        if "gmc_cpu_group_sparse" in line and line.rstrip().endswith(".so")})
    found = []
    for path in libraries:
        try:
            found.append(ctypes.c_double.in_dll(ctypes.CDLL(path), SHARE))
        except ValueError:
            continue
    if not found:
        raise SystemExit(f"thread_shares: no loaded gmc kernel library exports {SHARE} ({libraries})")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    row_arguments(parser, "lowered")
    parser.add_argument("--shares", type=float, nargs="+", default=[0.44, 0.47, 0.5, 0.53, 0.56],
                        help="thread 1's shares of each split decode product (thread 0 takes the rest)")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--calls", type=int, default=200, help="steps a share and round")
    parser.add_argument("--record", default=None, help="keep the run as record NAME (bench/results/thread_shares.json)")
    args = parser.parse_args()
    outside = [share for share in args.shares if not 0 < share < 1]
    if outside:
        parser.error(f"--shares {outside[0]}: a share lies strictly between 0 and 1")
    if args.rounds < 2:
        parser.error(f"--rounds {args.rounds}: at least 2 (the first round is dropped)")
    if args.calls < 1:
        parser.error(f"--calls {args.calls}: at least 1")
    run_as(args.march)
    if not os.environ.get(ENV_COPY):
        root = edited_copy(Path(args.scratch))
        env = {**os.environ, ENV_COPY: str(root),
               "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    measure(args)


def measure(args) -> None:
    import torch
    from bench_decode import load
    from bench_demo_spread import host_entry
    from records import save_record

    import gmc
    from gmc.graph.decode import KVCache

    if not Path(gmc.__file__).is_relative_to(os.environ[ENV_COPY]):
        raise SystemExit(f"thread_shares: gmc imported from {gmc.__file__}, not the edited copy")
    model = load("smollm2-135m")[0]
    args.tokens = 1
    step = steps(args, model)["prefill"]  # one token from an empty cache: the decode products
    torch.set_num_threads(2)
    variables = share_variables()
    ids = torch.randint(0, model.config.vocab_size, (1, 1), generator=torch.Generator().manual_seed(1))
    cache = KVCache.empty(model.config, 8, torch.float32)
    medians: dict[float, list[float]] = {share: [] for share in args.shares}
    with torch.no_grad():
        for r in range(args.rounds):
            for share in args.shares if r % 2 == 0 else args.shares[::-1]:
                for variable in variables:
                    variable.value = share
                times = []
                for _ in range(args.calls):
                    start = time.perf_counter()
                    step(ids, torch.tensor(0), cache.keys, cache.values)
                    times.append(time.perf_counter() - start)
                if r:
                    medians[share].append(statistics.median(times) * 1e3)
    best = min(statistics.median(m) for m in medians.values())
    rows = []
    for share, values in medians.items():
        ms = statistics.median(values)
        rows.append({"share": share, "median_ms": ms, "min_ms": min(values), "max_ms": max(values),
                     "x_best": best / ms})
        print(f"thread 1's share {share:.2f}: {ms:.3f} ms (rounds {min(values):.3f}-{max(values):.3f}), "
              f"{best / ms:.2f}x the fastest share")
    if args.record:
        command = shlex.join(["python", "bench/thread_shares.py", *sys.argv[1:]])
        save_record("thread_shares", {
            "name": args.record, "bench": "bench/thread_shares.py",
            "title": title(args),
            "command": command, "host": host_entry(2), "columns": COLUMNS, "rows": rows,
            "notes": [f"Medians of {args.rounds - 1} interleaved rounds of {args.calls} steps a share (the first "
                      "dropped); share: thread 1's part of each split decode product's kept weights, thread 0 "
                      "(the calling thread) takes the rest; 0.50 is what gmc runs."]})


def title(args) -> str:
    masks = " (random 1x256 masks at 50%)" if args.row == "lowered" else ""
    return (f"Two threads' shares of a one-token step, SmolLM2-135M {args.row} {args.quantize}{masks}, "
            f"gmc kernel -march={args.march}")


COLUMNS = [{"key": "share", "title": "thread 1's share", "format": "{:.2f}"},
           {"key": "median_ms", "title": "step ms (median)", "format": "{:.3f}"},
           {"key": "min_ms", "title": "min", "format": "{:.3f}"},
           {"key": "max_ms", "title": "max", "format": "{:.3f}"},
           {"key": "x_best", "title": "x fastest share", "format": "{:.2f}x"}]


if __name__ == "__main__":
    main()
