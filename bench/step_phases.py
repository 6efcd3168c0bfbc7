"""Where a compiled decode step's time goes: one row's step at a fixed position, its phases timed
inside gmc's kernel.

    python bench/step_phases.py --march x86-64-v3                 # lowered int4, position 56, 2 threads
    python bench/step_phases.py --row dense --quantize int8 --record NAME

As ``bench/thread_shares.py`` does, the bench copies the gmc package into ``--scratch``, edits the
copy's kernel (SHIM_EDITS, SPLIT_EDITS; each asserted to apply: a changed kernel fails here, not
silently) and re-runs itself on it. The copy times, with a steady clock summed into an exported
table: every call of the four ops a compiled CPU package makes (their AOTInductor C shims:
group-sparse linear, gated MLP, decode attention, attention block), and inside every split decode
product (``stream_split``; an attention block on several threads runs its products in a region of
its own, which its row holds whole) the calling thread's share, its way from the split's start into that share (the
fork), its wait for the other share at the join, and the partial outputs added. The row (built as
``bench/prefill_loop.py`` builds it, its package shared with that bench) prefills ``--position``
tokens, then runs ``--rounds`` rounds of ``--calls`` one-token steps at that position (each step
writes the same cache slot, so each does the same work; the first round dropped). What lies outside
the four ops (AOTInductor's wrapper and Inductor's kernels, the Python call) is the step's wall
time less theirs. Prints each phase's mean microseconds a step and its share of the step;
``--record NAME`` keeps them as record NAME of bench/results/step_phases.json with the host.
"""
from __future__ import annotations

import argparse
import ctypes
import shlex
import sys
import time
from pathlib import Path

from host import run_as
from prefill_loop import row_arguments, steps
from thread_shares import check_edited_copy, run_on_edited_copy, share_variables

ENV_COPY = "GMC_STEP_PHASES_COPY"  # set in the re-run: the copy's root, on PYTHONPATH
TIMES = "gmc_bench_phases"         # [PHASES][2] int64: calls, nanoseconds
PHASES = ["linear", "gated", "attention", "block", "split", "share", "partials", "fork", "worker_fork", "join"]
SLOT = {name: i for i, name in enumerate(PHASES)}

TIMER = (
    "#include <chrono>\n"
    f'extern "C" {{ __attribute__((visibility("default"))) int64_t {TIMES}[{len(PHASES)}][2] = {{}}; }}\n'
    "inline int64_t bench_now() {\n"
    "  return std::chrono::duration_cast<std::chrono::nanoseconds>(\n"
    "      std::chrono::steady_clock::now().time_since_epoch()).count();\n"
    "}\n"
    f"inline void bench_add(int slot, int64_t ns) {{ {TIMES}[slot][0] += 1; {TIMES}[slot][1] += ns; }}\n"
    "struct BenchScope {\n"
    "  int slot;\n"
    "  int64_t start = bench_now();\n"
    "  ~BenchScope() { bench_add(slot, bench_now() - start); }\n"
    "};\n")


def shim_edit(op: str, phase: str) -> tuple[str, str]:
    call = f"    *out = new_tensor_handle({op}(\n"
    return call, f"    const BenchScope bench_scope{{{SLOT[phase]}}};\n" + call


# (original, edited) in gmc/kernels/cpu_group_sparse.cpp: the timers, and each C shim timed whole
SHIM_EDITS = [
    ('#include "group_sparse_core.h"\n', TIMER + '#include "group_sparse_core.h"\n'),
    shim_edit("group_sparse_linear", "linear"),
    shim_edit("group_sparse_gated_mlp", "gated"),
    shim_edit("decode_attention", "attention"),
    shim_edit("attention_block", "block"),
]
# ... in gmc/kernels/group_sparse_core.h: stream_split's phases (thread 0 calls; thread 1 is the other share)
SPLIT_EDITS = [
    ("  float* partial = thread_scratch(1, (P - 1) * T * d_out);  // [P - 1, T, d_out]\n",
     f"  const BenchScope bench_split{{{SLOT['split']}}};\n"
     "  const int64_t bench_fork = bench_now();\n"
     "  int64_t bench_share_end = 0;\n"
     "  float* partial = thread_scratch(1, (P - 1) * T * d_out);  // [P - 1, T, d_out]\n"),
    ("      float* y = split_output(yp, partial, p, T, d_out, bp);\n",
     "      const int64_t bench_share = bench_now();\n"
     f"      if (p < 2) bench_add(p == 0 ? {SLOT['fork']} : {SLOT['worker_fork']}, bench_share - bench_fork);\n"
     "      float* y = split_output(yp, partial, p, T, d_out, bp);\n"),
    ("        bad.store(true, std::memory_order_relaxed);\n"
     "    }\n"
     "  });\n"
     "  if (bad.load()) return false;\n"
     "  add_partials(yp, partial, P, T * d_out);\n",
     "        bad.store(true, std::memory_order_relaxed);\n"
     f"      if (p == 0) bench_share_end = bench_now(), bench_add({SLOT['share']}, bench_share_end - bench_share);\n"
     "    }\n"
     "  });\n"
     "  if (bad.load()) return false;\n"
     "  const int64_t bench_join = bench_now();\n"
     f"  if (P > 1) bench_add({SLOT['join']}, bench_join - bench_share_end);\n"
     "  add_partials(yp, partial, P, T * d_out);\n"
     f"  bench_add({SLOT['partials']}, bench_now() - bench_join);\n"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    row_arguments(parser, "lowered")
    parser.add_argument("--position", type=int, default=56,
                        help="cache position of the timed step (56: the middle of bench_decode.py's decode steps)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--calls", type=int, default=300, help="steps a round")
    parser.add_argument("--record", default=None, help="keep the run as record NAME (bench/results/step_phases.json)")
    args = parser.parse_args()
    for name, low in (("position", 1), ("threads", 1), ("rounds", 2), ("calls", 1)):
        if getattr(args, name) < low:
            parser.error(f"--{name} {getattr(args, name)}: at least {low}"
                         + (" (the first round is dropped)" if name == "rounds" else ""))
    run_as(args.march)
    run_on_edited_copy(Path(args.scratch), "gmc-step-phases", ENV_COPY,
                       {"cpu_group_sparse.cpp": SHIM_EDITS, "group_sparse_core.h": SPLIT_EDITS})
    rows, step_us = measure(args)
    for row in rows:
        print(f"{row['phase']:<72} {row['us_per_step']:8.1f} us a step  {row['of_step']:5.1f}%"
              + (f"  ({row['calls_per_step']:.0f} calls, {row['us_per_call']:.2f} us each)" if row["calls_per_step"]
                 else ""))
    if args.record:
        from bench_demo_spread import host_entry
        from records import save_record

        save_record("step_phases", {
            "name": args.record, "bench": "bench/step_phases.py",
            "title": f"Where a compiled one-token decode step goes, SmolLM2-135M {args.row} {args.quantize}"
                     + (" (random 1x256 masks at 50%)" if args.row == "lowered" else "")
                     + f", position {args.position}, {args.threads} threads, gmc kernel -march={args.march}",
            "command": shlex.join(["python", "bench/step_phases.py", *sys.argv[1:]]), "host": host_entry(2),
            "columns": COLUMNS, "rows": rows,
            "notes": [f"{args.rounds - 1} rounds of {args.calls} steps (the first round dropped), step "
                      f"{step_us:.0f} us mean with the timers in. The split products' phases are the calling "
                      "thread's (what the step waits for); 'the other thread' phase is not part of the sum."]})


def measure(args) -> tuple[list[dict], float]:
    """The phases' rows (mean microseconds a step) and the mean step in microseconds."""
    import torch
    from bench_decode import load

    from gmc.graph.decode import KVCache

    check_edited_copy(ENV_COPY)
    model = load("smollm2-135m")[0]
    args.tokens = args.position  # the row's prefill program takes the prompt; its cache holds 8 more
    program = steps(args, model)
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    gen = torch.Generator().manual_seed(1)
    cache = KVCache.empty(model.config, args.tokens + 8, torch.float32)
    program["prefill"](torch.randint(0, model.config.vocab_size, (1, args.position), generator=gen),
                       torch.tensor(0), cache.keys, cache.values)
    token = torch.randint(0, model.config.vocab_size, (1, 1), generator=gen)
    tables = share_variables(TIMES, (ctypes.c_int64 * 2) * len(PHASES))
    wall = 0.0
    for r in range(args.rounds):
        if r == 1:
            for table in tables:
                ctypes.memset(table, 0, ctypes.sizeof(table))
            wall = 0.0
        start = time.perf_counter()
        for _ in range(args.calls):
            program["decode"](token, torch.tensor(args.position), cache.keys, cache.values)
        wall += time.perf_counter() - start
    n = (args.rounds - 1) * args.calls
    total = {name: sum(table[SLOT[name]][1] for table in tables) / n / 1e3 for name in PHASES}
    calls = {name: sum(table[SLOT[name]][0] for table in tables) / n for name in PHASES}
    step = wall / n * 1e6
    ops = total["linear"] + total["gated"] + total["attention"] + total["block"]
    split_rest = total["split"] - total["share"] - total["fork"] - total["join"] - total["partials"]
    phases = [
        ("outside gmc's ops: Inductor's kernels, AOTInductor's wrapper, the Python call", step - ops, 0),
        ("gmc's linear, gated-MLP and attention-block ops outside their split products", total["linear"]
         + total["gated"] + total["block"] - total["split"], calls["linear"] + calls["gated"] + calls["block"]),
        ("decode attention (gmc's op)", total["attention"], calls["attention"]),
        ("split products: the calling thread's share", total["share"], calls["share"]),
        ("split products: the calling thread from the split's start into its share", total["fork"], calls["fork"]),
        ("split products: the calling thread waits for the other share", total["join"], calls["join"]),
        ("split products: partial outputs added", total["partials"], calls["partials"]),
        ("split products: the rest", split_rest, 0),
        ("(the other thread from the split's start into its share)", total["worker_fork"], calls["worker_fork"]),
        ("(the attention block ops whole: q/k/v and o products, rope, cache writes, attention)", total["block"],
         calls["block"]),
    ]
    rows = [{"phase": phase, "us_per_step": us, "of_step": 100 * us / step, "calls_per_step": count or None,
             "us_per_call": us / count if count else None} for phase, us, count in phases]
    rows.append({"phase": "the step (wall)", "us_per_step": step, "of_step": 100.0, "calls_per_step": None,
                 "us_per_call": None})
    return rows, step


COLUMNS = [{"key": "phase", "title": "phase"},
           {"key": "us_per_step", "title": "us a step", "format": "{:.1f}"},
           {"key": "of_step", "title": "% of the step", "format": "{:.1f}"},
           {"key": "calls_per_step", "title": "calls a step", "format": "{:.0f}"},
           {"key": "us_per_call", "title": "us a call", "format": "{:.2f}"}]


if __name__ == "__main__":
    main()
