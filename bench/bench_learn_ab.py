"""Mask-learning throughput and quality of ``gmc prune`` options against a reference tree, in one run.

Every arm runs one ``gmc prune`` command, the baseline (GroupMask, bundled SmolLM2-135M, bundled
text, same seed, same blocks, same steps), in its own process: the reference arm from a git worktree
of ``--baseline REV`` (a step no option of this tree selects), the others from this tree, each with
the options of one ``--candidate-args`` (none: the baseline itself) and named by them. The arms
alternate (A B A B ...) so that host drift shows up in the spread.
Per arm: training tokens per second from the run's own log (the learning loop alone), the
process's wall and CPU seconds, and the held-out perplexity of its masks, evaluated by this
tree's ``gmc eval`` for every arm. Writes ``bench/results/learning_ab.json``.

``--marginal`` also runs every arm for ``--steps`` / 2 steps (at least one pass over the blocks)
and reports the steady step: the CPU seconds the second half of the steps added, and the tokens
per CPU-second that gives. Loading, tracing, a compiled step's compile and filling the teacher
cache all fall in the first half, so that column compares the learning steps alone.

    OMP_NUM_THREADS=2 python bench/bench_learn_ab.py --baseline REV --steps 130 --nsamples 64 \
        --candidate-args "" --candidate-args "--compile-step on"
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from host import copy_bandwidth_gbs, host
from records import write_record

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = "reference tree"  # the arm run from the worktree of --baseline


def worktree(revision: str, parent: Path) -> Path:
    path = parent / f"baseline-{revision}"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), revision], check=True,
                   capture_output=True)
    return path


def child_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def prune_args(args, steps: int, out: str) -> list[str]:
    """The baseline ``gmc prune`` arguments: what every arm runs, before its own options."""
    return ["prune", "smollm2-135m", "--method", "groupmask", "--group", args.group, "--sparsity", "0.5", "--calib",
            "bundled", "--seq-len", str(args.seq_len), "--nsamples", str(args.nsamples), "--steps", str(steps),
            "--checkpoint-every", str(steps), "--seed", str(args.seed), "-o", out, "--quiet"]


def prune(tree: Path, out: Path, args, extra: list[str], steps: int) -> dict:
    command = [sys.executable, "-m", "gmc", *prune_args(args, steps, str(out)), *extra]
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": str(args.threads)}
    cpu, start = child_cpu_seconds(), time.perf_counter()
    subprocess.run(command, env=env, check=True, cwd=tree)
    wall, cpu = time.perf_counter() - start, child_cpu_seconds() - cpu
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    tok_per_s = log[-1]["tok_per_s"]  # the loop's own rate up to its last step, before the final checkpoint
    return {"wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "tok_per_s": tok_per_s, "final_kd": log[-1]["kd"],
            "training_s": round(steps * args.seq_len / tok_per_s, 1)}


def heldout(outputs: list[Path], threads: int) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "eval.json"
        subprocess.run([sys.executable, "-m", "gmc", "eval", "smollm2-135m", *map(str, outputs), "--ppl",
                        "bundled-heldout", "--seq-len", "512", "-o", str(result)],
                       env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads)}, check=True)
        return [m["perplexity"] for m in json.loads(result.read_text())["models"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="revision whose tree the reference arm runs")
    parser.add_argument("--steps", type=int, default=130)
    parser.add_argument("--nsamples", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--group", default="1x64")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each arm, alternated")
    parser.add_argument("--candidate-args", action="append", default=None,
                        help="extra gmc prune options of one arm of this tree; repeat for more arms [default: one "
                             "arm with none]")
    parser.add_argument("--marginal", action="store_true",
                        help="also run every arm for half the steps: the steady step's tokens per CPU-second")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "learning_ab.json"))
    args = parser.parse_args()
    half = max(args.steps // 2, args.nsamples + 1)  # past the first pass: the teacher cache is full
    if args.marginal and half >= args.steps:
        parser.error(f"--marginal needs --steps above 2 x --nsamples + 2 ({args.steps} steps, {args.nsamples} blocks)")

    copy = [round(copy_bandwidth_gbs(t), 1) for t in (1, 2)]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        baseline = worktree(args.baseline, tmp)
        try:
            arms = {REFERENCE: (baseline, [])}
            for extra in args.candidate_args or [""]:
                arms[shlex.join(shlex.split(extra)) or "baseline"] = (ROOT, shlex.split(extra))
            runs: dict[str, list[dict]] = {name: [] for name in arms}
            for repeat in range(args.repeats):
                for index, (name, (tree, extra)) in enumerate(arms.items()):
                    out = tmp / f"arm{index}-{repeat}"
                    runs[name].append({**prune(tree, out, args, extra, args.steps), "output": out})
                    if args.marginal:
                        short = prune(tree, tmp / f"arm{index}-{repeat}-half", args, extra, half)
                        runs[name][-1]["step_cpu_s"] = (runs[name][-1]["cpu_s"] - short["cpu_s"]) / (args.steps - half)
                    print(name, runs[name][-1], flush=True)
            ppl = heldout([runs[name][0]["output"] for name in arms], args.threads)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(baseline)], check=False)
    rows = [{"arm": "dense", "held_out_ppl": ppl[0]}]
    for (name, results), value in zip(runs.items(), ppl[1:]):
        rows.append({"arm": name,
                     "tok_per_s": statistics.median(r["tok_per_s"] for r in results),
                     "training_s": statistics.median(r["training_s"] for r in results),
                     "wall_s": statistics.median(r["wall_s"] for r in results),
                     "cpu_s": statistics.median(r["cpu_s"] for r in results),
                     "held_out_ppl": value, "runs": len(results)})
        if args.marginal:
            rows[-1]["step_cpu_s"] = statistics.median(r["step_cpu_s"] for r in results)
            rows[-1]["step_tok_per_cpu_s"] = args.seq_len / rows[-1]["step_cpu_s"]
    speedups = "; ".join(f"{row['arm']}: {row['tok_per_s'] / rows[1]['tok_per_s']:.2f}x tokens/s, "
                         f"{rows[1]['cpu_s'] / row['cpu_s']:.2f}x less process CPU"
                         + (f", {row['step_tok_per_cpu_s'] / rows[1]['step_tok_per_cpu_s']:.2f}x tokens per CPU-second "
                            "of the steady step" if args.marginal else "") for row in rows[2:])
    record = {
        "name": "learning-ab-steady" if args.marginal else "learning-ab",
        "title": f"Mask learning, gmc prune options against the {REFERENCE}: GroupMask {args.group} 50%, bundled "
                 f"SmolLM2-135M, {args.steps} steps x {args.seq_len} tokens on {args.nsamples} blocks",
        "bench": "bench/bench_learn_ab.py",
        "command": f"OMP_NUM_THREADS={args.threads} python bench/bench_learn_ab.py {shlex.join(sys.argv[1:])}",
        "host": {**host(), "copy_gbps": copy, "threads": args.threads},
        "columns": [{"key": "arm", "title": "arm"},
                    {"key": "tok_per_s", "title": "training tok/s", "format": "{:.1f}"},
                    {"key": "training_s", "title": "learning loop s", "format": "{:.0f}"},
                    {"key": "wall_s", "title": "process wall s", "format": "{:.0f}"},
                    {"key": "cpu_s", "title": "process CPU s", "format": "{:.0f}"},
                    *([{"key": "step_cpu_s", "title": "steady step CPU s", "format": "{:.2f}"},
                       {"key": "step_tok_per_cpu_s", "title": "steady tokens / CPU-s", "format": "{:.1f}"}]
                      if args.marginal else []),
                    {"key": "held_out_ppl", "title": "held-out ppl", "format": "{:.2f}"}],
        "rows": rows,
        "notes": [f"baseline: `OMP_NUM_THREADS={args.threads} gmc {shlex.join(prune_args(args, args.steps, 'DIR'))}`; "
                  f"each other arm of this tree adds the options it is named by; the {REFERENCE} runs the baseline "
                  f"command on the tree of --baseline.",
                  f"Against the {REFERENCE}: {speedups} (medians of {args.repeats} alternated run(s) per arm); same "
                  f"seed, blocks and steps, so every arm saw the same tokens.",
                  "Held-out perplexity: bundled-heldout, 512-token windows, evaluated by this tree's gmc eval for "
                  "every arm."]
                 + ([f"Steady step: (process CPU of the {args.steps}-step run - that of a {half}-step run) / "
                     f"{args.steps - half} steps; same seed, so those are the longer run's last steps."]
                    if args.marginal else []),
    }
    write_record(Path(args.out), record)  # the file's other records stay
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
