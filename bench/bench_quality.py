"""Quality per compute: held-out perplexity vs CPU-minutes and vs decode speedup.

Every row is a sequence of real ``gmc`` commands (prune, then optionally recover), run as
subprocesses with ``OMP_NUM_THREADS=--threads``; its cost is the process CPU time of those
commands (``getrusage(RUSAGE_CHILDREN)``: load on the machine does not inflate it the way it
inflates wall time). Perplexity: the bundled held-out text, 512-token windows, the artifact
folded into the dense SmolLM2-135M. Decode speedup (``--speed``): the row's own masks lowered to
the group-sparse CPU op vs the same weights dense, interleaved greedy decode, median per token;
N:M rows have no CPU kernel and run at dense speed (1.00x).

    python bench/bench_quality.py --threads 1 --rows sparsegpt-2:4 gm-1x64 --cache runs/quality
    python bench/bench_quality.py --threads 1 --speed --cache runs/quality --out docs/quality.md

Finished rows are cached in CACHE/<key>/row.json (keyed by their commands) and reused.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

BASE = ["smollm2-135m", "--calib", "bundled", "--seq-len", "256", "--quiet"]
HEURISTIC = ["--nsamples", "64"]
RECOVER_STEPS = "200"
NOTES = "<!-- notes: kept by bench/bench_quality.py -->"


@dataclass(frozen=True)
class Row:
    key: str
    label: str
    pattern: str
    sparsity: float
    prune: tuple  # extra `gmc prune` arguments
    recover_from: str | None = None  # key of the row whose artifact `gmc recover` tunes

    def commands(self, cache: Path) -> list[list[str]]:
        out = str(cache / self.key / "artifact")
        if self.recover_from:
            source = str(cache / self.recover_from / "artifact")
            return [["recover", source, "--calib", "bundled", "--seq-len", "256", "--steps", RECOVER_STEPS,
                     "--quiet", "--overwrite", "-o", out]]
        return [["prune", *BASE, "--group", self.pattern, "--sparsity", str(self.sparsity), *self.prune,
                 "--overwrite", "-o", out]]


def _learned(key, label, group, sparsity=0.5, *extra):
    return Row(key, label, group, sparsity, tuple(extra))


ROWS = {r.key: r for r in [
    Row("wanda-2:4", "Wanda 2:4", "2:4", 0.5, ("--method", "wanda", *HEURISTIC)),
    Row("sparsegpt-2:4", "SparseGPT 2:4", "2:4", 0.5, ("--method", "sparsegpt", *HEURISTIC)),
    Row("sparsegpt-2:4-rec", "SparseGPT 2:4 + recovery", "2:4", 0.5, (), recover_from="sparsegpt-2:4"),
    Row("wanda-1x64", "Wanda 1x64, uniform", "1x64", 0.5, ("--method", "wanda", *HEURISTIC)),
    _learned("gm-1x64-paper", "GroupMask, the paper's recipe (penalty, lambda 16, lr 1e-3)", "1x64", 0.5,
             "--recipe", "paper", "--steps", "300"),
    _learned("gm-1x64", "GroupMask (gmc's recipe), 300 steps x 256 tokens", "1x64", 0.5, "--steps", "300"),
    Row("gm-1x64-rec", "GroupMask 300 x 256 + recovery", "1x64", 0.5, (), recover_from="gm-1x64"),
    _learned("gm-1x64-short", "GroupMask (gmc's recipe), 150 steps x 128 tokens", "1x64", 0.5,
             "--steps", "150", "--seq-len", "128"),
    _learned("gm-1x64-short-lowrank", "GroupMask 150 x 128, low-rank head (rank 16)", "1x64", 0.5,
             "--steps", "150", "--seq-len", "128", "--head", "lowrank"),
    Row("gm-1x64-short-rec", "GroupMask 150 x 128 + recovery", "1x64", 0.5, (), recover_from="gm-1x64-short"),
    _learned("gm-1x64-prior", "GroupMask, Wanda prior", "1x64", 0.5, "--steps", "300", "--init", "wanda"),
    _learned("gm-1x256", "GroupMask", "1x256", 0.5, "--steps", "300"),
    Row("gm-1x256-rec", "GroupMask + recovery", "1x256", 0.5, (), recover_from="gm-1x256"),
    _learned("gm-32x32", "GroupMask", "32x32", 0.5, "--steps", "300"),
    _learned("gm-1x256-40", "GroupMask", "1x256", 0.4, "--steps", "300"),
    Row("gm-1x256-40-rec", "GroupMask + recovery", "1x256", 0.4, (), recover_from="gm-1x256-40"),
    _learned("gm-1x256-30", "GroupMask", "1x256", 0.3, "--steps", "300"),
    Row("gm-1x256-30-rec", "GroupMask + recovery", "1x256", 0.3, (), recover_from="gm-1x256-30"),
    *[_learned(f"gm-{group}-{int(s * 100)}-short", "GroupMask 150 x 128", group, s,
               "--steps", "150", "--seq-len", "128")
      for group, s in [("1x256", 0.5), ("1x256", 0.4), ("1x256", 0.3), ("32x32", 0.5)]],
    *[Row(f"sparsegpt-1x256-{int(s * 100)}", "SparseGPT, uniform", "1x256", s, ("--method", "sparsegpt", *HEURISTIC))
      for s in (0.5, 0.4, 0.3)],
    Row("gm-1x256-50-short-rec", "GroupMask 150 x 128 + recovery", "1x256", 0.5, (), recover_from="gm-1x256-50-short"),
]}


def run_row(row: Row, cache: Path, threads: int, rows: dict) -> dict:
    path = cache / row.key / "row.json"
    commands = row.commands(cache)
    if path.exists():
        cached = json.loads(path.read_text())
        if cached["commands"] == commands:
            return cached
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    cpu, wall = 0.0, 0.0
    for argv in commands:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "gmc", *argv], env=env, capture_output=True, text=True)
        wall += time.perf_counter() - started
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu += (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        if done.returncode != 0:
            raise SystemExit(f"{row.key}: gmc {shlex.join(argv)} failed:\n{done.stderr[-2000:]}")
    base_cpu = rows[row.recover_from]["cpu_s_total"] if row.recover_from else 0.0
    result = {"key": row.key, "commands": commands, "cpu_s": round(cpu, 1), "wall_s": round(wall, 1),
              "cpu_s_total": round(cpu + base_cpu, 1)}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    return result


def evaluate_row(row: Row, result: dict, cache: Path, loaded) -> dict:
    if "ppl" in result:
        return result
    from gmc.formats.artifact import load_artifact
    from gmc.runtime.evaluate import perplexity

    artifact = load_artifact(cache / row.key / "artifact")
    model = artifact.apply_to(copy.deepcopy(loaded.model), check_fingerprint=False)
    ppl = perplexity(model, loaded.tokenizer, "bundled-heldout", seq_len=512, progress=False)
    manifest = artifact.manifest
    result.update(ppl=ppl.perplexity, sparsity=manifest["global_sparsity"],
                  trained=manifest.get("trained_sparsity"), moved=bool(manifest.get("export_thresholds_moved")))
    (cache / row.key / "row.json").write_text(json.dumps(result, indent=1))
    return result


def speed_row(row: Row, result: dict, cache: Path, loaded, new_tokens: int) -> dict:
    if "decode_speedup" in result:
        return result
    if ":" in row.pattern:
        result["decode_speedup"] = 1.0  # no N:M CPU kernel: the model runs dense
    else:
        sys.path.insert(0, str(Path(__file__).parent))
        from bench_decode import interleaved_decode

        from gmc.formats.artifact import load_artifact
        from gmc.graph.pipeline import pack_targets
        from gmc.kernels.linear import swap_group_sparse_linears

        artifact = load_artifact(cache / row.key / "artifact")
        dense = artifact.apply_to(copy.deepcopy(loaded.model), check_fingerprint=False)
        lowered = swap_group_sparse_linears(copy.deepcopy(dense), pack_targets(dense, artifact.masks, artifact.pattern))
        prompt = torch.randint(0, dense.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
        times = interleaved_decode({"dense": dense, "lowered": lowered}, prompt, new_tokens)
        result["decode_speedup"] = times["dense"] / times["lowered"]
    (cache / row.key / "row.json").write_text(json.dumps(result, indent=1))
    return result


def markdown(rows: list[tuple[Row, dict]], dense_ppl: float, command: str, threads: int) -> str:
    lines = [
        "# Quality per compute on the bundled SmolLM2-135M",
        "",
        f"Command: `{command}`",
        "",
        "Protocol: calibration `bundled` (256-token blocks; heuristics and SparseGPT 64 blocks, learned runs all "
        "256 blocks), held-out perplexity on `bundled-heldout` (512-token windows). CPU-min = process CPU time "
        f"of the gmc commands of the row (recovery rows include their source run), OMP_NUM_THREADS={threads}. "
        "Decode speedup: the row's masks lowered to the group-sparse CPU op vs the same weights dense "
        "(greedy, KV cache, median ms/token, interleaved); 2:4 has no CPU kernel and runs dense.",
        "",
        f"Dense: {dense_ppl:.2f}.",
        "",
        "| row | pattern | sparsity | held-out ppl | CPU-min | decode speedup | training sparsity |",
        "|---|---|---|---|---|---|---|",
    ]
    for row, r in rows:
        speed = f"{r['decode_speedup']:.2f}x" if "decode_speedup" in r else "-"
        trained = f"{r['trained']:.3f}" if r.get("trained") is not None else ""
        trained += " (moved)" if r.get("moved") else ""
        lines.append(f"| {row.label} | {row.pattern} | {r['sparsity']:.3f} | {r['ppl']:.2f} | "
                     f"{r['cpu_s_total'] / 60:.1f} | {speed} | {trained} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[tuple[Row, dict]], dense_ppl: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("cpu_s_total", "CPU-minutes (prune + recover)"),
              ("decode_speedup", "decode speedup vs dense (lowered, CPU)")]
    panels = [p for p in panels if any(p[0] in r for _, r in rows)]  # no speed column without --speed
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.8), squeeze=False)
    for axis, (x_key, x_label) in zip(axes[0], panels):
        points = [(r[x_key] / (60 if x_key == "cpu_s_total" else 1), r["ppl"], row) for row, r in rows if x_key in r]
        for x, y, row in points:
            axis.scatter(x, y, marker="s" if ":" in row.pattern else "o")
            axis.annotate(f"{row.key}", (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        front = _pareto(points, larger_x_better=x_key == "decode_speedup")
        axis.plot([p[0] for p in front], [p[1] for p in front], "k--", lw=0.8, label="Pareto front")
        axis.axhline(dense_ppl, color="grey", lw=0.8, label=f"dense {dense_ppl:.1f}")
        axis.set_yscale("log")
        axis.set_xlabel(x_label)
        axis.set_ylabel("held-out perplexity (log)")
        axis.legend(fontsize=8)
    fig.suptitle("SmolLM2-135M: perplexity vs compute and vs speed")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def _pareto(points, larger_x_better: bool):
    ordered = sorted(points, key=lambda p: -p[0] if larger_x_better else p[0])
    front, best = [], float("inf")
    for p in ordered:
        if p[1] < best:
            front.append(p)
            best = p[1]
    return front


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cache", type=Path, default=Path("runs/quality"))
    parser.add_argument("--speed", action="store_true", help="also measure each row's decode speedup (idle machine)")
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--out", type=Path, default=None, help="markdown to write (and a PNG beside it in docs/img)")
    args = parser.parse_args()
    command = "python " + shlex.join(sys.argv)
    torch.set_num_threads(args.threads)
    from gmc.inputs.model import load_model
    from gmc.runtime.evaluate import perplexity

    loaded = load_model("smollm2-135m")
    dense_ppl = perplexity(loaded.model, loaded.tokenizer, "bundled-heldout", seq_len=512, progress=False).perplexity
    results: dict[str, dict] = {}
    done = []
    for key in args.rows:
        row = ROWS[key]
        if row.recover_from and row.recover_from not in results:
            raise SystemExit(f"{key} needs {row.recover_from} earlier in --rows")
        result = evaluate_row(row, run_row(row, args.cache, args.threads, results), args.cache, loaded)
        if args.speed:
            result = speed_row(row, result, args.cache, loaded, args.new_tokens)
        results[key] = result
        done.append((row, result))
        print(json.dumps({k: v for k, v in result.items() if k != "commands"}), file=sys.stderr, flush=True)
    text = markdown(done, dense_ppl, command, args.threads)
    print(text)
    if args.out:
        notes = ""  # hand-written findings below the marker survive a re-run
        if args.out.exists() and NOTES in args.out.read_text():
            notes = args.out.read_text().split(NOTES, 1)[1]
        args.out.write_text(text + f"\n![perplexity vs CPU-minutes and decode speedup](img/{args.out.stem}.png)\n"
                            f"\n{NOTES}{notes}")
        plot(done, dense_ppl, args.out.parent / "img" / f"{args.out.stem}.png")


if __name__ == "__main__":
    main()
