"""Held-out perplexity of learned GroupMask at 50% (1x64 and 1x256) against training tokens, from the records.

Gathers the measured points (bench/results/learning.json and quality.json; one point a seed), fits a
power law through the frozen-weight 1x64 points of one recipe (batch 1), and writes

- the record ``learning-curve-points`` of bench/results/learning.json (the table docs/quality.md
  embeds through ``python bench/results_tables.py --fill docs/quality.md``);
- ``docs/img/learning_curve.png``: one panel a group shape; the points, the fit, SparseGPT 2:4 with and
  without recovery.

    python bench/learning_curve.py
"""
from __future__ import annotations

import math
import statistics
from pathlib import Path

from records import save_record
from results_tables import load

PLOT = Path(__file__).resolve().parent.parent / "docs" / "img" / "learning_curve.png"

FROZEN, LEARNED, SPLIT = "frozen", "learned", "learned, then recovery"
_DEFAULT = "GroupMask, default (full head, no noise, schedule budget)"
_JOINT, _RECOVERED = "GroupMask + weight learning", "GroupMask + weight learning, then recovery"
# (results file, record, row label, group, joint steps, recovery steps, blocks a step, tokens a block, weights,
# where); a record's rows of that label and group, one a seed, are its points
POINTS = [
    ("learning", "weights-130x128", "GroupMask (full head, no noise)", "1x64", 130, 0, 1, 128, FROZEN, "CPU"),
    ("learning", "weights-130x128", _JOINT, "1x64", 130, 0, 1, 128, LEARNED, "CPU"),
    ("quality", "quality", "GroupMask (gmc's recipe), 150 steps x 128 tokens", "1x64", 150, 0, 1, 128, FROZEN, "CPU"),
    ("quality", "quality", "GroupMask (gmc's recipe), 300 steps x 256 tokens", "1x64", 300, 0, 1, 256, FROZEN, "CPU"),
    ("learning", "frozen-800x256", _DEFAULT, "1x64", 800, 0, 1, 256, FROZEN, "CPU"),
    ("learning", "weights-800x256", _JOINT, "1x64", 800, 0, 1, 256, LEARNED, "CPU"),
    ("learning", "split-1x64-760-joint", _JOINT, "1x64", 760, 0, 1, 256, LEARNED, "CPU"),
    ("learning", "split-1x64-760-joint-seed-1", _JOINT, "1x64", 760, 0, 1, 256, LEARNED, "CPU"),
    ("learning", "split-1x64-520-recover-210", _RECOVERED, "1x64", 520, 210, 1, 256,
     SPLIT, "CPU"),
    ("learning", "split-1x64-520-recover-210-seed-1", _RECOVERED, "1x64", 520, 210,
     1, 256, SPLIT, "CPU"),
    ("learning", "split-1x64-760-joint-seed-2", _JOINT, "1x64", 760, 0, 1, 256, LEARNED, "CPU"),
    ("learning", "split-1x64-520-recover-210-seed-2", _RECOVERED, "1x64", 520, 210,
     1, 256, SPLIT, "CPU"),
    ("learning", "split-1x64-520-recover-420-graph", _RECOVERED, "1x64", 520, 420, 1, 256, SPLIT, "CPU"),
    ("learning", "split-1x64-520-recover-420-graph-seed-1", _RECOVERED, "1x64", 520, 420, 1, 256, SPLIT, "CPU"),
    ("learning", "split-1x64-520-recover-420-graph-seed-2", _RECOVERED, "1x64", 520, 420, 1, 256, SPLIT, "CPU"),
    ("learning", "split-1x64-520-recover-560-graph", _RECOVERED, "1x64", 520, 560, 1, 256, SPLIT, "CPU"),
    ("learning", "split-1x64-520-recover-560-graph-seed-1", _RECOVERED, "1x64", 520, 560, 1, 256, SPLIT, "CPU"),
    ("learning", "split-1x64-520-recover-560-graph-seed-2", _RECOVERED, "1x64", 520, 560, 1, 256, SPLIT, "CPU"),
    ("learning", "split-1x64-260-recover-280-seq512", _RECOVERED, "1x64", 260, 280, 1, 512, SPLIT, "CPU"),
    ("learning", "split-1x64-860-recover-940-seq128", _RECOVERED, "1x64", 860, 940, 1, 128, SPLIT, "CPU"),
    ("learning", "gpu-groupmask-200x4x256", _DEFAULT, "1x64", 200, 0, 4, 256, FROZEN, "H200"),
    ("learning", "gpu-groupmask-977x4x256", _DEFAULT, "1x64", 977, 0, 4, 256, FROZEN, "H200"),
    ("quality", "quality", "GroupMask 150 x 128", "1x256", 150, 0, 1, 128, FROZEN, "CPU"),
    ("decode", "front-learned-weights", "compiled lowered", "1x256", 300, 0, 1, 128, LEARNED, "CPU"),  # bf16 kernel
    ("learning", "weights-800x256-1x256", _JOINT, "1x256", 800, 0, 1, 256, LEARNED, "CPU"),
    ("learning", "weights-800x256-1x256-offset-4", _JOINT, "1x256", 800, 0, 1, 256, LEARNED,
     "CPU"),
    ("learning", "split-1x256-560-recover-200", _RECOVERED, "1x256", 560, 200, 1,
     256, SPLIT, "CPU"),
    ("learning", "split-1x256-560-recover-200-seed-1", _RECOVERED, "1x256", 560,
     200, 1, 256, SPLIT, "CPU"),
    ("learning", "split-1x256-560-recover-400-graph", _RECOVERED, "1x256", 560, 400, 1, 256, SPLIT, "CPU"),
    ("learning", "split-1x256-560-recover-400-graph-seed-1", _RECOVERED, "1x256", 560, 400, 1, 256, SPLIT, "CPU"),
    ("learning", "split-1x256-560-recover-400-graph-seed-2", _RECOVERED, "1x256", 560, 400, 1, 256, SPLIT, "CPU"),
]
GROUPS = ("1x64", "1x256")  # the plot's panels
SEED = 42  # a row's seed where its record names none: gmc's default
BASELINES = ("SparseGPT 2:4", "SparseGPT 2:4 + recovery")  # rows of quality.json's record quality


def _records(name: str) -> dict[str, dict]:
    return {r["name"]: r for r in load(name)}


def _rows(record: dict, label: str, group: str | None = None) -> list[dict]:
    """The rows of ``record`` with ``label`` (and, where given, ``group`` at 50%): one a seed."""
    key = "label" if "label" in record["rows"][0] else "row"
    rows = [row for row in record["rows"] if row[key] == label and (group is None or (
        row.get("group", row.get("pattern", group)) == group and row.get("sparsity", 0.5) == 0.5))]
    if not rows:
        raise SystemExit(f"learning_curve: record {record['name']!r} has no row {label!r} {group or ''}")
    return rows


def _row(record: dict, label: str) -> dict:
    rows = _rows(record, label)
    if len(rows) != 1:
        raise SystemExit(f"learning_curve: record {record['name']!r} has {len(rows)} rows {label!r}")
    return rows[0]


def points(files: dict[str, dict[str, dict]]) -> list[dict]:
    """The measured points, each with its tokens (joint and recovery steps together), perplexity,
    CPU-minutes (CPU runs), seed and record; ``files``: results file -> its records by name."""
    out = []
    for file, record, label, group, steps, recover, batch, seq_len, weights, where in POINTS:
        for row in _rows(files[file][record], label, group):
            ppl = row.get("ppl", row.get("held_out_ppl"))
            cpu_min = row["cpu_min"] if "cpu_min" in row else (row.get("cpu_seconds") or math.nan) / 60
            recipe = f"{steps} x {batch} x {seq_len}" + (f" + {recover} recovery" if recover else "")
            out.append({"group": group, "recipe": recipe, "tokens": (steps + recover) * batch * seq_len,
                        "weights": weights, "where": where, "batch": batch, "seed": row.get("seed", SEED), "ppl": ppl,
                        "cpu_min": cpu_min if where == "CPU" else math.nan,
                        "wall_s": row.get("seconds", math.nan) if where != "CPU" else math.nan,
                        "record": f"{file}.json {record}"})
    return out


def power_law(pts: list[dict]) -> tuple[float, float]:
    """Least-squares ``ppl = a * tokens**b`` in log-log space: returns (a, b)."""
    xs, ys = [math.log(p["tokens"]) for p in pts], [math.log(p["ppl"]) for p in pts]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return math.exp(my - b * mx), b


def baselines(quality: dict[str, dict]) -> dict[str, float]:
    return {label: _row(quality["quality"], label)["held_out_ppl"] for label in BASELINES}


def plot(pts: list[dict], fit: tuple[float, float], lines: dict[str, float], fit_split: tuple[float, float]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(GROUPS), figsize=(11, 4.5), sharex=True, sharey=True)
    series = [("CPU, batch 1, frozen weights", "CPU", FROZEN, "o", "C0"),
              ("CPU, batch 1, weights learned", "CPU", LEARNED, "^", "C2"),
              ("CPU, weights learned, then recovery", "CPU", SPLIT, "D", "C1"),
              ("H200, batch 4, frozen weights", "H200", FROZEN, "s", "C3")]
    for ax, group in zip(axes, GROUPS):
        for title, where, weights, marker, color in series:
            chosen = [p for p in pts if p["group"] == group and p["where"] == where and p["weights"] == weights]
            if not chosen:
                continue
            tokens = sorted({p["tokens"] for p in chosen})  # the line joins the medians over seeds
            medians = [statistics.median(p["ppl"] for p in chosen if p["tokens"] == t) for t in tokens]
            ax.plot(tokens, medians, color=color, alpha=0.6)
            ax.scatter([p["tokens"] for p in chosen], [p["ppl"] for p in chosen], marker=marker, color=color,
                       label=title, zorder=3)
        if group == "1x64":
            a, b = fit
            xs = [10 ** (4 + k / 20) for k in range(0, 53)]
            ax.plot(xs, [a * x ** b for x in xs], "--", color="C0", alpha=0.5,
                    label=f"fit to CPU frozen: tokens^{b:.2f}")
            a, b = fit_split
            xs = [x for x in xs if x >= 1e5]
            ax.plot(xs, [a * x ** b for x in xs], "--", color="C1", alpha=0.5,
                    label=f"fit to CPU learned, then recovery: tokens^{b:.2f}")
        for (name, value), style in zip(lines.items(), (":", "-.")):
            ax.axhline(value, color="k", linestyle=style, linewidth=1, label=f"{name} ({value:.2f})")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("training tokens (mask learning and recovery)")
        ax.set_title(f"GroupMask {group} at 50%, bundled SmolLM2-135M")
        ax.legend(fontsize=7)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("held-out perplexity (bundled-heldout)")
    fig.tight_layout()
    PLOT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(PLOT, dpi=110)


def main() -> None:
    files = {name: _records(name) for name in {p[0] for p in POINTS}}
    pts = points(files)
    fit = power_law([p for p in pts if p["group"] == "1x64" and p["where"] == "CPU" and p["weights"] == FROZEN])
    split = [p for p in pts if p["group"] == "1x64" and p["where"] == "CPU" and p["weights"] == SPLIT]
    fit_split = power_law(split)
    lines = baselines(files["quality"])
    plot(pts, fit, lines, fit_split)
    a, b = fit
    reach = {name: (value / a) ** (1 / b) for name, value in lines.items()}
    longest = max(p["tokens"] for p in split)  # the longest split recipe: its median CPU-minutes a token
    per_token = statistics.median(p["cpu_min"] / p["tokens"] for p in split if p["tokens"] == longest)
    a_split, b_split = fit_split
    targets = {"105": 105.0, **{f"{name} ({lines[name]:.2f})": lines[name] for name in lines if "recovery" in name}}
    reach_split = {name: (value / a_split) ** (1 / b_split) for name, value in targets.items()}
    record = {
        "name": "learning-curve-points", "title": "GroupMask at 50% against training tokens",
        "bench": "bench/learning_curve.py", "command": "python bench/learning_curve.py",
        "host": {"cpu": "named in each point's record", "cores": "2 (CPU rows) or 16 (H200 rows)"},
        "columns": [{"key": "group", "title": "group"}, {"key": "recipe", "title": "steps x blocks x tokens"},
                    {"key": "tokens", "title": "training tokens", "format": "{:,}"},
                    {"key": "weights", "title": "weights"}, {"key": "where", "title": "where"},
                    {"key": "seed", "title": "seed"}, {"key": "ppl", "title": "held-out ppl", "format": "{:.2f}"},
                    {"key": "cpu_min", "title": "CPU-min", "format": "{:.1f}"},
                    {"key": "wall_s", "title": "GPU wall s", "format": "{:.0f}"}, {"key": "record", "title": "record"}],
        "rows": sorted(pts, key=lambda p: (GROUPS.index(p["group"]), p["where"] != "CPU", p["tokens"], p["weights"])),
        "notes": [f"Fit, not measured: least squares through the CPU frozen-weight 1x64 points "
                  f"gives ppl = {a:.0f} x tokens^{b:.3f}; "
                  + "; ".join(f"it reaches {name} ({lines[name]:.2f}) at {reach[name]:,.0f} tokens"
                              for name in lines) + ".",
                  f"Fit, not measured: through the {len(split)} CPU 1x64 points learned with their weights and then "
                  f"recovered ({min(p['tokens'] for p in split):,}-{longest:,} tokens), ppl = {a_split:.0f} x "
                  f"tokens^{b_split:.3f}; "
                  + "; ".join(f"it reaches {name} at {reach_split[name]:,.0f} tokens, about "
                              f"{reach_split[name] * per_token:.0f} CPU-minutes at the longest recipe's median "
                              f"{per_token * 1e6:.1f} CPU-minutes a million tokens (2 threads)"
                              for name in targets) + ".",
                  "The rows differ in more than tokens: budget recipe, host (each record names it), threads, bf16 "
                  "and the compiled step from 800 x 1 x 256 on, the logits' start offset (4 in the split-* records "
                  "and in weights-800x256-1x256-offset-4, 3 before), batch 4 and bf16 on the H200. A recovery "
                  "row's tokens count both phases. Plot: docs/img/learning_curve.png."]}
    save_record("learning", record)
    print(f"{len(pts)} points; fit tokens^{b:.3f}; " + ", ".join(f"{n} at {t:,.0f} tokens" for n, t in reach.items()))


if __name__ == "__main__":
    main()
