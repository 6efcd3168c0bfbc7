"""Two versions of gmc on one host: the same compiled rows, each built and timed by its own checkout,
in alternating processes.

A figure from another day is no baseline on a host whose copy bandwidth moves 20-40% from run to
run; a committed version is. This bench checks out ``--base`` (``git archive`` into ``--scratch``),
then runs one process per version in turn, ``--rounds`` times: each builds six of
``bench_decode.py``'s rows with its own code (``all_kept`` / ``masks_for`` / ``compiled_row`` of its
own ``bench/bench_decode.py``, so each version lowers, packs, quantizes and compiles its own way) --
dense on gmc's kernel and lowered, each fp32, int8 and int4 (SmolLM2-135M, random 1x256 masks at
50%; the head int8 under int4) -- compiles them once into ``--scratch`` and times them interleaved:
decode steps at positions 32..79 of a 32-token prompt and 256-token prefills, the best median of
three passes per process. Ratios are base ms / head ms (above 1: the working tree is faster), the median over rounds.

    python bench/bench_versions.py --base 671ad47 --threads 1 2 --record native-vs-front
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROWS = ("dense fp32", "lowered fp32", "dense int8", "lowered int8", "dense int4", "lowered int4")
PROMPT, STEPS, PREFILL, MAX_LEN = 32, 48, 256, 264


def child(checkout: Path, scratch: Path, threads: int) -> None:
    """In a process of its own: the rows of ``checkout``'s code, timed; one JSON line on stdout."""
    sys.path.insert(0, str(checkout / "bench"))
    import copy
    import time

    import bench_decode as bd  # the checkout's own
    import torch

    import gmc

    if not Path(gmc.__file__).resolve().is_relative_to(checkout.resolve()):
        raise SystemExit(f"bench_versions: gmc imports from {gmc.__file__}, not from {checkout}")
    from gmc.formats.compiled import load_compiled
    from gmc.graph.decode import KVCache
    from gmc.graph.pipeline import lower
    from gmc.groups import parse_pattern

    model = bd.load("smollm2-135m")[0]
    config, pattern = model.config, parse_pattern("1x256")
    _, packed = lower(model, bd.masks_for(model, pattern, 0.5, None), pattern)
    dense = copy.deepcopy(model)

    def layers(row: str):
        traced, chosen = (dense, bd.all_kept(dense, packed, pattern)) if row.startswith("dense") else (model, packed)
        values = row.split()[1].replace("fp32", "none")
        if values != "none":
            chosen = {name: bd.quantize(layer, values) for name, layer in chosen.items()}
        return traced, chosen, values

    steps = {}
    for row in ROWS:
        label = row.replace(" ", "-")
        if (scratch / label / "compiled").is_dir():
            steps[row] = load_compiled(scratch / label).steps
        else:
            traced, chosen, values = layers(row)
            steps[row] = bd.compiled_row(label, traced, chosen, MAX_LEN, str(scratch), 0, True, quantized=values).steps
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, config.vocab_size, (1, PROMPT), generator=gen)
    long_ids = torch.randint(0, config.vocab_size, (1, PREFILL), generator=gen)
    best = {}
    with torch.no_grad():
        for _ in range(3):
            state, decode, prefill = {}, {row: [] for row in ROWS}, {row: [] for row in ROWS}
            for row in ROWS:
                cache = KVCache.empty(config, MAX_LEN)
                logits = steps[row]["prefill"](prompt, torch.tensor(0), cache.keys, cache.values)
                state[row] = [cache, PROMPT, logits.argmax(-1, keepdim=True)]
            for _ in range(STEPS):
                for row in ROWS:
                    cache, position, token = state[row]
                    start = time.perf_counter()
                    logits = steps[row]["decode"](token, torch.tensor(position), cache.keys, cache.values)
                    decode[row].append(time.perf_counter() - start)
                    state[row][1:] = [position + 1, logits.argmax(-1, keepdim=True)]
            for _ in range(4):
                for row in ROWS:
                    cache = state[row][0]
                    start = time.perf_counter()
                    steps[row]["prefill"](long_ids, torch.tensor(0), cache.keys, cache.values)
                    prefill[row].append(time.perf_counter() - start)
            for row in ROWS:
                for key, times in (("decode", decode[row][2:]), ("prefill", prefill[row][1:])):
                    ms = statistics.median(times) * 1e3
                    best[f"{row}|{key}"] = min(ms, best.get(f"{row}|{key}", ms))
    print(json.dumps(best))


def run_child(checkout: Path, scratch: Path, threads: int) -> dict:
    command = [sys.executable, __file__, "--child", str(checkout), "--scratch", str(scratch),
               "--threads", str(threads)]
    environment = {**os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run(command, capture_output=True, text=True, env=environment, cwd=checkout)
    if done.returncode != 0:
        raise SystemExit(f"bench_versions: {checkout} failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", help="the commit to compare the working tree with")
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    parser.add_argument("--rounds", type=int, default=2, help="processes per version and thread count")
    parser.add_argument("--scratch", default=f"{tempfile.gettempdir()}/gmc-versions",
                        help="where the base is checked out and each version's rows are compiled")
    parser.add_argument("--record", default=None, help="keep the run as record NAME in bench/results/versions.json")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(Path(args.child), Path(args.scratch), args.threads[0])
    if not args.base:
        parser.error("--base COMMIT is required")
    commit = subprocess.run(["git", "rev-parse", "--short", args.base], capture_output=True, text=True, cwd=REPO)
    if commit.returncode != 0:
        parser.error(f"--base {args.base!r} is not a commit of {REPO}")
    base = commit.stdout.strip()
    scratch = Path(args.scratch)
    checkout = scratch / f"checkout-{base}"
    if not checkout.is_dir():
        checkout.mkdir(parents=True)
        archive = subprocess.run(["git", "archive", base], capture_output=True, cwd=REPO, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(checkout)], input=archive, check=True)
    versions = {base: (checkout, scratch / f"rows-{base}"), "working tree": (REPO, scratch / "rows-working-tree")}
    rows = []
    for threads in args.threads:
        times = {name: [] for name in versions}
        for _ in range(args.rounds):
            for name, (tree, rows_dir) in versions.items():
                times[name].append(run_child(tree, rows_dir, threads))
                print(f"{threads} thread(s), {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in times[name][-1].items()),
                      flush=True)
        for key in times[base][0]:
            row, measure = key.split("|")
            ratios = [b[key] / h[key] for b, h in zip(times[base], times["working tree"])]
            rows.append({"threads": threads, "row": row, "measure": measure,
                         "base_ms": statistics.median(t[key] for t in times[base]),
                         "head_ms": statistics.median(t[key] for t in times["working tree"]),
                         "x_base": statistics.median(ratios), "x_min": min(ratios), "x_max": max(ratios)})
            print(f"{threads} thread(s) {row} {measure}: {rows[-1]['base_ms']:.2f} -> {rows[-1]['head_ms']:.2f} ms "
                  f"({rows[-1]['x_base']:.3f}x, rounds {min(ratios):.3f}-{max(ratios):.3f})")
    if args.record:
        sys.path.insert(0, str(REPO / "bench"))
        from bench_demo_spread import host_entry
        from records import save_record

        save_record("versions", {
            "name": args.record, "bench": "bench/bench_versions.py",
            "title": f"gmc at {base} against the working tree, same host, alternating processes (SmolLM2-135M, "
                     "random 1x256 masks at 50%)",
            "command": shlex.join(["python", "bench/bench_versions.py", *sys.argv[1:]]),
            "host": host_entry(max(args.threads)), "base": base,
            "columns": [{"key": "threads", "title": "threads"}, {"key": "row", "title": "row"},
                        {"key": "measure", "title": "decode step or 256-token prefill"},
                        {"key": "base_ms", "title": f"{base}, ms", "format": "{:.2f}"},
                        {"key": "head_ms", "title": "working tree, ms", "format": "{:.2f}"},
                        {"key": "x_base", "title": f"x {base} (median of rounds)", "format": "{:.3f}x"},
                        {"key": "x_min", "title": "lowest round", "format": "{:.3f}x"},
                        {"key": "x_max", "title": "highest round", "format": "{:.3f}x"}],
            "rows": rows})


if __name__ == "__main__":
    main()
