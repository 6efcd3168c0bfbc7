"""Held-out perplexity of learned GroupMask 1x64 at 50% against training tokens, from the records.

Gathers the measured points (bench/results/learning.json and quality.json), fits a power law
through the frozen-weight points of one recipe (batch 1), and writes

- the record ``learning-curve-points`` of bench/results/learning.json (the table docs/quality.md
  embeds through ``python bench/results_tables.py --fill docs/quality.md``);
- ``docs/img/learning_curve.png``: the points, the fit, SparseGPT 2:4 with and without recovery.

    python bench/learning_curve.py
"""
from __future__ import annotations

import math
from pathlib import Path

from records import save_record
from results_tables import load

PLOT = Path(__file__).resolve().parent.parent / "docs" / "img" / "learning_curve.png"

# (results file, record, row label, steps, blocks per step, tokens per block, weights, where)
POINTS = [
    ("learning", "weights-130x128", "GroupMask (full head, no noise)", 130, 1, 128, "frozen", "CPU"),
    ("learning", "weights-130x128", "GroupMask + weight learning", 130, 1, 128, "learned", "CPU"),
    ("quality", "quality", "GroupMask (gmc's recipe), 150 steps x 128 tokens", 150, 1, 128, "frozen", "CPU"),
    ("quality", "quality", "GroupMask (gmc's recipe), 300 steps x 256 tokens", 300, 1, 256, "frozen", "CPU"),
    ("learning", "frozen-800x256", "GroupMask, default (full head, no noise, schedule budget)",
     800, 1, 256, "frozen", "CPU"),
    ("learning", "weights-800x256", "GroupMask + weight learning", 800, 1, 256, "learned", "CPU"),
    ("learning", "gpu-groupmask-200x4x256", "GroupMask, default (full head, no noise, schedule budget)",
     200, 4, 256, "frozen", "H200"),
    ("learning", "gpu-groupmask-977x4x256", "GroupMask, default (full head, no noise, schedule budget)",
     977, 4, 256, "frozen", "H200"),
]
BASELINES = ("SparseGPT 2:4", "SparseGPT 2:4 + recovery")  # rows of quality.json's record quality


def _records(name: str) -> dict[str, dict]:
    return {r["name"]: r for r in load(name)}


def _row(record: dict, label: str) -> dict:
    key = "label" if "label" in record["rows"][0] else "row"
    rows = [row for row in record["rows"] if row[key] == label]
    if len(rows) != 1:
        raise SystemExit(f"learning_curve: record {record['name']!r} has {len(rows)} rows {label!r}")
    return rows[0]


def points(files: dict[str, dict[str, dict]]) -> list[dict]:
    """The measured points, each with its tokens, perplexity, CPU-minutes (CPU runs) and record;
    ``files``: results file -> its records by name."""
    out = []
    for file, record, label, steps, batch, seq_len, weights, where in POINTS:
        row = _row(files[file][record], label)
        ppl = row.get("ppl", row.get("held_out_ppl"))
        cpu_min = row["cpu_min"] if "cpu_min" in row else (row.get("cpu_seconds") or math.nan) / 60
        out.append({"recipe": f"{steps} x {batch} x {seq_len}", "tokens": steps * batch * seq_len, "weights": weights,
                    "where": where, "batch": batch, "ppl": ppl, "cpu_min": cpu_min if where == "CPU" else math.nan,
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


def plot(pts: list[dict], fit: tuple[float, float], lines: dict[str, float]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = [("CPU, batch 1, frozen weights", "CPU", "frozen", "o", "C0"),
              ("CPU, batch 1, weights learned", "CPU", "learned", "^", "C2"),
              ("H200, batch 4, frozen weights", "H200", "frozen", "s", "C3")]
    for title, where, weights, marker, color in series:
        chosen = sorted((p for p in pts if p["where"] == where and p["weights"] == weights), key=lambda p: p["tokens"])
        ax.plot([p["tokens"] for p in chosen], [p["ppl"] for p in chosen], marker=marker, color=color, label=title)
    a, b = fit
    xs = [10 ** (4 + k / 20) for k in range(0, 53)]
    ax.plot(xs, [a * x ** b for x in xs], "--", color="C0", alpha=0.5, label=f"fit to CPU frozen: tokens^{b:.2f}")
    for (name, value), style in zip(lines.items(), (":", "-.")):
        ax.axhline(value, color="k", linestyle=style, linewidth=1, label=f"{name} ({value:.2f})")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("training tokens")
    ax.set_ylabel("held-out perplexity (bundled-heldout)")
    ax.set_title("GroupMask 1x64 at 50%, bundled SmolLM2-135M")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    PLOT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(PLOT, dpi=110)


def main() -> None:
    files = {name: _records(name) for name in {p[0] for p in POINTS}}
    pts = points(files)
    fit = power_law([p for p in pts if p["where"] == "CPU" and p["weights"] == "frozen"])
    lines = baselines(files["quality"])
    plot(pts, fit, lines)
    a, b = fit
    reach = {name: (value / a) ** (1 / b) for name, value in lines.items()}
    record = {
        "name": "learning-curve-points", "title": "GroupMask 1x64 at 50% against training tokens",
        "bench": "bench/learning_curve.py", "command": "python bench/learning_curve.py",
        "host": {"cpu": "named in each point's record", "cores": "2 (CPU rows) or 16 (H200 rows)"},
        "columns": [{"key": "recipe", "title": "steps x blocks x tokens"},
                    {"key": "tokens", "title": "training tokens", "format": "{:,}"},
                    {"key": "weights", "title": "weights"}, {"key": "where", "title": "where"},
                    {"key": "ppl", "title": "held-out ppl", "format": "{:.2f}"},
                    {"key": "cpu_min", "title": "CPU-min", "format": "{:.1f}"},
                    {"key": "wall_s", "title": "GPU wall s", "format": "{:.0f}"}, {"key": "record", "title": "record"}],
        "rows": sorted(pts, key=lambda p: (p["where"] != "CPU", p["tokens"], p["weights"])),
        "notes": [f"Fit, not measured: least squares through the CPU frozen-weight points "
                  f"gives ppl = {a:.0f} x tokens^{b:.3f}; "
                  + "; ".join(f"it reaches {name} ({lines[name]:.2f}) at {reach[name]:,.0f} tokens"
                              for name in lines) + ".",
                  "The rows differ in more than tokens: budget recipe, host, threads, bf16 and the compiled step "
                  "in the 800 x 1 x 256 pair, batch 4 and bf16 on the H200. Plot: docs/img/learning_curve.png."]}
    save_record("learning", record)
    print(f"{len(pts)} points; fit tokens^{b:.3f}; " + ", ".join(f"{n} at {t:,.0f} tokens" for n, t in reach.items()))


if __name__ == "__main__":
    main()
