"""How much the demo's learned row moves with the step its masks are read at, and what a landing average gives.

    python bench/bench_landing.py --seeds 42 1 2 --isas native --record landing

Each run is the demo's GroupMask command (``bench_demo_spread.demo_prune``: 1x64 at 50%, bundled calibration text,
256 sequences of ``--seq-len`` tokens, ``--steps`` steps, ``--seed``), in this process, with the
budget's step function wrapped so that it keeps the selector logits and the hard training masks of
every landing step (the last ``LANDING`` of the steps, where the training masks hold the exact
budget by top-k). Beside the run's own export (the top-k of the last logits), it writes as artifacts:

- ``step-K``: the training mask of landing step K (the last ``--steps-kept`` of them);
- ``mean``: the top-k, at the target, of the logits averaged over the landing steps (a landing that
  does not flip groups on one step's noise);

and evaluates all of them with ``gmc eval`` (bundled held-out text, 512-token windows) in one child,
torch, MKL and oneDNN held to AVX2 for ``--isas avx2`` (``host.AVX2_ENV``) in the run and the eval
alike. The record (``bench/results/landing.json``): every mask's perplexity and how many groups it
differs in from the export.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from bench_demo_spread import ISAS, demo_prune, host_entry, seed_runs
from records import save_record


def learn_and_keep(args, seed: int, out: Path) -> None:
    """The child: the demo's prune, keeping every landing step's logits and masks, then the extra artifacts."""
    import torch

    import gmc.masks.training as training
    from gmc.cli.main import cli
    from gmc.formats.artifact import MaskArtifact, load_artifact, save_artifact
    from gmc.groups import global_sparsity, layer_sparsity
    from gmc.masks.budget import LANDING, topk_keep

    kept: dict[int, tuple[list, list]] = {}
    seen = {}
    inner = training._hard_selectors

    def wrapped(leaves, step, budget, task, learn):
        result = inner(leaves, step, budget, task, learn)
        if step > (1.0 - LANDING) * learn.steps:
            seen["budget"], seen["task"] = budget, task
            kept[step] = ([leaf.detach().float().clone() for leaf in leaves], [h.detach() > 0.5 for h in result[0]])
        return result

    training._hard_selectors = wrapped
    cli.main(demo_prune(seed, args.steps, args.seq_len, out / "export", args.extra))
    budget, task = seen["budget"], seen["task"]
    export = load_artifact(out / "export")
    names = budget.names
    sizes = [s.cpu() for s in budget.sizes]
    steps = sorted(kept)
    mean = [torch.stack([kept[k][0][i] for k in steps]).mean(0) for i in range(len(names))]
    masks = {"mean": topk_keep(mean, sizes, budget.keep_params(task.sparsity), budget.per_target)[0]}
    for step in steps[-args.steps_kept:]:
        masks[f"step-{step}"] = kept[step][1]
    shapes = {n: tuple(shape) for n, shape in export.manifest["shapes"].items()}
    for label, found in masks.items():
        chosen = dict(zip(names, (m.cpu() for m in found)))
        manifest = {**export.manifest, "global_sparsity": global_sparsity(export.pattern, chosen, shapes),
                    "layer_sparsity": {n: layer_sparsity(export.pattern, m, shapes[n]) for n, m in chosen.items()}}
        save_artifact(out / label, MaskArtifact(chosen, manifest), overwrite=True)
    (out / "landing.json").write_text(json.dumps({"steps": steps, "labels": list(masks)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 1, 2])
    parser.add_argument("--isas", nargs="+", default=["native"], choices=list(ISAS))
    parser.add_argument("--steps", type=int, default=110, help="the demo's STEPS")
    parser.add_argument("--seq-len", type=int, default=128, help="the demo's SEQ_LEN")
    parser.add_argument("--steps-kept", type=int, default=4, help="landing steps whose training masks are evaluated")
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more gmc prune options")
    parser.add_argument("--out", type=Path, default=Path("runs/landing"))
    parser.add_argument("--record", default="landing")
    parser.add_argument("--child", nargs=2, metavar=("SEED", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        learn_and_keep(args, int(args.child[0]), Path(args.child[1]))
        return
    threads = int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1))
    rows = []
    for isa, seed, env, out in seed_runs(args.isas, args.seeds, args.out):
        child = [sys.executable, __file__, "--steps", str(args.steps), "--seq-len", str(args.seq_len),
                 "--steps-kept", str(args.steps_kept), "--child", str(seed), str(out)]
        subprocess.run([*child, "--extra", *args.extra] if args.extra else child, env=env, check=True)
        labels = ["export", *json.loads((out / "landing.json").read_text())["labels"]]
        subprocess.run(["gmc", "eval", "smollm2-135m", *(str(out / label) for label in labels), "--ppl",
                        "bundled-heldout", "--seq-len", "512", "-o", str(out / "eval.json"), "--overwrite"],
                       env=env, check=True)
        models = json.loads((out / "eval.json").read_text())["models"][1:]  # the dense model first
        flips = _differences(out, labels)
        for label, model in zip(labels, models):
            rows.append({"isa": isa, "seed": seed, "mask": label, "perplexity": model["perplexity"],
                         "groups_from_export": flips[label]})
            print(f"{isa} seed {seed} {label}: held-out ppl {model['perplexity']:.2f}, "
                  f"{flips[label]} groups differ from the export", flush=True)
    record = {"name": args.record, "bench": "bench/bench_landing.py",
              "title": f"The demo's GroupMask run ({args.steps} steps x {args.seq_len} tokens"
                       f"{', ' + ' '.join(args.extra) if args.extra else ''}): the masks of its landing steps",
              "command": " ".join(["python bench/bench_landing.py", *sys.argv[1:]]),
              "host": host_entry(threads),
              "columns": [{"key": "isa", "title": "ISA"}, {"key": "seed", "title": "seed"},
                          {"key": "mask", "title": "mask"},
                          {"key": "perplexity", "title": "held-out ppl", "format": "{:.2f}"},
                          {"key": "groups_from_export", "title": "groups unlike the export"}],
              "rows": rows,
              "notes": ["export: the run's own masks (top-k of the last step's logits); step-K: the training mask "
                        "of landing step K; mean: the top-k of the logits averaged over the landing steps. 1x64 at "
                        "50%, held-out perplexity on the bundled text in 512-token windows."]}
    print(f"record: {save_record('landing', record)}")


def _differences(out: Path, labels: list[str]) -> dict[str, int]:
    """Groups in which each artifact's masks differ from the export's."""
    from gmc.formats.artifact import load_artifact

    export = load_artifact(out / "export").masks
    found = {}
    for label in labels:
        masks = load_artifact(out / label).masks
        found[label] = int(sum((masks[n] != export[n]).sum() for n in export))
    return found


if __name__ == "__main__":
    main()
