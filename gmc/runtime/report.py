"""Where the sparsity budget went: the analysis of docs/design.md section 7 for any masks artifact.

Each target's sparsity is measured on the masks (a manifest's ``layer_sparsity`` is only used for
an artifact without a masks file), with weight shapes from the manifest's ``shapes``. A target's
*preserved rate* is ``1 - sparsity``; rates of a projection type or block are parameter-weighted.
Target names such as ``model.layers.12.self_attn.q_proj`` give the layer index (the first
``.<int>.`` in the name) and the projection type (the last component without ``_proj``).

Outputs (``write_report``): ``report.json``, ``report.md``, ``rates_by_layer.png`` (preserved rate
per projection type over depth, with the budget line) and ``attention_vs_mlp.png`` (per-layer
attention vs MLP preserved rate, with the budget line).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from gmc.config import __version__, output_option, overwrite_option
from gmc.errors import GmcError
from gmc.formats.artifact import MANIFEST_FILE
from gmc.formats.outputs import check_output, output_path
from gmc.graph.targets import PROJECTIONS as TARGET_PROJECTIONS
from gmc.graph.targets import projection

PROJECTIONS = tuple(name.removesuffix("_proj") for name in TARGET_PROJECTIONS)  # plotting and table order
ATTENTION, MLP = ("q", "k", "v", "o"), ("gate", "up", "down")
RATES_PNG, BLOCKS_PNG = "rates_by_layer.png", "attention_vs_mlp.png"
_LAYER_RE = re.compile(r"\.(\d+)(?:\.|$)")


@dataclass
class ReportConfig:
    artifact: str
    output: str | None = output_option("Report directory [default: ARTIFACT/report].")
    overwrite: bool = overwrite_option("report at the output directory")

    def __post_init__(self):
        path = Path(self.artifact).expanduser()
        if path.is_file() and path.name == MANIFEST_FILE:
            path = path.parent
        if not (path / MANIFEST_FILE).is_file():
            raise GmcError(f"not a masks artifact: {self.artifact} has no manifest.json")
        self.artifact = str(path)
        if self.output is None:
            self.output = str(path / "report")
        self.output = str(output_path(self.output))


@dataclass(frozen=True)
class TargetRate:
    name: str
    layer: int
    proj: str  # q, k, v, o, gate, up, down, or the module's own name for other layouts
    block: str  # "attention", "mlp" or "other"
    params: int
    preserved: float  # 1 - sparsity of this target


def parse_target(name: str) -> tuple[int, str, str]:
    """``model.layers.12.self_attn.q_proj`` -> ``(12, "q", "attention")``."""
    match = _LAYER_RE.search(name)
    if match is None:
        raise GmcError(
            f"cannot read a layer index from target {name!r}: expected a name like model.layers.3.mlp.up_proj"
        )
    proj = projection(name)
    parents = name.lower().rsplit(".", 1)[0]
    if proj in ATTENTION or "attn" in parents or "attention" in parents:
        block = "attention"
    elif proj in MLP or any(word in parents for word in ("mlp", "feed_forward", "ffn")):
        block = "mlp"
    else:
        block = "other"
    return int(match[1]), proj, block


def target_rates(manifest: dict, masks: dict | None = None) -> list[TargetRate]:
    """One ``TargetRate`` per target: sparsity measured on ``masks`` when given (else the manifest's
    ``layer_sparsity``), weight shapes from the manifest's ``shapes``."""
    from gmc.groups import layer_sparsity, parse_pattern

    sparsity = manifest.get("layer_sparsity")
    if not isinstance(sparsity, dict) or not sparsity:
        raise GmcError("manifest has no layer_sparsity: not a gmc masks artifact")
    shapes = manifest.get("shapes")
    if not isinstance(shapes, dict):
        raise GmcError("manifest has no shapes: not a gmc masks artifact")
    rates = []
    for name, value in sparsity.items():
        layer, proj, block = parse_target(name)
        if name not in shapes:
            raise GmcError(f"manifest gives no shape for target {name!r}: corrupted artifact")
        d_out, d_in = shapes[name]
        if masks is not None:
            value = layer_sparsity(parse_pattern(manifest["group"]), masks[name], (int(d_out), int(d_in)))
        elif not isinstance(value, (int, float)) or isinstance(value, bool) or not -1e-9 <= value <= 1 + 1e-9:
            raise GmcError(f"manifest layer_sparsity of {name} is {json.dumps(value)[:40]}: corrupted artifact")
        rates.append(TargetRate(name, layer, proj, block, int(d_out) * int(d_in), 1.0 - float(value)))
    return rates


# --------------------------------------------------------------------------- analysis


def analyse(rates: list[TargetRate], target_sparsity: float) -> dict:
    """The numbers of docs/design.md section 7 (keys documented in docs/eval.md)."""
    layers = sorted({r.layer for r in rates})
    projections = _ordered({r.proj for r in rates})
    grid = {p: {r.layer: r.preserved for r in rates if r.proj == p} for p in projections}  # proj -> layer -> rate
    total_params = sum(r.params for r in rates)
    total_kept = sum(r.params * r.preserved for r in rates)
    budget = 1.0 - target_sparsity
    return {
        "target_sparsity": target_sparsity,
        "preserved_budget": budget,
        "global_preserved": total_kept / total_params,
        "layers": layers,
        "projections": projections,
        "rate_by_layer": {p: [grid[p].get(layer) for layer in layers] for p in projections},
        "by_projection": {p: _group_stats([r for r in rates if r.proj == p], total_params, total_kept)
                          for p in projections},
        "by_block": {b: _group_stats([r for r in rates if r.block == b], total_params, total_kept)
                     for b in ("attention", "mlp", "other") if any(r.block == b for r in rates)},
        "block_rate_by_layer": {b: [_weighted([r for r in rates if r.block == b and r.layer == layer])
                                    for layer in layers] for b in ("attention", "mlp")},
        "qkv_preserved_rate": _mean_of(grid, rates, ("q", "k", "v")),
        "correlations": {"q_vs_k": _pearson(grid, "q", "k"), "gate_vs_up": _pearson(grid, "gate", "up")},
        "variance_share": _variance_shares(rates),
        "beyond_target": _beyond_target(rates, target_sparsity, total_params),
    }


def _ordered(names: set[str]) -> list[str]:
    return [p for p in PROJECTIONS if p in names] + sorted(names - set(PROJECTIONS))


def _weighted(rates: list[TargetRate]) -> float | None:
    params = sum(r.params for r in rates)
    return sum(r.params * r.preserved for r in rates) / params if params else None


def _group_stats(rates: list[TargetRate], total_params: int, total_kept: float) -> dict:
    params = sum(r.params for r in rates)
    kept = sum(r.params * r.preserved for r in rates)
    return {
        "targets": len(rates),
        "params": params,
        "param_share": params / total_params,
        "preserved_rate": kept / params,
        "preserved_share": kept / total_kept if total_kept else 0.0,  # of all preserved params
        "min_rate": min(r.preserved for r in rates),
        "max_rate": max(r.preserved for r in rates),
    }


def _mean_of(grid, rates, projections) -> float | None:
    """Mean over ``projections`` of each one's parameter-weighted preserved rate (paper's QKV)."""
    if not all(p in grid for p in projections):
        return None
    return sum(_weighted([r for r in rates if r.proj == p]) for p in projections) / len(projections)


def _pearson(grid, a: str, b: str) -> float | None:
    """Pearson r of the rates of ``a`` and ``b`` over the layers having both; None if undefined."""
    if a not in grid or b not in grid:
        return None
    layers = sorted(set(grid[a]) & set(grid[b]))
    x, y = [grid[a][n] for n in layers], [grid[b][n] for n in layers]
    if len(layers) < 2:
        return None
    mx, my = sum(x) / len(x), sum(y) / len(y)
    sxy = sum((u - mx) * (v - my) for u, v in zip(x, y))
    sxx, syy = sum((u - mx) ** 2 for u in x), sum((v - my) ** 2 for v in y)
    if sxx <= 1e-24 or syy <= 1e-24:
        return None  # a constant series has no correlation
    return sxy / math.sqrt(sxx * syy)


def _variance_shares(rates: list[TargetRate]) -> dict:
    """Two-way decomposition of the variance of the target rates (each target counts once):
    between projection types / total, between layers / total, and the rest (interaction)."""
    values = [r.preserved for r in rates]
    grand = sum(values) / len(values)
    total = sum((v - grand) ** 2 for v in values)
    if total <= 1e-24:
        return {"projection_type": None, "depth": None, "interaction": None, "total_variance": 0.0}
    by_type = _between(rates, lambda r: r.proj, grand)
    by_depth = _between(rates, lambda r: r.layer, grand)
    return {
        "projection_type": by_type / total,
        "depth": by_depth / total,
        "interaction": 1.0 - (by_type + by_depth) / total,
        "total_variance": total / len(values),
    }


def _between(rates, key, grand: float) -> float:
    groups: dict = {}
    for r in rates:
        groups.setdefault(key(r), []).append(r.preserved)
    return sum(len(v) * (sum(v) / len(v) - grand) ** 2 for v in groups.values())


def _beyond_target(rates: list[TargetRate], target_sparsity: float, total_params: int) -> dict:
    """Targets pruned harder than the global target, and their share of all target parameters."""
    beyond = [r for r in rates if 1.0 - r.preserved > target_sparsity + 1e-9]
    return {
        "fraction_of_params": sum(r.params for r in beyond) / total_params,
        "targets": len(beyond),
        "of_targets": len(rates),
    }


# --------------------------------------------------------------------------- outputs


def build_report(config: ReportConfig) -> dict:
    """Read the artifact and analyse it; the JSON-ready report. Per-target sparsity is measured on
    the masks (validated by ``load_artifact``); only an artifact without a masks file is reported
    from its manifest's numbers."""
    from gmc.formats.artifact import MASKS_FILE, load_artifact

    manifest = _read_manifest(Path(config.artifact))
    masks = None
    if (Path(config.artifact) / MASKS_FILE).exists():
        artifact = load_artifact(config.artifact)
        manifest, masks = artifact.manifest, artifact.masks
    rates = target_rates(manifest, masks)
    target = manifest.get("target_sparsity")
    if target is None:
        target = manifest.get("global_sparsity")
    if not isinstance(target, (int, float)) or isinstance(target, bool):
        raise GmcError(f"corrupted artifact {config.artifact}: manifest target_sparsity is {json.dumps(target)[:40]}")
    report = {
        "gmc_version": __version__,
        "artifact": config.artifact,
        "source": {key: manifest.get(key) for key in
                   ("model", "model_fingerprint", "group", "method", "allocation", "target_sparsity",
                    "global_sparsity", "calibration", "seed")},
        "sparsity_from": "masks" if masks is not None else "manifest (no masks file)",
        **analyse(rates, float(target)),
        "targets": [vars(r) for r in rates],
    }
    return report


def _read_manifest(path: Path) -> dict:
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise GmcError(f"corrupted artifact {path}: manifest.json is not valid JSON ({error})") from error
    if not isinstance(manifest, dict):
        raise GmcError(f"corrupted artifact {path}: manifest.json holds a JSON {type(manifest).__name__}, "
                       f"not an object")
    return manifest


def write_report(config: ReportConfig) -> dict:
    """Analyse the artifact and atomically write the report directory; returns the report."""
    from gmc.formats.atomic import atomic_dir

    check_output(config.output, "report", overwrite=config.overwrite, inputs=[config.artifact])
    report = build_report(config)
    with atomic_dir(config.output, "report", config.overwrite) as tmp:
        plot_rates_by_layer(report, tmp / RATES_PNG)
        plot_attention_vs_mlp(report, tmp / BLOCKS_PNG)
        (tmp / "report.json").write_text(json.dumps(report, indent=2) + "\n")
        (tmp / "report.md").write_text(report_markdown(report))
    return report


def _title(report: dict) -> str:
    source = report["source"]
    return (f"{source.get('model')} · {source.get('method')} · {source.get('group')} · "
            f"target sparsity {report['target_sparsity']:.2f}")


def plot_rates_by_layer(report: dict, path: Path) -> None:
    """One line per projection type: preserved rate over layer index, budget as a dotted line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.8), dpi=110)
    colors = plt.get_cmap("tab10")
    for i, proj in enumerate(report["projections"]):
        points = [(layer, rate) for layer, rate in zip(report["layers"], report["rate_by_layer"][proj])
                  if rate is not None]
        style = "-" if proj in ATTENTION else "--"
        ax.plot(*zip(*points), style, marker="o", markersize=3, color=colors(i % 10), label=proj)
    ax.axhline(report["preserved_budget"], color="black", linestyle=":", label="budget")
    ax.set(xlabel="layer", ylabel="preserved rate (1 - sparsity)", ylim=(0, 1.02),
           title=f"Preserved rate by layer\n{_title(report)}")
    _finish(ax)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_attention_vs_mlp(report: dict, path: Path) -> None:
    """Per-layer bars of the attention and MLP preserved rates, budget as a dotted line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = report["layers"]
    fig, ax = plt.subplots(figsize=(10, 4.8), dpi=110)
    width = 0.4
    for offset, block, color in ((-width / 2, "attention", "tab:blue"), (width / 2, "mlp", "tab:orange")):
        values = [v if v is not None else 0.0 for v in report["block_rate_by_layer"][block]]
        overall = report["by_block"].get(block, {}).get("preserved_rate")
        label = f"{block} (overall {overall:.3f})" if overall is not None else block
        ax.bar([layer + offset for layer in layers], values, width, color=color, label=label)
    ax.axhline(report["preserved_budget"], color="black", linestyle=":",
               label=f"budget {report['preserved_budget']:.3f}")
    ax.set(xlabel="layer", ylabel="preserved rate (1 - sparsity)", ylim=(0, 1.02),
           title=f"Attention vs MLP preserved rate\n{_title(report)}")
    _finish(ax)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _finish(ax) -> None:
    """Integer layer ticks, a light grid and the legend outside the plot area."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)


def summary_rows(report: dict) -> tuple[list[str], list[list[str]]]:
    """The per-projection table (terminal and markdown)."""
    header = ["projection", "targets", "param share", "preserved rate", "min..max over layers",
              "share of preserved"]
    rows = []
    groups = [(p, report["by_projection"][p]) for p in report["projections"]]
    groups += [(b, stats) for b, stats in report["by_block"].items()]
    for name, stats in groups:
        rows.append([name, str(stats["targets"]), f"{stats['param_share']:.1%}", f"{stats['preserved_rate']:.3f}",
                     f"{stats['min_rate']:.3f}..{stats['max_rate']:.3f}", f"{stats['preserved_share']:.1%}"])
    return header, rows


def key_numbers(report: dict) -> list[tuple[str, str]]:
    """The headline numbers of docs/design.md section 7 as (label, value) pairs."""
    def fmt(value, spec=".3f"):
        return "n/a (undefined)" if value is None else format(value, spec)

    shares = report["variance_share"]
    beyond = report["beyond_target"]
    return [
        ("target sparsity / achieved", f"{report['target_sparsity']:.3f} / {1 - report['global_preserved']:.3f}"),
        ("QKV preserved rate (mean of q, k, v)", fmt(report["qkv_preserved_rate"])),
        ("attention / MLP preserved rate",
         f"{fmt(report['by_block'].get('attention', {}).get('preserved_rate'))} / "
         f"{fmt(report['by_block'].get('mlp', {}).get('preserved_rate'))}"),
        ("Pearson r, Q vs K across layers", fmt(report["correlations"]["q_vs_k"])),
        ("Pearson r, gate vs up across layers", fmt(report["correlations"]["gate_vs_up"])),
        ("variance share: projection type / depth / interaction",
         f"{fmt(shares['projection_type'], '.1%')} / {fmt(shares['depth'], '.1%')} / "
         f"{fmt(shares['interaction'], '.1%')}"),
        ("target params in projections pruned beyond the target",
         f"{beyond['fraction_of_params']:.1%} ({beyond['targets']} of {beyond['of_targets']} targets)"),
    ]


def report_markdown(report: dict) -> str:
    source = report["source"]
    lines = [
        f"# Sparsity report: {report['artifact']}",
        "",
        f"Model `{source.get('model')}`, method `{source.get('method')}`, group `{source.get('group')}`, "
        f"allocation `{source.get('allocation')}`, calibration `{source.get('calibration')}`; "
        f"preserved rate = 1 - sparsity, parameter-weighted; gmc {report['gmc_version']}.",
        "",
    ]
    lines += [f"- {label}: **{value}**" for label, value in key_numbers(report)]
    header, rows = summary_rows(report)
    lines += ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    lines += ["", f"![preserved rate by layer]({RATES_PNG})", "", f"![attention vs MLP]({BLOCKS_PNG})", ""]
    return "\n".join(lines)
