"""Learned GroupMask vs heuristic baselines on the bundled SmolLM2.

Same calibration text (bundled Jargon File excerpt), same held-out perplexity protocol
(bundled-heldout, non-overlapping windows), 50% sparsity, 1x64 groups unless a variant says
otherwise. Writes a markdown table (with this command line and wall times) to --out.

    python bench/bench_learning.py --steps 300 --seq-len 256 --out docs/learning-bench.md
    python bench/bench_learning.py --quick            # a few minutes, smoke-level numbers
"""
from __future__ import annotations

import argparse
import copy
import json
import shlex
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gmc.formats.atomic import atomic_write_bytes
from gmc.inputs.model import load_model
from gmc.masks.learn import COMPILE_CHOICES, LearnConfig
from gmc.masks.prune import PruneConfig, prune
from gmc.masks.sources import SOURCES
from gmc.masks.student import PRECISIONS
from gmc.runtime.evaluate import perplexity

RECOVER_LR = PruneConfig.recover_lr
ROW_FILE = "bench_row.json"  # with --keep: the row next to its artifact; a re-run with the same settings reuses it


@dataclass(frozen=True)
class Variant:
    label: str
    method: str
    group: str = "1x64"
    allocation: str | None = None
    learn: dict = field(default_factory=dict)
    recover_steps: int = 0  # weight recovery after the masks (--recover-steps of the same calibration)


VARIANTS = {
    "wanda-uniform": Variant("Wanda groups, uniform", "wanda", allocation="uniform"),
    "wanda-owl": Variant("Wanda groups, OWL", "wanda", allocation="owl"),
    "wanda-global": Variant("Wanda groups, global", "wanda", allocation="global"),
    "magnitude-uniform": Variant("magnitude groups, uniform", "magnitude", allocation="uniform"),
    "wanda-2:4": Variant("Wanda 2:4", "wanda", group="2:4"),
    "groupmask": Variant("GroupMask, default (full head, no noise, schedule budget)", "groupmask"),
    "groupmask-lowrank": Variant("GroupMask (lowrank head r=16, no noise)", "groupmask", learn={"head": "lowrank"}),
    "groupmask-noise": Variant("GroupMask (full head, Gumbel noise)", "groupmask", learn={"noise": True}),
    "groupmask-uniform": Variant("GroupMask, uniform allocation", "groupmask", allocation="uniform"),
    "direct": Variant("free logits (no hypernetwork)", "direct"),
    "groupmask-penalty": Variant("GroupMask, penalty budget", "groupmask", learn={"budget": "penalty"}),
    "groupmask-weights": Variant("GroupMask + weight learning", "groupmask", learn={"learn_weights": True}),
    "groupmask-weights-1e-3": Variant("GroupMask + weight learning, weight lr 1e-3", "groupmask",
                                      learn={"learn_weights": True, "weight_lr": 1e-3}),
    "groupmask-weights-3e-4-cosine": Variant("GroupMask + weight learning, weight lr 3e-4, cosine decay", "groupmask",
                                             learn={"learn_weights": True, "weight_lr": 3e-4, "lr_decay": "cosine"}),
    "groupmask-weights-1x256": Variant("GroupMask + weight learning", "groupmask", group="1x256",
                                       learn={"learn_weights": True}),
    "groupmask-recover": Variant("GroupMask, then recovery", "groupmask", recover_steps=-1),  # --recover-steps
    "groupmask-weights-recover": Variant("GroupMask + weight learning, then recovery", "groupmask",
                                         learn={"learn_weights": True}, recover_steps=-1),
    "groupmask-weights-1x256-recover": Variant("GroupMask + weight learning, then recovery", "groupmask",
                                               group="1x256", learn={"learn_weights": True}, recover_steps=-1),
    "sparsegpt-2:4": Variant("SparseGPT 2:4", "sparsegpt", group="2:4"),
    "sparsegpt-2:4-recover": Variant("SparseGPT 2:4, then recovery", "sparsegpt", group="2:4", recover_steps=-1),
}


def run(args) -> list[dict]:
    # fp32 weights; the step's precision is --precision auto's
    loaded = load_model("smollm2-135m", "float32", args.device)
    torch.set_num_threads(args.threads)
    rows = []
    started = time.perf_counter()
    dense = perplexity(loaded.model, loaded.tokenizer, "bundled-heldout", seq_len=args.eval_seq_len, progress=False)
    rows.append({"label": "dense", "ppl": dense.perplexity, "sparsity": 0.0, "seconds": time.perf_counter() - started,
                 "tokens": dense.protocol["tokens_scored"]})
    print(f"dense ppl {dense.perplexity:.3f}", file=sys.stderr)
    for seed, key in [(seed, key) for seed in args.seeds for key in args.variants]:
        variant = VARIANTS[key]
        learned = SOURCES[variant.method].learns
        recover = args.recover_steps if variant.recover_steps < 0 else variant.recover_steps
        settings = {"steps": args.steps if learned else None, "lr": args.lr if learned else None,
                    "lam": args.lam if learned else None, "recover_steps": recover, "learn": variant.learn,
                    # named only off its default, so the rows kept before the option still match
                    **({"recover_lr": args.recover_lr} if recover and args.recover_lr != RECOVER_LR else {}),
                    "seq_len": args.seq_len, "batch_size": args.batch_size, "device": args.device,
                    "precision": args.precision, "compile_step": args.compile_step,
                    "seed": seed, "eval_seq_len": args.eval_seq_len,
                    "nsamples": args.nsamples if learned else args.heuristic_nsamples}
        name = key if seed == 42 else f"{key}-seed{seed}"
        cached = args.keep / name / ROW_FILE if args.keep else None
        if cached and cached.exists() and json.loads(cached.read_text()).get("settings") == settings:
            rows.append(json.loads(cached.read_text()))
            print(f"{name}: reusing {cached}", file=sys.stderr)
            continue
        learn = LearnConfig(steps=args.steps, lr=args.lr, lam=args.lam, progress=args.progress, checkpoint_every=10**9,
                            batch_size=args.batch_size, precision=args.precision, compile_step=args.compile_step,
                            **variant.learn) if learned else LearnConfig(progress=args.progress)
        # gmc refuses options a run does not read: calibration only where blocks are read
        data = dict(calib="bundled", nsamples=settings["nsamples"], seq_len=args.seq_len) \
            if SOURCES[variant.method].needs_blocks or recover else {}
        with tempfile.TemporaryDirectory() as tmp:
            output = args.keep / name if args.keep else Path(tmp) / "out"
            if output.exists():
                shutil.rmtree(output)  # a stale artifact of other settings
            config = PruneConfig(model="smollm2-135m", output=str(output), method=variant.method,
                                 group=variant.group, sparsity=0.5, allocation=variant.allocation, **data,
                                 seed=seed, recover_steps=recover,
                                 **({"recover_lr": args.recover_lr} if recover else {}), learn=learn,
                                 device=args.device, dtype="float32")
            started, cpu = time.perf_counter(), time.process_time()
            artifact = prune(config, loaded)
            seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
        model = copy.deepcopy(loaded.model)
        artifact.apply_to(model, check_fingerprint=False)
        result = perplexity(model, loaded.tokenizer, "bundled-heldout", seq_len=args.eval_seq_len, progress=False)
        del model
        training = artifact.manifest.get("training", {})
        row = {"label": variant.label, "key": key, "seed": seed, "ppl": result.perplexity, "seconds": seconds,
               "cpu_seconds": cpu, "precision": training.get("precision"), "compiled": training.get("compiled"),
               "sparsity": artifact.manifest["global_sparsity"], "tokens": result.protocol["tokens_scored"],
               "steps": args.steps if learned else None,
               "params": artifact.manifest.get("training", {}).get("trainable_parameters"),
               "moved": artifact.manifest.get("export_thresholds_moved"),
               "trained": artifact.manifest.get("trained_sparsity"), "settings": settings}
        if cached:
            atomic_write_bytes(cached, json.dumps(row).encode())
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
    return rows


def markdown(rows: list[dict], args, command: str) -> str:
    lines = [
        "# Learned GroupMask vs heuristic baselines (bundled SmolLM2-135M)",
        "",
        f"Command: `{command}`",
        "",
        f"Protocol: 50% sparsity of the 210 q/k/v/o/gate/up/down linears; calibration `bundled` "
        f"(Jargon File excerpt), {args.seq_len}-token blocks, seeds {args.seeds}; learned methods train "
        f"{args.steps} steps, batch {args.batch_size}, lr {args.lr}, lambda {args.lam}, "
        f"on {args.nsamples} blocks; heuristics use "
        f"{args.heuristic_nsamples} blocks. Perplexity: `bundled-heldout`, non-overlapping "
        f"{args.eval_seq_len}-token windows, {rows[0]['tokens']} tokens scored. "
        f"{args.threads} CPU threads. Wall time = the prune call only.",
        "",
        "| method | group | global sparsity | held-out ppl | wall s | trainable params "
        "| sparsity reached in training |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        group = VARIANTS[row["key"]].group if "key" in row else "-"
        params = f"{row['params']:,}" if row.get("params") else ""
        trained = ""
        if row.get("steps"):  # learned: how far the noise-free training masks got before the export
            trained = f"{row['trained']:.3f}" if row.get("trained") is not None else "?"
            trained += " (export threshold moved)" if row.get("moved") else ""
        lines.append(f"| {row['label']} | {group} | {row['sparsity']:.4f} | {row['ppl']:.2f} | "
                     f"{row['seconds']:.0f} | {params} | {trained} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--nsamples", type=int, default=256)
    parser.add_argument("--heuristic-nsamples", type=int, default=64)
    parser.add_argument("--lr", type=float, default=LearnConfig.lr)
    parser.add_argument("--recover-steps", type=int, default=100, help="of the '...-recover' variants")
    parser.add_argument("--recover-lr", type=float, default=RECOVER_LR, help="of the '...-recover' variants")
    parser.add_argument("--lambda", dest="lam", type=float, default=LearnConfig.lam)
    parser.add_argument("--seeds", type=int, nargs="+", default=[42], help="every variant runs once per seed")
    parser.add_argument("--eval-seq-len", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu or cuda: where the model trains and is evaluated")
    parser.add_argument("--batch-size", type=int, default=1, help="blocks per learning step")
    parser.add_argument("--precision", default=LearnConfig.precision, choices=PRECISIONS)
    parser.add_argument("--compile-step", default=LearnConfig.compile_step, choices=COMPILE_CHOICES)
    parser.add_argument("--variants", nargs="+", default=["wanda-uniform", "wanda-owl", "wanda-2:4", "groupmask"],
                        choices=list(VARIANTS))
    parser.add_argument("--quick", action="store_true", help="30 steps of 128 tokens: a smoke run")
    parser.add_argument("--progress", action="store_true")
    parser.add_argument("--keep", type=Path, default=None,
                        help="keep each variant's artifact in KEEP/<variant> (and reuse finished rows on a re-run)")
    parser.add_argument("--out", type=Path, default=None, help="markdown file to write (docs/learning-bench.md)")
    parser.add_argument("--record", default=None,
                        help="also write the rows as record NAME of bench/results/learning.json")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.seq_len = 30, 128
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    rows = run(args)
    text = markdown(rows, args, command)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    if args.record:
        write_record(rows, args, command)


def write_record(rows: list[dict], args, command: str) -> None:
    """Append (or replace, by name) this run's record in bench/results/learning.json."""
    from host import copy_bandwidth_gbs, host
    from records import save_record

    copy = [round(copy_bandwidth_gbs(threads), 1) for threads in (1, 2)]
    torch.set_num_threads(args.threads)
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else None
    save_record("learning", {
        "name": args.record,
        "title": f"Bundled SmolLM2-135M, 50%: {args.steps} learning steps x {args.batch_size * args.seq_len} tokens"
                 + (f" on {gpu}" if gpu else ""),
        "bench": "bench/bench_learning.py", "command": command,
        "host": {**host(), "copy_gbps": copy, "threads": args.threads,
                 **({"gpu": gpu} if gpu else {})},
        "columns": [{"key": "label", "title": "method"}, {"key": "group", "title": "group"},
                    {"key": "seed", "title": "seed"},
                    {"key": "ppl", "title": "held-out ppl", "format": "{:.2f}"},
                    {"key": "seconds", "title": "wall s", "format": "{:.0f}"},
                    {"key": "cpu_seconds", "title": "CPU s", "format": "{:.0f}"},
                    {"key": "recover_steps", "title": "recovery steps"}],
        "rows": [{"label": r["label"], "group": VARIANTS[r["key"]].group if "key" in r else "-",
                  "seed": r.get("seed", "-"), "ppl": r["ppl"],
                  "seconds": r["seconds"], "cpu_seconds": r.get("cpu_seconds"),
                  "recover_steps": (r.get("settings") or {}).get("recover_steps") or ""} for r in rows],
        "notes": [f"Learned: {args.steps} steps, batch {args.batch_size}, "
                  f"{args.nsamples} blocks of {args.seq_len} tokens "
                  f"on {args.device} "
                  f"(step precision: {', '.join(sorted({str(r.get('precision')) for r in rows[1:]}))}); "
                  f"recovery: {args.recover_steps} steps where named. Perplexity: bundled-heldout, "
                  f"{args.eval_seq_len}-token windows. Wall and CPU s: the prune call (with recovery) only."],
    })


if __name__ == "__main__":
    main()
