"""What one mask-learning step costs, per option, in one process with the options interleaved.

Builds the learner of ``gmc prune --method groupmask`` on the bundled SmolLM2-135M (1x64 groups,
the full head, bundled text) and times its training step (``gmc.masks.training._train_step``) under
each configuration in turn, round after round, so that host drift hits every configuration alike.
The baseline is the step ``gmc prune`` runs on a CPU for a run under 400 steps: fp32, eager, fused
AdamW, the teacher's trunk output cached; each other configuration is named by the options that
change it (``LABELS``):

    cached    the baseline (a block seen before: the steady state from the second epoch on)
    unfused   the baseline with torch's per-tensor AdamW loop instead of the fused update (no gmc
              option; the reference of the last column)
    live      --no-teacher-cache: the dense teacher runs the whole graph every step
    bf16      --precision bf16: bf16 GEMMs (what auto picks on CUDA)
    compiled  --precision bf16 --compile-step on: the student's forward and backward compiled by
              Inductor (the first round, which compiles, is dropped)
    weights   --precision bf16 --learn-weights: a trained delta of every target weight
    layer     --layer-kd 1: the baseline plus the hidden-state loss at every decoder block's output
              (the cached teacher holds those hidden states too)

and one weight-recovery step (``gmc.masks.recover``, masks fixed at random 50% groups):

    recover        the eager step of ``gmc recover`` (and of ``--recover-steps`` after a one-shot
                   source): the HF model's kept weights trained in place, a dense copy as teacher, fp32
    recover-graph  the step of ``--recover-steps`` after a learned run of ``--precision bf16
                   --compile-step on``: that run's graph, compiled student and cached teacher, a trained
                   delta per target

Medians over the rounds (the first dropped), the process's CPU seconds per step beside the wall
time; writes ``bench/results/learning_step.json``.

    OMP_NUM_THREADS=2 python bench/bench_learn_step.py --threads 2 --rounds 8
    OMP_NUM_THREADS=2 python bench/bench_learn_step.py --configs unfused cached layer --record learning-step-layer-kd
"""
from __future__ import annotations

import argparse
import copy
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
from host import copy_bandwidth_gbs, host
from records import write_record

from gmc.graph.pipeline import prepare
from gmc.graph.taps import with_outputs
from gmc.graph.targets import TargetFilter
from gmc.groups import parse_pattern
from gmc.inputs.calib import load_texts, token_blocks
from gmc.inputs.model import load_model
from gmc.masks.budget import Budget
from gmc.masks.harness import batch_indices
from gmc.masks.hypernet import HyperNetwork
from gmc.masks.learn import LearnConfig
from gmc.masks.recover import LearnedGraph, RecoverConfig, _Eager, _OnGraph
from gmc.masks.student import Student, adamw
from gmc.masks.teacher import Teacher
from gmc.masks.training import MaskTask, _train_step, layer_taps

RESULTS = Path(__file__).resolve().parent / "results" / "learning_step.json"
CONFIGS = ("unfused", "live", "cached", "bf16", "compiled", "weights", "layer", "recover", "recover-graph")
LABELS = {"unfused": "per-tensor AdamW", "live": "--no-teacher-cache", "cached": "baseline",
          "bf16": "--precision bf16", "compiled": "--precision bf16 --compile-step on",
          "weights": "--precision bf16 --learn-weights", "layer": "--layer-kd 1",
          "recover": "recovery, eager (gmc recover)", "recover-graph": "recovery on the learned graph, bf16 compiled"}
RECOVERY = ("recover", "recover-graph")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--group", default="1x64")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS,
                        help="which steps to time (each holds a learner of ~2.5 GB)")
    parser.add_argument("--record", default="learning-step", help="the record's name in learning_step.json")
    args = parser.parse_args()
    if "unfused" not in args.configs:
        parser.error("--configs needs 'unfused': the last column's reference")
    copy = [round(copy_bandwidth_gbs(t), 1) for t in (1, 2)]
    torch.set_num_threads(args.threads)

    loaded = load_model("smollm2-135m")
    pattern = parse_pattern(args.group)
    gm, targets, selectors = prepare(loaded.model, pattern, TargetFilter())
    text, _ = load_texts("bundled", split="train")
    blocks = token_blocks(loaded.tokenizer, text, args.seq_len, 8, 42)
    names = [t.name for t in targets]
    sizes = [pattern.group_sizes(t.shape).float() for t in targets]
    task = MaskTask("groupmask", pattern, 0.5, "adaptive", 42, "bench", Path("unused"))

    def learner(learn_weights: bool, fused: bool = True):
        source = HyperNetwork([pattern.grid(t.shape) for t in targets])
        groups = [{"params": list(source.parameters())}]
        deltas = []
        if learn_weights:
            deltas = [torch.zeros(t.shape) for t in targets]
            for delta in deltas:
                delta.requires_grad_()
            groups.append({"params": deltas, "lr": LearnConfig.weight_lr, "weight_decay": 0.0})
        if fused:
            optimizer = adamw(groups, "cpu", False, lr=LearnConfig.lr, weight_decay=LearnConfig.weight_decay)
        else:
            optimizer = torch.optim.AdamW(groups, lr=LearnConfig.lr, weight_decay=LearnConfig.weight_decay)
        return source, optimizer, dict(zip(names, deltas))

    live = Teacher(gm, blocks, "cpu", cache=False, precision="fp32")
    cached = Teacher(gm, blocks, "cpu", cache=True, precision="fp32")
    cached16 = Teacher(gm, blocks, "cpu", cache=True, precision="bf16")
    learn = LearnConfig(steps=10**6, progress=False)
    layered = LearnConfig(steps=10**6, progress=False, layer_kd=1.0)
    taps = layer_taps(gm, layered) if "layer" in args.configs else []
    cached_taps = Teacher(gm, blocks, "cpu", cache=True, precision="fp32", taps=taps) if taps else None
    for teacher in (cached, cached16, cached_taps) if taps else (cached, cached16):
        for i in range(blocks.shape[0]):  # every block seen: the cached teacher's steady state
            teacher.logits(torch.tensor([i]), blocks[[i]])
    eager, compiled = Student(gm, compiled=False), Student(gm, compiled=True)
    tapped = Student(with_outputs(gm, taps), compiled=False) if taps else None
    # name: (teacher, learner, precision, student, learning settings)
    build = {"unfused": lambda: (cached, learner(False, fused=False), "fp32", eager, learn),
             "live": lambda: (live, learner(False), "fp32", eager, learn),
             "cached": lambda: (cached, learner(False), "fp32", eager, learn),
             "bf16": lambda: (cached16, learner(False), "bf16", eager, learn),
             "compiled": lambda: (cached16, learner(False), "bf16", compiled, learn),
             "weights": lambda: (cached16, learner(True), "bf16", eager, learn),
             "layer": lambda: (cached_taps, learner(False), "fp32", tapped, layered)}
    configs = {name: build[name]() for name in CONFIGS if name in args.configs and name not in RECOVERY}
    recovery = {name: recovery_step(name, loaded.model, gm, targets, selectors, pattern, cached16)
                for name in RECOVERY if name in args.configs}
    budget = Budget(names, sizes, 0.5, "adaptive", None)
    wall: dict[str, list[float]] = {name: [] for name in [*configs, *recovery]}
    cpu: dict[str, list[float]] = {name: [] for name in [*configs, *recovery]}
    step = 1000  # past the ramp: the budget term is at its target
    for _ in range(args.rounds):
        for name, (teacher, (source, optimizer, deltas), precision, student, settings) in configs.items():
            for target, delta in deltas.items():
                selectors[target].delta = delta
            step += 1
            start, process = time.perf_counter(), time.process_time()
            _train_step(student, selectors, source, optimizer, budget, task, settings, precision, blocks, teacher,
                        step, "cpu", None)
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - process)
            for target in deltas:
                selectors[target].delta = None
        for name, run in recovery.items():
            step += 1
            start, process = time.perf_counter(), time.process_time()
            run(step)
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - process)
        print({n: round(v[-1], 3) for n, v in wall.items()}, file=sys.stderr)

    base = statistics.median(cpu["unfused"][1:])
    rows = []
    for name in [*configs, *recovery]:
        median, process = statistics.median(wall[name][1:]), statistics.median(cpu[name][1:])
        rows.append({"config": LABELS[name], "step_s": median, "cpu_s": process, "tok_per_s": args.seq_len / median,
                     "tok_per_cpu_s": args.seq_len / process, "vs_unfused": base / process,
                     "spread": f"{min(wall[name][1:]):.2f}-{max(wall[name][1:]):.2f}"})
    record = {
        "name": args.record,
        "title": f"One mask-learning{' or recovery' if recovery else ''} step, bundled SmolLM2-135M, "
                 f"GroupMask {args.group}, full head, "
                 f"{args.seq_len} tokens",
        "bench": "bench/bench_learn_step.py",
        "command": f"OMP_NUM_THREADS={args.threads} python bench/bench_learn_step.py {shlex.join(sys.argv[1:])}",
        "host": {**host(), "copy_gbps": copy, "threads": args.threads},
        "columns": [{"key": "config", "title": "step"}, {"key": "step_s", "title": "wall s", "format": "{:.2f}"},
                    {"key": "cpu_s", "title": "CPU s", "format": "{:.2f}"},
                    {"key": "tok_per_s", "title": "tokens / s", "format": "{:.1f}"},
                    {"key": "tok_per_cpu_s", "title": "tokens / CPU-s", "format": "{:.1f}"},
                    {"key": "vs_unfused", "title": "tokens / CPU-s, x per-tensor AdamW", "format": "{:.2f}x"},
                    {"key": "spread", "title": "wall s, min-max"}],
        "rows": rows,
        "notes": [f"Medians of {args.rounds - 1} interleaved rounds (the first, which compiles, dropped). "
                  f"baseline: the step of `gmc prune smollm2-135m --method groupmask --group {args.group} "
                  f"--sparsity 0.5 --calib bundled --seq-len {args.seq_len}` on a CPU for a run under 400 steps "
                  "(fp32, eager, fused AdamW), on a block whose teacher trunk output is cached; each other row adds "
                  "the options it is named by; "
                  "per-tensor AdamW: the baseline with torch's per-tensor AdamW loop instead of the fused update "
                  "(no gmc option).",
                  "Recovery rows (gmc.masks.recover): one step of weight recovery under fixed masks (random "
                  "groups at 50%); eager: gmc recover's step (the model's kept weights trained in place, a dense "
                  "copy as teacher, fp32); on the learned graph: --recover-steps after a learned run of "
                  "--precision bf16 --compile-step on (its compiled student, its cached teacher, a delta per "
                  "target)."],
    }
    write_record(RESULTS, record)
    print(json.dumps(record, indent=2))


def recovery_step(name: str, model, gm, targets, selectors, pattern, teacher):
    """``step(k)``: one recovery step of ``name`` (``RECOVERY``) under fixed random masks at 50%."""
    torch.manual_seed(0)
    masks = {t.name: (torch.rand(pattern.grid(t.shape)) < 0.5).float() for t in targets}
    config = RecoverConfig(steps=10**6, progress=False)
    if name == "recover":  # a model of its own: it trains its weights in place
        tuner = _Eager(copy.deepcopy(model), masks, pattern, None, None, False, "cpu")
    else:
        weights = {t.name: gm.get_parameter(t.node.args[1].target) for t in targets}
        graph = LearnedGraph(selectors, weights, Student(gm, compiled=True), teacher, "bf16", True)
        tuner = _OnGraph(graph, masks, pattern, None, "cpu")
        fixed = {n: s.selectors for n, s in selectors.items()}
        deltas = dict(zip(masks, tuner.params.values()))
        tuner.close()  # the learning rows set the shared selectors too: each step sets them again
    optimizer = adamw(tuner.params.values(), "cpu", False, lr=config.lr)

    def step(k: int) -> None:
        indices = batch_indices(k, 1, teacher.blocks.shape[0], 42)
        if name == "recover-graph":
            for target, selector in selectors.items():
                selector.selectors, selector.delta = fixed[target], deltas[target]
        tuner.step(optimizer, teacher.blocks, indices, config)
        if name == "recover-graph":
            tuner.close()

    return step


if __name__ == "__main__":
    main()
