"""Fidelity: the GroupMask paper's findings in miniature on the bundled SmolLM2-135M.

One calibration text (``bundled``), one held-out text (``bundled-heldout``), one protocol, and a
row per variant; each paper finding is a section that compares some of the rows and says whether
gmc agrees with the paper. Writes ``docs/results.md`` (command line at the top), PNG plots in
``docs/results/`` and, per row, a JSON cache under ``--out-dir``: a re-run skips every row whose
cached settings match, so a long run can be split across sessions (Ctrl-C inside a learned row
checkpoints it; the next run resumes that row exactly).

    python bench/fidelity.py              # full: dense + 13 learned (100 steps x 64 tokens) + 9 heuristic rows,
                                          # ~90 min on 2 idle cores (sized in fidelity_plan.FULL_BUDGET_MINUTES)
    python bench/fidelity.py --quick      # 4 rows, 10 steps, ~10 min on 2 idle cores: a smoke run, not evidence
    python bench/fidelity.py --rows gm gm-uniform --markdown /tmp/r.md   # a subset

Nothing here is tuned on the held-out text: the learned rows use gmc's defaults (T, head, noise)
except the CPU-sized steps / sequence length and the lr / lambda of the plan, chosen from training
curves (how fast the training masks reach the budget) before any held-out number was looked at.
"""
from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

import torch
from fidelity_plan import PLANS, REPO, ROWS, run_rows
from fidelity_render import write_results

# The bench in three files besides this command line: fidelity_plan (the rows, the plans, the cached
# runner), fidelity_findings (the paper's claims and numbers, and the rules that judge this run's rows
# against them), fidelity_render (docs/results.md and its plots).


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few rows with tiny step counts (~10 min)")
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), help="run only these rows (default: the plan's)")
    parser.add_argument("--redo", nargs="+", default=[], choices=list(ROWS), help="ignore these rows' cache")
    parser.add_argument("--steps", type=int, help="override the plan's training steps")
    parser.add_argument("--seq-len", type=int, help="override the plan's calibration block length")
    parser.add_argument("--lambda", dest="lam", type=float, help="override the plan's budget weight")
    parser.add_argument("--zero-shot-limit", type=int, help="items per task; 0 turns zero-shot off")
    parser.add_argument("--include-path", help="extra lm-eval task YAMLs (gmc/tasks is always on the path)")
    parser.add_argument("--tasks", nargs="+", help="zero-shot tasks (default: jargon_next)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out-dir", type=Path, help="row cache and artifacts (default: runs/fidelity/<mode>)")
    parser.add_argument("--markdown", type=Path, default=REPO / "docs" / "results.md")
    parser.add_argument("--plots-dir", type=Path, default=REPO / "docs" / "results")
    parser.add_argument("--progress", action="store_true", help="progress bars for training and evaluation")
    args = parser.parse_args(argv)

    mode = "quick" if args.quick else "full"
    keys, settings = PLANS[mode]
    overrides = {k: v for k, v in (("steps", args.steps), ("seq_len", args.seq_len), ("lam", args.lam),
                                   ("zero_shot_limit", args.zero_shot_limit), ("include_path", args.include_path),
                                   ("tasks", tuple(args.tasks) if args.tasks else None)) if v is not None}
    settings = replace(settings, **overrides)
    keys = list(args.rows or keys)
    out_dir = args.out_dir or REPO / "runs" / "fidelity" / mode
    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0], REPO)] + sys.argv[1:]) \
        if argv is None else "fidelity " + " ".join(argv)
    torch.set_num_threads(args.threads)
    started_at = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    started = time.perf_counter()

    from gmc.errors import Interrupted
    from gmc.inputs.model import load_model

    loaded = load_model("smollm2-135m")
    try:
        results = run_rows(loaded, keys, settings, out_dir, redo=tuple(args.redo), progress=args.progress,
                           log=lambda message: print(message, file=sys.stderr, flush=True))
    except (Interrupted, KeyboardInterrupt) as stop:
        print(f"[fidelity] interrupted ({stop or 'Ctrl-C'}); finished rows are cached in {out_dir}: run the same "
              f"command again to continue", file=sys.stderr)
        raise SystemExit(130) from None
    text = write_results(results, settings, command, out_dir, args.markdown, args.plots_dir, started_at,
                         time.perf_counter() - started)
    print(text)


if __name__ == "__main__":
    main()
