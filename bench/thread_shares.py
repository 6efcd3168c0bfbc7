"""Are two threads' equal shares of a decode step balanced? One compiled row's one-token step, timed
with the second thread's share of every split decode product set in turn, interleaved in one process.

    python bench/thread_shares.py --row lowered --quantize int4 --march x86-64-v3
    python bench/thread_shares.py --row dense --quantize int8 --march x86-64-v3 --record NAME
    python bench/thread_shares.py --march x86-64-v3 --time-shares      # each share timed, by layer width

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

``--time-shares`` asks the other question, where a uniform shift of every cut cannot help (one kind
of layer slow on its second share, another not): the copy's ``stream_split`` also times each of
its two shares and the calling thread's wait at the join (TIMING_EDITS), the step runs at the
kernel's own cuts, and the bench prints each share's mean microseconds a call by the layer's output
width, and the wait a step. To time an older kernel, put a ``git archive`` of that revision's
``gmc`` first on ``PYTHONPATH``: the copy is made from the ``gmc`` imported.
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


# [16][5] int64: d_out, calls, share 0 ns, share 1 ns, thread 0's wait ns; 16 output widths at most (a
# model with more: the widths past the 16th are not timed, and time_shares says so)
TIMES = "gmc_bench_share_times"
# (original, edited) in gmc/kernels/group_sparse_core.h: every two-thread decode product times its two
# shares (steady_clock around each) and the calling thread's wait from the end of its share to the
# join, summed per output width d_out in TIMES
TIMING_EDITS = [
    ("template <class V, class Host>\nbool stream_split(",
     f'extern "C" {{ __attribute__((visibility("default"))) int64_t {TIMES}[16][5] = {{}}; }}\n'
     "inline int64_t bench_now() {\n"
     "  return std::chrono::duration_cast<std::chrono::nanoseconds>(\n"
     "      std::chrono::steady_clock::now().time_since_epoch()).count();\n"
     "}\n"
     "template <class V, class Host>\nbool stream_split("),
    ("  host.parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {\n"
     "    for (int64_t p = p0; p < p1 && !bad.load(std::memory_order_relaxed); ++p) {\n"
     "      float* y = split_output(yp, partial, p, T, d_out, bp);\n"
     "      if (!stream_share(blocks, total, p, P, xp, T, d_in, y, d_out, values_end, capacity, exact))\n"
     "        bad.store(true, std::memory_order_relaxed);\n"
     "    }\n"
     "  });\n",
     "  int64_t bench_t[2][2] = {};\n"
     "  host.parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {\n"
     "    for (int64_t p = p0; p < p1 && !bad.load(std::memory_order_relaxed); ++p) {\n"
     "      const int64_t bench_start = bench_now();\n"
     "      float* y = split_output(yp, partial, p, T, d_out, bp);\n"
     "      if (!stream_share(blocks, total, p, P, xp, T, d_in, y, d_out, values_end, capacity, exact))\n"
     "        bad.store(true, std::memory_order_relaxed);\n"
     "      if (p < 2) bench_t[p][0] = bench_start, bench_t[p][1] = bench_now();\n"
     "    }\n"
     "  });\n"
     "  const int64_t bench_join = bench_now();\n"
     f"  for (int64_t* c : {TIMES})\n"
     "    if (P == 2 && (c[1] == 0 || c[0] == d_out)) {\n"
     "      c[0] = d_out, c[1] += 1, c[2] += bench_t[0][1] - bench_t[0][0], c[3] += bench_t[1][1] - bench_t[1][0];\n"
     "      c[4] += bench_join - bench_t[0][1];\n"
     "      break;\n"
     "    }\n"),
    ("#include <atomic>\n", "#include <atomic>\n#include <chrono>\n"),
]


def apply_edits(source: Path, edits: list) -> None:
    """Each (original, edited) pair of ``edits`` applied to ``source``, each original found exactly once."""
    text = source.read_text()
    for old, new in edits:
        if text.count(old) != 1:
            raise SystemExit(f"{Path(sys.argv[0]).name}: the kernel source changed ({old.strip()!r} not found once "
                             f"in {source.name}); update the bench's edits")
        text = text.replace(old, new)
    source.write_text(text)


def run_on_edited_copy(scratch: Path, name: str, env_copy: str, edits: dict[str, list]) -> None:
    """Unless this process already runs on it (``env_copy`` set): copy the imported gmc package to
    ``scratch/name``, apply ``edits`` ({file in gmc/kernels: [(original, edited)]}) there, and re-run
    this script (same arguments) with that copy first on PYTHONPATH and ``env_copy`` naming it."""
    if os.environ.get(env_copy):
        return
    import gmc

    root = scratch / name
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(Path(gmc.__file__).parent, root / "gmc", ignore=shutil.ignore_patterns("__pycache__"))
    for file, file_edits in edits.items():
        apply_edits(root / "gmc" / "kernels" / file, file_edits)
    env = {**os.environ, env_copy: str(root),
           "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def check_edited_copy(env_copy: str) -> None:
    """Exits unless gmc was imported from the copy ``env_copy`` names."""
    import gmc

    if not Path(gmc.__file__).is_relative_to(os.environ[env_copy]):
        raise SystemExit(f"{Path(sys.argv[0]).name}: gmc imported from {gmc.__file__}, not the edited copy")


def share_variables(name: str = SHARE, kind=ctypes.c_double) -> list:
    """Variable ``name`` (a ``kind``) in every gmc CPU kernel library this process has loaded."""
    libraries = sorted({line.split()[-1] for line in open("/proc/self/maps")
                        if "gmc_cpu_group_sparse" in line and line.rstrip().endswith(".so")})
    found = []
    for path in libraries:
        try:
            found.append(kind.in_dll(ctypes.CDLL(path), name))
        except ValueError:
            continue
    if not found:
        raise SystemExit(f"thread_shares: no loaded gmc kernel library exports {name} ({libraries})")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    row_arguments(parser, "lowered")
    parser.add_argument("--shares", type=float, nargs="+", default=[0.44, 0.47, 0.5, 0.53, 0.56],
                        help="thread 1's shares of each split decode product (thread 0 takes the rest)")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--calls", type=int, default=200, help="steps a share and round")
    parser.add_argument("--record", default=None, help="keep the run as record NAME (bench/results/thread_shares.json)")
    parser.add_argument("--time-shares", action="store_true",
                        help="instead: time each of the two shares of every split decode product at the kernel's "
                             "own cut, and the calling thread's wait at the join, by output width")
    args = parser.parse_args()
    outside = [share for share in args.shares if not 0 < share < 1]
    if outside:
        parser.error(f"--shares {outside[0]}: a share lies strictly between 0 and 1")
    if args.rounds < 2:
        parser.error(f"--rounds {args.rounds}: at least 2 (the first round is dropped)")
    if args.calls < 1:
        parser.error(f"--calls {args.calls}: at least 1")
    run_as(args.march)
    # the copy's decode cuts read SHARE; with --time-shares its two-thread decode products also time
    # their shares into TIMES
    edits = {"group_sparse_products.h": EDITS} | ({"group_sparse_core.h": TIMING_EDITS} if args.time_shares else {})
    run_on_edited_copy(Path(args.scratch), "gmc-thread-shares", ENV_COPY, edits)
    if args.time_shares:
        time_shares(args)
    else:
        measure(args)


def time_shares(args) -> None:
    """The compiled one-token step at the kernel's own cuts, ``--rounds`` rounds of ``--calls`` steps (the
    first round dropped): per output width, each share's mean microseconds a call and the calling thread's
    wait at the join, from the timers the edited copy adds (TIMING_EDITS)."""
    step = one_token_step(args)
    tables = share_variables(TIMES, (ctypes.c_int64 * 5) * 16)
    times = []
    for r in range(args.rounds):
        if r == 1:
            for table in tables:
                ctypes.memset(table, 0, ctypes.sizeof(table))
        for _ in range(args.calls):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
    steps_timed = (args.rounds - 1) * args.calls
    rows = []
    for table in tables:
        for d_out, calls, first, second, wait in table:
            if not calls:
                continue
            rows.append({"d_out": d_out, "calls_per_step": calls / steps_timed, "share0_us": first / calls / 1e3,
                         "share1_us": second / calls / 1e3, "second_over_first": second / max(first, 1),
                         "wait_us": wait / calls / 1e3, "wait_us_per_step": wait / steps_timed / 1e3})
    rows.sort(key=lambda row: row["d_out"])
    if any(all(entry[1] for entry in table) for table in tables):
        print("thread_shares: 16 output widths filled the timers' table; any further width was not timed")
    step_ms = statistics.median(times[args.calls:]) * 1e3
    for row in rows:
        print(f"d_out {row['d_out']:6d}: {row['calls_per_step']:.0f} a step, share 0 {row['share0_us']:.2f} us, "
              f"share 1 {row['share1_us']:.2f} us ({row['second_over_first']:.2f}x), thread 0 waits "
              f"{row['wait_us']:.2f} us a call")
    print(f"step {step_ms:.3f} ms (median; timers in); thread 0 waits "
          f"{sum(row['wait_us_per_step'] for row in rows):.1f} us a step at the joins")
    if args.record:
        keep(args, title(args).replace("Two threads' shares of", "Each share of the two-thread decode products in"),
             TIME_COLUMNS, rows,
             f"{args.rounds - 1} rounds of {args.calls} one-token steps (the first round dropped), step "
             f"{step_ms:.3f} ms median with the timers in; share 0 runs on the calling thread, share 1 on the "
             "worker; wait: from the end of the calling thread's share to the join.")


def one_token_step(args):
    """The row's compiled one-token step from an empty cache (the decode products), on two threads, as a
    call of no arguments."""
    import torch
    from bench_decode import load

    from gmc.graph.decode import KVCache

    check_edited_copy(ENV_COPY)
    model = load("smollm2-135m")[0]
    args.tokens = 1
    step = steps(args, model)["prefill"]
    torch.set_num_threads(2)
    ids = torch.randint(0, model.config.vocab_size, (1, 1), generator=torch.Generator().manual_seed(1))
    cache = KVCache.empty(model.config, args.tokens + 8, torch.float32)  # as steps() compiles it
    torch.set_grad_enabled(False)  # for the rest of this bench's process
    return lambda: step(ids, torch.tensor(0), cache.keys, cache.values)


def keep(args, title_text: str, columns: list, rows: list, note: str) -> None:
    """The run as record ``--record`` of bench/results/thread_shares.json, with the host measured now."""
    from bench_demo_spread import host_entry
    from records import save_record

    save_record("thread_shares", {
        "name": args.record, "bench": "bench/thread_shares.py", "title": title_text,
        "command": shlex.join(["python", "bench/thread_shares.py", *sys.argv[1:]]), "host": host_entry(2),
        "columns": columns, "rows": rows, "notes": [note]})


def measure(args) -> None:
    step = one_token_step(args)
    variables = share_variables()
    medians: dict[float, list[float]] = {share: [] for share in args.shares}
    for r in range(args.rounds):
        for share in args.shares if r % 2 == 0 else args.shares[::-1]:
            for variable in variables:
                variable.value = share
            times = []
            for _ in range(args.calls):
                start = time.perf_counter()
                step()
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
        keep(args, title(args), COLUMNS, rows,
             f"Medians of {args.rounds - 1} interleaved rounds of {args.calls} steps a share (the first dropped); "
             "share: thread 1's part of each split decode product's kept weights (int4: of its tiles' cost), "
             "thread 0 (the calling thread) takes the rest; 0.50 is what gmc runs.")


def title(args) -> str:
    masks = " (random 1x256 masks at 50%)" if args.row == "lowered" else ""
    return (f"Two threads' shares of a one-token step, SmolLM2-135M {args.row} {args.quantize}{masks}, "
            f"gmc kernel -march={args.march}")


TIME_COLUMNS = [{"key": "d_out", "title": "d_out"},
                {"key": "calls_per_step", "title": "calls a step", "format": "{:.0f}"},
                {"key": "share0_us", "title": "share 0 us", "format": "{:.2f}"},
                {"key": "share1_us", "title": "share 1 us", "format": "{:.2f}"},
                {"key": "second_over_first", "title": "share 1 / share 0", "format": "{:.2f}x"},
                {"key": "wait_us", "title": "thread 0's wait us a call", "format": "{:.2f}"},
                {"key": "wait_us_per_step", "title": "wait us a step", "format": "{:.1f}"}]

COLUMNS = [{"key": "share", "title": "thread 1's share", "format": "{:.2f}"},
           {"key": "median_ms", "title": "step ms (median)", "format": "{:.3f}"},
           {"key": "min_ms", "title": "min", "format": "{:.3f}"},
           {"key": "max_ms", "title": "max", "format": "{:.3f}"},
           {"key": "x_best", "title": "x fastest share", "format": "{:.2f}x"}]


if __name__ == "__main__":
    main()
