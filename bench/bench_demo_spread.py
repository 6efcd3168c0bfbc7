"""The main job's GroupMask run over seeds and instruction sets: how far its held-out perplexity moves.

    python bench/bench_demo_spread.py                        # seeds 42 1 2, native and AVX2, the demo's recipe
    python bench/bench_demo_spread.py --seeds 42 --isas avx2 --steps 200 --record demo-spread-200

Each run is ``scripts/demo.sh``'s GroupMask command (1x64 at 50%, bundled calibration text, 256
sequences of ``--seq-len`` tokens, ``--steps`` steps) with ``--seed``, then ``gmc eval`` on the
bundled held-out text in 512-token windows, both in a child process. ``avx2`` runs the children with
torch, MKL and oneDNN held to AVX2 (``host.AVX2_ENV``), as an AVX2-only host runs them; ``native``
as this host does. The record (``bench/results/demo_spread.json``) holds every run's perplexity,
wall and CPU seconds, and the spread: the median, the range, and the largest distance from the
median in percent.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from host import AVX2_ENV, copy_bandwidth_gbs, host
from records import save_record

ISAS = {"native": {}, "avx2": AVX2_ENV}


def run(command: list[str], env: dict) -> tuple[float, float]:
    """Wall and CPU seconds (children's user + system) of ``command``; exits on its failure."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    result = subprocess.run(command, env=env)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode:
        sys.exit(f"failed ({result.returncode}): {' '.join(command)}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def seed_runs(isas: list[str], seeds: list[int], root: Path):
    """``(isa, seed, env, out)`` of every run of a study: each ISA's environment, each seed's directory."""
    for isa in isas:
        env = {**os.environ, **ISAS[isa]}
        for seed in seeds:
            yield isa, seed, env, root / f"{isa}-seed{seed}"


def demo_prune(seed: int, steps: int, seq_len: int, out: Path, extra: list[str]) -> list[str]:
    """``gmc prune``'s arguments for the demo's GroupMask run (without the leading ``gmc``)."""
    return ["prune", "smollm2-135m", "--method", "groupmask", "--sparsity", "0.5", "--group", "1x64", "--calib",
            "bundled", "--seq-len", str(seq_len), "--nsamples", "256", "--steps", str(steps), "--seed", str(seed),
            "-o", str(out), "--overwrite", "--quiet", *extra]


def host_entry(threads: int) -> dict:
    """A record's host: the machine, and its copy bandwidth on 1 and ``threads`` threads measured now."""
    return {**host(), "copy_gbps": [round(copy_bandwidth_gbs(t), 1) for t in (1, threads)], "threads": [1, threads]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 1, 2])
    parser.add_argument("--isas", nargs="+", default=list(ISAS), choices=list(ISAS))
    parser.add_argument("--steps", type=int, default=110, help="the demo's STEPS")
    parser.add_argument("--seq-len", type=int, default=128, help="the demo's SEQ_LEN")
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[],
                        help="more gmc prune options, after everything else (a recipe to compare)")
    parser.add_argument("--out", type=Path, default=Path("runs/demo_spread"))
    parser.add_argument("--record", default="demo-spread", help="the record's name in bench/results/demo_spread.json")
    args = parser.parse_args()
    threads = int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1))
    rows = []
    for isa, seed, env, out in seed_runs(args.isas, args.seeds, args.out):
        learn_wall, learn_cpu = run(["gmc", *demo_prune(seed, args.steps, args.seq_len, out, args.extra)], env)
        run(["gmc", "eval", str(out), "--ppl", "bundled-heldout", "--seq-len", "512", "-o",
             str(out / "eval.json"), "--overwrite"], env)
        ppl = json.loads((out / "eval.json").read_text())["models"][-1]["perplexity"]
        rows.append({"isa": isa, "seed": seed, "perplexity": ppl, "learn_wall_s": learn_wall,
                     "learn_cpu_s": learn_cpu})
        print(f"{isa} seed {seed}: held-out ppl {ppl:.2f}; learning {learn_wall:.0f} s wall, "
              f"{learn_cpu:.0f} CPU s", flush=True)
    ppls = [row["perplexity"] for row in rows]
    median = statistics.median(ppls)
    worst = max(abs(p - median) / median for p in ppls)
    for row in rows:
        row["from_median"] = row["perplexity"] / median - 1
    summary = (f"median {median:.2f}, range {min(ppls):.2f}-{max(ppls):.2f}, every run within "
               f"{100 * worst:.0f}% of the median ({len(rows)} runs)")
    print(summary)
    record = {"name": args.record, "bench": "bench/bench_demo_spread.py",
              "title": f"The demo's GroupMask run ({args.steps} steps x {args.seq_len} tokens"
                       f"{', ' + ' '.join(args.extra) if args.extra else ''}) over seeds and ISAs",
              "command": " ".join(["python bench/bench_demo_spread.py", *sys.argv[1:]]),
              "host": host_entry(threads),
              "columns": [{"key": "isa", "title": "ISA"}, {"key": "seed", "title": "seed"},
                          {"key": "perplexity", "title": "held-out ppl", "format": "{:.2f}"},
                          {"key": "from_median", "title": "vs median", "format": "{:+.0%}"},
                          {"key": "learn_wall_s", "title": "learning s", "format": "{:.0f}"},
                          {"key": "learn_cpu_s", "title": "learning CPU s", "format": "{:.0f}"}],
              "rows": rows,
              "notes": [summary + ". 1x64 at 50%, bundled calibration text (256 sequences), held-out perplexity "
                        "in 512-token windows; avx2: torch, MKL and oneDNN held to AVX2 in both children."]}
    print(f"record: {save_record('demo_spread', record)}")


if __name__ == "__main__":
    main()
