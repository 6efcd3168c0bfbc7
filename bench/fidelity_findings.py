"""The GroupMask paper's findings as data, and how this run's rows are judged against them.

``FINDINGS`` is the table: each claim with the paper's numbers for it (``paper_values``, filled into
the ``paper`` template), the function that reads this run's side off the rows (``measure``) and the
rule that turns that measurement into a verdict. ``judge(results)`` checks every finding whose rows
were run; ``fidelity_render`` prints the verdicts. No number of the paper lives anywhere else.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Mapping, Optional

from fidelity_plan import SHAPE_SWEEP, SPARSITY_SWEEP

from gmc.masks.sources import LEARNED_METHODS


@dataclass(frozen=True)
class PaperSetup:
    """What the paper's numbers were measured on (the protocol and disagreement sections print it)."""

    model: str = "LLaMA-2-7B"
    data: str = "WikiText-2"
    seq_len: int = 2048
    steps: int = 40_000
    group: str = "1x256"
    zero_shot_tasks: int = 6


PAPER = PaperSetup()


@dataclass(frozen=True)
class Measured:
    """This run's side of a finding: the numbers the rule reads and how the tables print them."""

    values: dict
    text: str


@dataclass(frozen=True)
class Finding:
    """One claim of the paper, the paper's numbers for it and how this run checks it."""

    number: str  # "1", "5b", "7a": its section is the leading digit
    claim: str
    paper: str  # the paper's side, a template over paper_values
    paper_values: Mapping[str, object]  # the paper's numbers ({} where it has none)
    measure: Callable[[dict], Optional[Measured]]  # results -> this run's side; None: its rows were not run
    rule: Callable[[dict], str]  # Measured.values -> "agrees" / "partly" / "DISAGREES" / "no paper number; ..."
    rows: tuple[str, ...]  # the learned rows the verdict rests on (see ``judge``)

    @property
    def paper_text(self) -> str:
        return self.paper.format(**self.paper_values)


@dataclass(frozen=True)
class Verdict:
    """A finding checked against this run's rows."""

    finding: Finding
    gmc: str
    verdict: str  # "agrees", "DISAGREES", "partly", "inconclusive (...)", "no paper number; ..."
    caveat: str = ""  # what weakens the verdict without overturning it

    @property
    def number(self) -> str:
        return self.finding.number

    @property
    def claim(self) -> str:
        return self.finding.claim

    @property
    def paper(self) -> str:
        return self.finding.paper_text

    @property
    def shown(self) -> str:
        """The verdict as the tables print it."""
        return f"{self.verdict} (caveat: {self.caveat})" if self.caveat else self.verdict


def fmt(value, spec=".2f") -> str:
    if value is not None and spec == ".2f" and abs(value) >= 1e5:
        spec = ".3g"  # perplexities of broken masks: 1.46e+11, not 145590069668.35
    return "n/a" if value is None else format(value, spec)


def group_weights(group: str) -> int:
    g_out, g_in = (int(x) for x in group.split("x"))
    return g_out * g_in


# --------------------------------------------------------------------------- this run's side


def _ppl(results, key) -> Optional[float]:
    return results[key]["ppl"] if key in results else None


def _zs(results, key) -> Optional[float]:
    return results[key].get("zero_shot_mean") if key in results else None


def _versus(a: str, b: str, kd: bool = False) -> Callable[[dict], Optional[Measured]]:
    """Row ``a`` against row ``b``: perplexity, jargon_next where both have it, final KD loss if ``kd``."""

    def measure(results):
        if a not in results or b not in results:
            return None
        za, zb = _zs(results, a), _zs(results, b)
        text = f"ppl {fmt(results[a]['ppl'])} vs {fmt(results[b]['ppl'])}"
        text += "" if za is None or zb is None else f"; jargon_next {za:.3f} vs {zb:.3f}"
        if kd:
            text += (f"; final train KD {fmt(results[a].get('final_kd'), '.3f')} vs "
                     f"{fmt(results[b].get('final_kd'), '.3f')}")
        return Measured({"ppl": results[a]["ppl"], "ppl_other": results[b]["ppl"], "zs": za, "zs_other": zb}, text)

    return measure


def _group_shapes(results) -> Optional[Measured]:
    shapes = [(key, group) for group, key in SHAPE_SWEEP if key in results]
    if len(shapes) < 3:
        return None
    rho = _spearman([group_weights(g) for _, g in shapes], [results[k]["ppl"] for k, _ in shapes])
    rows = [results[k]["ppl"] for k, g in shapes if g.startswith("1x")]
    square = [results[k]["ppl"] for k, g in shapes if g in ("32x32", "64x64")]
    rows_best, square_best = min(rows) if rows else None, min(square) if square else None
    zs = [(g, _zs(results, k)) for k, g in shapes if _zs(results, k) is not None]
    text = (f"Spearman(weights per group, ppl) = {rho:+.2f}; best 1xN ppl {fmt(rows_best)}, "
            f"best of 32x32/64x64 {fmt(square_best)}"
            + (f"; jargon_next {', '.join(f'{g} {v:.3f}' for g, v in zs)}" if zs else ""))
    return Measured({"rho": rho, "rows_best": rows_best, "square_best": square_best}, text)


def _sparsity_curve(results) -> Optional[Measured]:
    curve = [(p, results[k]["ppl"]) for p, k in SPARSITY_SWEEP if k in results]
    if len(curve) < 3:
        return None
    return Measured({"curve": curve}, " / ".join(f"{p}%: {fmt(v)}" for p, v in curve))


_HEURISTIC_ROWS = ("magnitude-uniform", "magnitude-global", "magnitude-owl", "wanda-uniform", "wanda-global",
                   "wanda-owl")


def _learned_vs_heuristic(results) -> Optional[Measured]:
    heuristics = {k: results[k]["ppl"] for k in _HEURISTIC_ROWS if k in results}
    if "gm" not in results or not heuristics:
        return None
    best = min(heuristics, key=heuristics.get)
    return Measured({"gm": results["gm"]["ppl"], "best": heuristics[best]},
                    f"GroupMask {fmt(results['gm']['ppl'])} vs best heuristic ({best}) {fmt(heuristics[best])}")


def _heuristic_allocation(results) -> Optional[Measured]:
    if "gm" not in results or "wanda-uniform" not in results or not {"wanda-owl", "wanda-global"} & set(results):
        return None
    uniform, owl, global_ = (_ppl(results, k) for k in ("wanda-uniform", "wanda-owl", "wanda-global"))
    adaptive = min(math.inf if owl is None else owl, math.inf if global_ is None else global_)
    return Measured({"uniform": uniform, "adaptive": adaptive},
                    f"Wanda groups: uniform {fmt(uniform)}, OWL {fmt(owl)}, global {fmt(global_)}")


_TWO_FOUR_ROWS = ("wanda-2:4", "sparsegpt-2:4", "magnitude-2:4")


def _versus_two_four(results) -> Optional[Measured]:
    twofour = {k: results[k]["ppl"] for k in _TWO_FOUR_ROWS if k in results}
    paper_rows = [k for k in twofour if k != "magnitude-2:4"]  # the paper's 2:4 baselines
    if "gm" not in results or not paper_rows:
        return None
    gm = results["gm"]["ppl"]
    return Measured({"beaten": sum(gm < twofour[k] for k in paper_rows), "of": len(paper_rows)},
                    f"GroupMask {fmt(gm)} vs " + ", ".join(f"{k} {fmt(v)}" for k, v in twofour.items()))


def _analysis(results) -> Optional[dict]:
    return results["gm"].get("analysis") if "gm" in results else None


def _attention_vs_mlp(results) -> Optional[Measured]:
    a = _analysis(results)
    if not a or a["attention"] is None or a["mlp"] is None:
        return None
    return Measured({"attention": a["attention"], "mlp": a["mlp"]},
                    f"attention keeps {a['attention']:.1%}, MLP {a['mlp']:.1%}")


def _correlation(key: str) -> Callable[[dict], Optional[Measured]]:
    def measure(results):
        a = _analysis(results)
        return Measured({"r": a[key]}, f"Pearson r = {fmt(a[key], '.3f')}") if a else None

    return measure


def _deep_attention(results) -> Optional[Measured]:
    a = _analysis(results)
    if not a or None in (a["attention_deep"], a["attention_shallow"], a["mlp_deep"]):
        return None
    lo, hi = a["deep_layers"]
    return Measured({"deep": a["attention_deep"], "shallow": a["attention_shallow"], "mlp_deep": a["mlp_deep"]},
                    f"layers {lo}-{hi}: attention keeps {a['attention_deep']:.1%} (Q,K {a['qk_deep_mean']:.1%}) "
                    f"vs {a['attention_shallow']:.1%} in earlier layers; MLP {a['mlp_deep']:.1%}")


def _attention_projections(results) -> Optional[Measured]:
    a = _analysis(results)
    if not a or not all(x in a["by_projection"] for x in ("q", "k", "v", "o")):
        return None
    p = a["by_projection"]
    ratio = p["v"] / max((p["q"] + p["k"]) / 2, 1e-9)
    return Measured({"v_over_qk": ratio, "o_most": p["o"] >= max(p["q"], p["k"], p["v"])},
                    f"V/mean(Q,K) = {ratio:.2f}x; q/k/v/o keep "
                    f"{'/'.join(format(p[x], '.2f') for x in ('q', 'k', 'v', 'o'))}")


def _variance_shares(results) -> Optional[Measured]:
    a = _analysis(results)
    if not a:
        return None
    return Measured({"type": a["variance_type"], "depth": a["variance_depth"]},
                    f"{fmt(a['variance_type'], '.0%')} type, {fmt(a['variance_depth'], '.0%')} depth; "
                    f"{a['beyond_target']:.0%} beyond")


def _noise(results) -> Optional[Measured]:
    if "gm" not in results or "gm-noise" not in results:
        return None
    gm, noise = results["gm"], results["gm-noise"]
    return Measured({"off": gm["ppl"], "on": noise["ppl"]},
                    f"ppl off {fmt(gm['ppl'])} vs on {fmt(noise['ppl'])}; budget reached at step "
                    f"{gm.get('budget_step')} vs {noise.get('budget_step')}")


def _lowrank(results) -> Optional[Measured]:
    if "gm" not in results or "gm-lowrank" not in results:
        return None
    gm, low = results["gm"], results["gm-lowrank"]
    return Measured({"full": gm["ppl"], "lowrank": low["ppl"]},
                    f"ppl full {fmt(gm['ppl'])} ({gm['trainable_params']:,} params) vs lowrank "
                    f"{fmt(low['ppl'])} ({low['trainable_params']:,} params)")


# --------------------------------------------------------------------------- rules


def _beats(m: dict) -> str:
    """"Row a beats row b": lower ppl and, where measured, at least equal zero-shot."""
    better_ppl = m["ppl"] < m["ppl_other"]
    better_zs = None if m["zs"] is None or m["zs_other"] is None else m["zs"] >= m["zs_other"]
    if better_ppl and better_zs in (True, None):
        return "agrees"
    return "partly" if better_ppl or better_zs else "DISAGREES"


def _shapes_rule(m: dict) -> str:
    rows_win = None not in (m["rows_best"], m["square_best"]) and m["rows_best"] < m["square_best"]
    if m["rho"] > 0 and (m["square_best"] is None or rows_win):
        return "agrees"
    return "partly" if m["rho"] > 0 or rows_win else "DISAGREES"


def _monotone(m: dict) -> str:
    return "agrees" if all(b[1] > a[1] for a, b in zip(m["curve"], m["curve"][1:])) else "DISAGREES"


def _two_four_rule(m: dict) -> str:
    return "agrees" if m["beaten"] == m["of"] else ("partly" if m["beaten"] else "DISAGREES")


def _coupled(m: dict) -> str:
    r = m["r"]
    return "agrees" if r is not None and r >= 0.9 else ("partly" if r is not None and r >= 0.5 else "DISAGREES")


def _agrees_if(condition: Callable[[dict], bool]) -> Callable[[dict], str]:
    return lambda m: "agrees" if condition(m) else "DISAGREES"


# --------------------------------------------------------------------------- the table

_SHAPES = tuple(key for _, key in SHAPE_SWEEP)
_CURVE = tuple(key for _, key in SPARSITY_SWEEP)

FINDINGS = (
    Finding("1", "learned adaptive allocation beats learned uniform (same groups)",
            "ppl {ppl:.2f} vs {ppl_other:.2f}; zero-shot {zs:.3f} vs {zs_other:.3f} ({model}, {group})",
            dict(ppl=8.30, ppl_other=10.02, zs=0.496, zs_other=0.455, model=PAPER.model, group=PAPER.group),
            _versus("gm", "gm-uniform"), _beats, ("gm", "gm-uniform")),
    Finding("2", "the hypernetwork beats free logits",
            "zero-shot {zs:.3f} vs {zs_other:.3f}; lower training loss throughout", dict(zs=0.496, zs_other=0.403),
            _versus("gm", "direct", kd=True), _beats, ("gm", "direct")),
    Finding("3", "quality falls as groups hold more weights; 1xN rows beat 32x32",
            "zero-shot {zs_1x128:.3f} (1x128) ... {zs_128x128:.3f} (128x128), not strictly monotonic; "
            "ppl {ppl_1x256:.2f} (1x256) vs {ppl_32x32:.2f} (32x32)",
            dict(zs_1x128=0.502, zs_128x128=0.453, ppl_1x256=8.30, ppl_32x32=9.37),
            _group_shapes, _shapes_rule, _SHAPES),
    Finding("4", "perplexity rises monotonically with sparsity",
            "{s30:.2f} / {s40:.2f} / {s50:.2f} at 30/40/50% (32x32)", dict(s30=7.32, s40=8.25, s50=9.37),
            _sparsity_curve, _monotone, _CURVE),
    Finding("5", "learned group masks beat heuristic group masks under the same pattern",
            "not measured (the limitations section asks for it); implied by 1 and 6", {},
            _learned_vs_heuristic, _agrees_if(lambda m: m["gm"] < m["best"]), ("gm",)),
    Finding("5b", "non-uniform allocation helps under group sparsity even for heuristics",
            "suggested, not tested (N:M was said to be what limits non-uniform ratios)", {},
            _heuristic_allocation,
            lambda m: "no paper number; " + ("consistent" if m["adaptive"] < m["uniform"]
                                             else "inconsistent with the paper's suggestion"), ("gm",)),
    Finding("6", "learned group masks beat 2:4 (SparseGPT, Wanda) at 50%",
            "{gm:.2f} vs SparseGPT {sparsegpt:.2f}, Wanda {wanda:.2f}", dict(gm=8.30, sparsegpt=10.17, wanda=11.02),
            _versus_two_four, _two_four_rule, ("gm",)),
    Finding("7a", "attention is pruned more than the MLP",
            "attention keeps {attention:.1%}, MLP {mlp:.1%}", dict(attention=0.366, mlp=0.566),
            _attention_vs_mlp, _agrees_if(lambda m: m["attention"] < m["mlp"]), ("gm",)),
    Finding("7b", "Q and K rates are coupled across layers", "Pearson r = {r}", dict(r=0.994),
            _correlation("q_vs_k"), _coupled, ("gm",)),
    Finding("7c", "gate and up rates are coupled across layers", "Pearson r = {r}", dict(r=0.994),
            _correlation("gate_vs_up"), _coupled, ("gm",)),
    Finding("7d", "deep attention is pruned hardest",
            "layers {first}-{last}: Q, K keep ~{qk:.0%} of groups, down keeps >{down:.0%}",
            dict(first=22, last=31, qk=0.08, down=0.53),
            _deep_attention, _agrees_if(lambda m: m["deep"] < m["shallow"] and m["deep"] < m["mlp_deep"]), ("gm",)),
    Finding("7e", "V keeps more than Q/K; O keeps the most of attention",
            "V keeps ~{v_over_qk}x Q or K; O the most", dict(v_over_qk=2.2),
            _attention_projections,
            lambda m: "agrees" if m["v_over_qk"] > 1 and m["o_most"] else
            ("partly" if m["v_over_qk"] > 1 or m["o_most"] else "DISAGREES"), ("gm",)),
    Finding("7f", "variance of the rates: projection type vs depth; params beyond the target",
            "about {type} type, {depth} depth; ~{beyond:.0%} of params beyond {target:.0%}",
            dict(type=Fraction(1, 2), depth=Fraction(1, 3), beyond=0.40, target=0.5),
            _variance_shares,
            _agrees_if(lambda m: m["type"] is not None and m["depth"] is not None and m["type"] > m["depth"]),
            ("gm",)),
    Finding("8a", "noise on vs off (the paper describes Gumbel noise; the authors' code ran without)",
            "no number (DESIGN.md: the prototype with noise converged about {slower}x slower, worse ppl)",
            dict(slower=2),
            _noise, lambda m: "no paper number; " + ("noise off better" if m["off"] < m["on"] else "noise on better"),
            ("gm", "gm-noise")),
    Finding("8b", "paper head (128 params/group) vs lowrank head",
            "paper head only ({head_params_billions} B parameters for {model} {group})",
            dict(head_params_billions=3.2, model=PAPER.model, group=PAPER.group),
            _lowrank, lambda m: "no paper number; " + ("lowrank as good or better" if m["lowrank"] <= m["full"] * 1.02
                                                       else "lowrank worse"),
            ("gm", "gm-lowrank")),
)


def judge(results: dict) -> list[Verdict]:
    """Every checkable finding; a verdict resting on a learned row whose training masks pruned less
    than half of its budget (too few steps) is marked inconclusive, keeping the measured verdict; one
    resting on a row that got further but still needed the export threshold moved carries a caveat."""
    verdicts = []
    for finding in FINDINGS:
        measured = finding.measure(results)
        if measured is None:
            continue
        verdict, caveat = finding.rule(measured.values), ""
        learned = [k for k in finding.rows if k in results and results[k]["method"] in LEARNED_METHODS
                   and results[k].get("final_train_sparsity") is not None]
        short = [k for k in learned if results[k]["final_train_sparsity"] < 0.5 * results[k]["target_sparsity"]]
        moved = [k for k in learned if k not in short and results[k].get("threshold_moved")]
        if short:
            verdict = (f"inconclusive ({verdict} as measured, but {', '.join(short)} pruned "
                       f"{results[short[0]]['final_train_sparsity']:.0%} during training: too few steps)")
        elif moved:
            reached = ", ".join(f"{k} {results[k]['final_train_sparsity']:.0%} of {results[k]['target_sparsity']:.0%}"
                                for k in moved)
            caveat = f"training reached only {reached}; the export threshold chose the rest"
        verdicts.append(Verdict(finding, measured.text, verdict, caveat))
    return verdicts


def _spearman(x: list[float], y: list[float]) -> float:
    def ranks(values):
        order = sorted(range(len(values)), key=lambda i: values[i])
        out = [0.0] * len(values)
        i = 0
        while i < len(order):  # average ranks over ties
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    rx, ry = ranks(x), ranks(y)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx, syy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else 0.0
