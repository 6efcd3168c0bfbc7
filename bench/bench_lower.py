"""What ``gmc lower`` costs: wall time, process CPU and output size of each lowering of one artifact.

    python bench/bench_lower.py runs/demo/groupmask             # after scripts/demo.sh
    python bench/bench_lower.py ARTIFACT --jobs compile --threads 1

Each job is one ``python -m gmc lower`` subprocess (a cold process: loading the model and the
artifact is part of the cost), run one after the other with ``OMP_NUM_THREADS=--threads``; the CPU
seconds are the subprocess's own (``RUSAGE_CHILDREN``), all its threads. The record (default
``lower``) goes into ``bench/results/lower.json`` with the host and a copy bandwidth measured in
the same run; ``python bench/results_tables.py lower`` renders it.
"""
from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from host import copy_bandwidth_gbs, host
from records import save_record

JOBS = {  # name -> the options after ``gmc lower ARTIFACT -o OUT``, and OUT's name
    "dense": (["--backend", "dense"], "dense"),
    "torch": ([], "torch"),
    "torch-int4": (["--quantize", "int4"], "int4"),
    "onnx": (["--backend", "onnx"], "onnx"),
    "onnx-int4": (["--backend", "onnx", "--quantize", "int4"], "onnx-int4"),
    "onnx-standard-ops": (["--backend", "onnx", "--onnx-standard-ops"], "onnx-standard"),
    "compile": (["--compile", "--max-len", "256"], "compiled"),
}


def _size_mib(path: Path) -> float:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files) / 2**20


def run_job(artifact: str, name: str, scratch: Path, threads: int) -> dict:
    options, out_name = JOBS[name]
    out = scratch / out_name
    command = [sys.executable, "-m", "gmc", "lower", artifact, "-o", str(out), *options]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"bench_lower: {name} failed ({done.returncode}): {last}")
    cpu = (cpu_after.ru_utime - cpu_before.ru_utime) + (cpu_after.ru_stime - cpu_before.ru_stime)
    shown = ["gmc", "lower", artifact, "-o", out_name, *options]
    size = _size_mib(out)
    print(f"{name}: {wall:.1f} s wall, {cpu:.1f} CPU-s, {size:.0f} MiB")
    return {"job": name, "command": " ".join(shown), "wall_s": wall, "cpu_s": cpu, "out_mib": size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", help="a masks artifact directory (gmc prune -o ...)")
    parser.add_argument("--jobs", nargs="+", choices=list(JOBS), default=list(JOBS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--record", default="lower", help="the record's name in bench/results/lower.json")
    args = parser.parse_args()
    if not Path(args.artifact, "manifest.json").is_file():
        parser.error(f"bad artifact {args.artifact}: no manifest.json there (run gmc prune first)")
    copy = [round(copy_bandwidth_gbs(t), 1) for t in (1, 2)]
    with tempfile.TemporaryDirectory(prefix="gmc-bench-lower-") as scratch:
        rows = [run_job(args.artifact, name, Path(scratch), args.threads) for name in args.jobs]
    command = " ".join(["python", "bench/bench_lower.py", *sys.argv[1:]])
    save_record("lower", {
        "name": args.record, "title": f"gmc lower of {args.artifact}, {args.threads} thread(s), one cold process a job",
        "bench": "bench/bench_lower.py", "command": command,
        "host": {**host(), "copy_gbps": copy, "threads": args.threads},
        "columns": [{"key": "job", "title": "job"}, {"key": "command", "title": "command"},
                    {"key": "wall_s", "title": "wall (s)", "format": "{:.1f}"},
                    {"key": "cpu_s", "title": "process CPU (s)", "format": "{:.1f}"},
                    {"key": "out_mib", "title": "output (MiB)", "format": "{:.0f}"}],
        "rows": rows, "notes": []})


if __name__ == "__main__":
    main()
