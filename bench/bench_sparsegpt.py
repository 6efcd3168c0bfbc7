"""SparseGPT in gmc on the bundled SmolLM2-135M at 50%: as a baseline and as reconstruction.

Rows: dense; Wanda 2:4 and Wanda 1x64 (uniform) for reference; SparseGPT 2:4; SparseGPT 1x64
uniform; Wanda 1x64 + reconstruction (sweep only, and with conjugate-gradient refinement); and,
given a learned artifact (``--groupmask DIR``, made by ``gmc prune --method groupmask``),
GroupMask 1x64 and GroupMask 1x64 + reconstruction. Every method calibrates on the same
``bundled`` blocks; perplexity is measured on ``bundled-heldout`` (documents joined with
"\\n\\n", tokenised once, the first ``--eval-windows`` non-overlapping ``--eval-seq-len`` windows).
Writes a markdown table with this command line to ``--out`` (between the file's
``<!-- bench_sparsegpt:start/end -->`` markers when it has them, so the prose around stays).

    python bench/bench_sparsegpt.py --out docs/sparsegpt.md
    python bench/bench_sparsegpt.py --groupmask runs/gm --out docs/sparsegpt.md
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import importlib.util
import json
import math
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from gmc.formats.artifact import MASKS_FILE, load_artifact
from gmc.inputs.calib import load_texts
from gmc.inputs.model import LoadedModel, load_model
from gmc.masks.prune import PruneConfig, prune
from gmc.masks.reconstruct import ReconstructConfig, reconstruct_artifact
from gmc.masks.sparsegpt import RECONSTRUCT_REFINE_STEPS


@dataclass(frozen=True)
class Row:
    key: str
    label: str
    method: str  # a gmc prune method, or "artifact" (--groupmask)
    group: str
    refine_steps: int | None = None  # None: no reconstruction; else reconstruct with these CG steps


ROWS = (
    Row("wanda-2:4", "Wanda 2:4", "wanda", "2:4"),
    Row("sparsegpt-2:4", "SparseGPT 2:4", "sparsegpt", "2:4"),
    Row("wanda-1x64", "Wanda 1x64, uniform", "wanda", "1x64"),
    Row("wanda-1x64-rec-sweep", "Wanda 1x64 + reconstruction (OBS sweep only)", "wanda", "1x64", 0),
    Row("wanda-1x64-rec", f"Wanda 1x64 + reconstruction (sweep + {RECONSTRUCT_REFINE_STEPS} CG steps)",
        "wanda", "1x64", RECONSTRUCT_REFINE_STEPS),
    Row("sparsegpt-1x64", "SparseGPT 1x64, uniform", "sparsegpt", "1x64"),
    Row("groupmask-1x64", "GroupMask 1x64 (learned, --groupmask)", "artifact", "1x64"),
    Row("groupmask-1x64-rec-sweep", "GroupMask 1x64 + reconstruction (OBS sweep only)", "artifact", "1x64", 0),
    Row("groupmask-1x64-rec", f"GroupMask 1x64 + reconstruction (sweep + {RECONSTRUCT_REFINE_STEPS} CG steps)",
        "artifact", "1x64", RECONSTRUCT_REFINE_STEPS),
)


def heldout_windows(tokenizer, seq_len: int, count: int) -> torch.Tensor:
    """``[count, seq_len]``: the first non-overlapping windows of bundled-heldout."""
    lines, _ = load_texts("bundled-heldout")
    ids = torch.tensor(tokenizer("\n\n".join(lines))["input_ids"], dtype=torch.int64)
    available = len(ids) // seq_len
    return ids[: min(count, available) * seq_len].view(-1, seq_len)


@torch.no_grad()
def perplexity(model: torch.nn.Module, windows: torch.Tensor) -> float:
    """exp(mean NLL) over every token but the first of each window."""
    total, count = 0.0, 0
    for window in windows:
        logits = model(input_ids=window[None], use_cache=False).logits[0, :-1].float()  # [L-1, V]
        total += float(F.cross_entropy(logits, window[1:], reduction="sum"))
        count += window.numel() - 1
    return math.exp(total / count)


def prune_row(row: Row, dense: LoadedModel, args, out: Path) -> tuple[Path, float]:
    """Masks (and weights, for SparseGPT) of ``row`` written to ``out``; the wall seconds."""
    if row.method == "artifact":
        return Path(args.groupmask), 0.0
    loaded = LoadedModel(copy.deepcopy(dense.model), dense.tokenizer, dense.ref)  # SparseGPT edits it
    config = PruneConfig(model=dense.ref, output=str(out), method=row.method, group=row.group, sparsity=0.5,
                         allocation=None if ":" in row.group else "uniform", calib="bundled",
                         nsamples=args.nsamples, seq_len=args.seq_len, seed=args.seed, overwrite=True)
    started = time.perf_counter()
    prune(config, loaded)
    return out, time.perf_counter() - started


def reconstruct_row(row: Row, dense: LoadedModel, source: Path, args, out: Path) -> tuple[Path, float]:
    loaded = LoadedModel(copy.deepcopy(dense.model), dense.tokenizer, dense.ref)
    config = ReconstructConfig(artifact=str(source), output=str(out), calib="bundled", nsamples=args.nsamples,
                               seq_len=args.seq_len, seed=args.seed, refine_steps=row.refine_steps,
                               progress=args.progress, overwrite=True)
    started = time.perf_counter()
    reconstruct_artifact(config, loaded)
    return out, time.perf_counter() - started


def run(args) -> list[dict]:
    torch.set_num_threads(args.threads)
    dense = load_model("smollm2-135m")
    windows = heldout_windows(dense.tokenizer, args.eval_seq_len, args.eval_windows)
    settings = {"nsamples": args.nsamples, "seq_len": args.seq_len, "seed": args.seed,
                "eval_seq_len": args.eval_seq_len, "eval_windows": args.eval_windows}

    def cached(key: str, compute) -> dict:
        """A row's result; with --cache, reused when a run with the same settings already made it."""
        path = args.cache / f"{key}.json" if args.cache else None
        if path and path.is_file():
            stored = json.loads(path.read_text())
            if stored["settings"] == settings:
                print(f"{key}: reusing {path}", file=sys.stderr)
                return stored["result"]
        result = compute()
        if path:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"settings": settings, "result": result}))
        print(json.dumps(result), file=sys.stderr)
        return result

    def dense_row() -> dict:
        return {"label": "dense", "ppl": perplexity(dense.model, windows), "sparsity": 0.0, "seconds": 0.0,
                "updated": False, "tokens": windows.shape[0] * (windows.shape[1] - 1)}

    results = [cached("dense", dense_row)]
    made: dict[tuple[str, str], Path] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for row in ROWS:
            if row.key not in args.rows or (row.method == "artifact" and not args.groupmask):
                continue

            def compute(row=row) -> dict:
                key = (row.method, row.group)
                seconds = 0.0
                if key not in made:
                    made[key], seconds = prune_row(row, dense, args, Path(tmp) / f"{row.method}-{row.group}")
                path = made[key]
                if row.refine_steps is not None:
                    path, seconds = reconstruct_row(row, dense, path, args, Path(tmp) / f"{row.key}")
                artifact = load_artifact(path)
                model = copy.deepcopy(dense.model)
                artifact.apply_to(model, check_fingerprint=False)
                return {"label": row.label, "key": row.key, "ppl": perplexity(model, windows),
                        "sparsity": artifact.manifest["global_sparsity"], "seconds": seconds,
                        "updated": bool(artifact.weights)}

            if row.method == "artifact":  # the learned masks are part of what the row depends on
                settings["groupmask"] = hashlib.sha256((Path(args.groupmask) / MASKS_FILE).read_bytes()).hexdigest()
            results.append(cached(row.key, compute))
    return results


def markdown(results: list[dict], args, command: str, minutes: float) -> str:
    missing = []
    if not args.groupmask:
        missing.append("GroupMask rows skipped: no learned artifact given (`--groupmask DIR`)")
    if importlib.util.find_spec("llmcompressor") is None:
        missing.append("llmcompressor is not installed, so there is no external SparseGPT cross-check")
    lines = [
        "## Results: bundled SmolLM2-135M, 50%",
        "",
        f"Command: `{command}` ({minutes:.1f} min total, {args.threads} CPU thread(s)"
        + (f"; rows cached in `{args.cache}` were reused, their wall s are from the run that made them)"
           if args.cache else ")"),
        "",
        f"Protocol: 50% of the 210 q/k/v/o/gate/up/down linears (uniform per layer; 2:4 rows are exactly "
        f"2:4). Calibration for every method: `bundled` (Jargon File excerpt), {args.nsamples} blocks x "
        f"{args.seq_len} tokens, seed {args.seed}. Perplexity: `bundled-heldout`, documents joined with "
        f"\"\\n\\n\", tokenised once, the first {results[0]['tokens'] // (args.eval_seq_len - 1)} non-overlapping "
        f"{args.eval_seq_len}-token windows ({results[0]['tokens']} tokens scored). Wall time: the prune "
        f"or reconstruct call. SparseGPT: dampening 1%, 128-column blocks, true-sequential stages inside "
        f"each decoder block.",
        "",
        "| method | global sparsity | weights updated | held-out ppl | wall s |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(f"| {r['label']} | {r['sparsity']:.4f} | {'yes' if r['updated'] else 'no'} | "
                     f"{r['ppl']:.2f} | {r['seconds']:.0f} |")
    if missing:
        lines += ["", *(f"- {m}." for m in missing)]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nsamples", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--eval-seq-len", type=int, default=512)
    parser.add_argument("--eval-windows", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1,
                        help="1 by default: on a shared 2-core machine two OpenMP threads spin and slow "
                             "the many small ops of the sweep down by an order of magnitude")
    parser.add_argument("--groupmask", default=None, help="a learned 1x64 50%% artifact of smollm2-135m")
    parser.add_argument("--rows", nargs="+", default=[r.key for r in ROWS], choices=[r.key for r in ROWS])
    parser.add_argument("--progress", action="store_true")
    parser.add_argument("--cache", type=Path, default=None,
                        help="keep each row's result in CACHE/<row>.json; a re-run with the same settings reuses it")
    parser.add_argument("--out", type=Path, default=None, help="markdown file to write")
    args = parser.parse_args()
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    started = time.perf_counter()
    results = run(args)
    text = markdown(results, args, command, (time.perf_counter() - started) / 60)
    print(text)
    if args.out:
        write_section(args.out, text)


def write_section(path: Path, text: str) -> None:
    """Write ``text`` to ``path``, or only between its bench markers when the file has them."""
    start, end = "<!-- bench_sparsegpt:start -->", "<!-- bench_sparsegpt:end -->"
    path.parent.mkdir(parents=True, exist_ok=True)
    old = path.read_text() if path.is_file() else ""
    if start in old and end in old:
        text = old[: old.index(start) + len(start)] + "\n" + text + old[old.index(end):]
    path.write_text(text)


if __name__ == "__main__":
    main()
