"""The quality-speed front: held-out perplexity against decode tok/s of every row of some
``bench_decode.py`` records (bench/results/decode.json), at one thread count; a point is dominated
when another is at least as fast and at least as good, and better in one.

    python bench/front.py front --threads 2 --plot docs/front.png

prints the markdown table (dominated points marked) and writes the plot.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "decode.json"
PEERS = ("llama.cpp", "onnxruntime-genai")  # rows of other runtimes (bench_decode --peer)


def points(names: list[str], threads: int) -> list[dict]:
    records = {r["name"]: r for r in json.loads(RESULTS.read_text())}
    missing = [name for name in names if name not in records]
    if missing:
        raise SystemExit(f"front: decode.json has no record {missing[0]!r}")
    chosen = []
    for name in names:
        sparsity = records[name]["title"].split(" at ")[1].split(" ")[0] if " at " in records[name]["title"] else ""
        for row in records[name]["rows"]:
            if (row["threads"] != threads or not math.isfinite(row.get("ppl", math.nan))
                    or row["row"] == "HF eager dense"):
                continue
            # lowered rows of the record's own masks take its sparsity (--more-artifacts rows carry theirs;
            # dense and peer rows have none)
            own = "dense" in row["row"] or row["row"].startswith(PEERS) or row["row"].endswith("%")
            label = row["row"] if own else f"{row['row']} {sparsity}"
            chosen.append({"label": label, "tok_s": row["tok_s"], "ppl": row["ppl"], "weights": row["precision"],
                           "record": name})
    for p in chosen:
        p["dominated_by"] = next((q["label"] for q in chosen if q is not p and q["tok_s"] >= p["tok_s"]
                                  and q["ppl"] <= p["ppl"] and (q["tok_s"] > p["tok_s"] or q["ppl"] < p["ppl"])), "")
    return sorted(chosen, key=lambda p: -p["tok_s"])


def table(front: list[dict]) -> str:
    lines = ["| row | weights | decode tok/s | held-out ppl | dominated by |", "|---|---|---|---|---|"]
    for p in front:
        lines.append(f"| {p['label']} | {p['weights']} | {p['tok_s']:.1f} | {p['ppl']:.2f} "
                     f"| {p['dominated_by'] or '-'} |")
    return "\n".join(lines)


def plot(front: list[dict], path: Path, threads: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7.5, 4.8))
    for p in front:
        peer = p["label"].startswith(PEERS)
        marker = "s" if peer else ("o" if "dense" in p["label"] else "^")
        color = "0.6" if p["dominated_by"] else ("tab:red" if peer else "tab:blue")
        axes.scatter(p["tok_s"], p["ppl"], marker=marker, color=color, zorder=3)
    labelled = [p for p in front if not p["dominated_by"] or p["label"].startswith(PEERS)]  # the rest: the table
    for i, p in enumerate(sorted(labelled, key=lambda p: p["tok_s"])):
        axes.annotate(p["label"].replace("compiled ", ""), (p["tok_s"], p["ppl"]), fontsize=7, rotation=30,
                      xytext=(4, 5) if i % 2 else (4, -14), textcoords="offset points")  # neighbours apart
    best = [p for p in front if not p["dominated_by"]]
    axes.plot([p["tok_s"] for p in best], [p["ppl"] for p in best], color="tab:blue", linewidth=1, zorder=2)
    axes.set_yscale("log")
    axes.set_xlim(0, max(p["tok_s"] for p in front) * 1.2)
    axes.set_ylim(min(p["ppl"] for p in front) * 0.9, max(p["ppl"] for p in front) * 1.6)
    axes.set_xlabel(f"decode tok/s, batch 1, {threads} threads")
    axes.set_ylabel("held-out perplexity (log)")
    axes.set_title("SmolLM2-135M: gmc (circles dense, triangles lowered) and peers (squares: llama.cpp, "
                   "onnxruntime-genai); grey: dominated", fontsize=8)
    axes.grid(True, which="both", linewidth=0.3)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("records", nargs="+", help="record names of bench/results/decode.json")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args()
    front = points(args.records, args.threads)
    print(table(front))
    if args.plot:
        plot(front, args.plot, args.threads)


if __name__ == "__main__":
    main()
