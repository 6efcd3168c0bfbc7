"""One-shot masks from per-weight scores: the baselines every learned mask is compared against.

A one-shot mask source (``gmc.masks.sources``: ``magnitude`` scores ``|W_ij|``, ``wanda``
``|W_ij| * ||X_j||_2``) gives every target weight an element score; the scores are summed per group
and the groups kept by an allocation (how many parameters each target keeps):
  * ``uniform``: every target keeps ``1 - s`` of its parameters, best groups first;
  * ``global``: one threshold over all groups of all targets, ranked by score per parameter
    normalised by the target's mean element score (so layers with larger weights do not win
    by scale alone);
  * ``owl``: OWL (Yin et al. 2024) layer ratios. Each decoder layer's outlier ratio ``D`` is the
    fraction of its target elements whose score exceeds ``M = 5`` times that target's mean;
    keep ratios are ``D`` scaled to ``[0, 2*lambda]`` (``lambda = 0.08``) and shifted so the
    parameter-weighted mean keep ratio is ``1 - s``; inside a layer, uniform.
N:M patterns keep the ``N`` best-scoring of every ``M`` consecutive inputs of each row.

Groups are ranked by score per parameter so that a smaller ragged edge group competes fairly.
No target is ever emptied: each keeps at least its best group (docs/design.md section 1).
"""
from __future__ import annotations

from typing import Mapping

import torch

from gmc.errors import GmcError
from gmc.graph.targets import layer_index
from gmc.groups import GroupSpec, NMSpec, Pattern

ALLOCATIONS = ("uniform", "global", "owl")
OWL_M = 5.0
OWL_LAMBDA = 0.08


def heuristic_masks(
    scores: Mapping[str, torch.Tensor], pattern: Pattern, sparsity: float, allocation: str
) -> dict[str, torch.Tensor]:
    """Binary selectors (bool, pattern grid) for every target of ``scores`` (``[d_out, d_in]`` fp32 each)."""
    if isinstance(pattern, NMSpec):  # the pattern allocates: n of every m in each row
        return {n: nm_mask(s, pattern) for n, s in scores.items()}
    if allocation == "uniform":
        return {n: _keep_best(pattern, s, 1.0 - sparsity) for n, s in scores.items()}
    if allocation == "global":
        return _global_masks(pattern, scores, sparsity)
    if allocation == "owl":
        ratios = owl_keep_ratios(scores, sparsity)
        return {n: _keep_best(pattern, s, ratios[n]) for n, s in scores.items()}
    raise GmcError(f"unknown allocation {allocation!r}: expected one of {', '.join(ALLOCATIONS)}")


def nm_mask(scores: torch.Tensor, pattern: NMSpec) -> torch.Tensor:
    """Keep the ``n`` largest of every ``m`` consecutive inputs in each row."""
    d_out, d_in = scores.shape
    if d_in % pattern.m:
        raise GmcError(f"{pattern} needs input sizes divisible by {pattern.m}; a target has {d_in}")
    blocks = scores.reshape(d_out, d_in // pattern.m, pattern.m)
    keep = torch.zeros_like(blocks, dtype=torch.bool)
    keep.scatter_(2, blocks.topk(pattern.n, dim=2).indices, True)
    return keep.reshape(d_out, d_in)


def _keep_best(pattern: GroupSpec, scores: torch.Tensor, keep_ratio: float) -> torch.Tensor:
    """Best groups of one target by score per parameter, until ``keep_ratio`` of it is kept."""
    shape = tuple(scores.shape)
    sizes = pattern.group_sizes(shape).reshape(-1)  # [G]
    density = pattern.group_sum(scores).reshape(-1) / sizes  # [G]
    order = density.argsort(descending=True, stable=True)
    count = _closest_prefix(sizes[order], keep_ratio * shape[0] * shape[1])
    keep = torch.zeros(sizes.numel(), dtype=torch.bool)
    keep[order[:count]] = True
    return keep.reshape(pattern.grid(shape))


def _closest_prefix(sorted_sizes: torch.Tensor, budget: float) -> int:
    """Length >= 1 of the prefix whose parameter count is closest to ``budget``."""
    cumulative = sorted_sizes.cumsum(0).double()
    return int((cumulative - budget).abs().argmin()) + 1


def _global_masks(pattern: GroupSpec, scores: Mapping[str, torch.Tensor], sparsity: float) -> dict:
    names = list(scores)
    densities, sizes = [], []
    for index, name in enumerate(names):
        s = scores[name]
        size = pattern.group_sizes(tuple(s.shape)).reshape(-1)
        density = pattern.group_sum(s).reshape(-1) / size / s.mean().clamp_min(1e-30)
        density[density.argmax()] = float("inf")  # each target keeps its best group
        densities.append(density)
        sizes.append(size)
    density, size = torch.cat(densities), torch.cat(sizes)
    order = density.argsort(descending=True, stable=True)
    count = _closest_prefix(size[order], (1.0 - sparsity) * float(size.sum()))
    keep = torch.zeros_like(density, dtype=torch.bool)
    keep[order[:count]] = True
    masks, start = {}, 0
    for index, name in enumerate(names):
        n = sizes[index].numel()
        masks[name] = keep[start:start + n].reshape(pattern.grid(tuple(scores[name].shape)))
        start += n
    return masks


def owl_keep_ratios(scores: Mapping[str, torch.Tensor], sparsity: float) -> dict[str, float]:
    """Per-target keep ratio from its decoder layer's outlier ratio (OWL)."""
    layer_of = {n: _layer_index(n) for n in scores}
    layers = sorted(set(layer_of.values()))
    outliers, params = {}, {}
    for layer in layers:
        members = [n for n in scores if layer_of[n] == layer]
        count = sum(int((scores[n] > OWL_M * scores[n].mean()).sum()) for n in members)
        params[layer] = sum(scores[n].numel() for n in members)
        outliers[layer] = count / params[layer]
    d = torch.tensor([outliers[layer] for layer in layers], dtype=torch.float64)
    p = torch.tensor([params[layer] for layer in layers], dtype=torch.float64)
    spread = (d - d.min()) / (d.max() - d.min()) if d.max() > d.min() else torch.zeros_like(d)
    keep = spread * 2 * OWL_LAMBDA
    keep = keep - (keep * p).sum() / p.sum() + (1.0 - sparsity)  # weighted mean = 1 - s
    keep = keep.clamp(1e-6, 1.0)
    ratio = dict(zip(layers, keep.tolist()))
    return {n: ratio[layer_of[n]] for n in scores}


def _layer_index(name: str) -> int:
    index = layer_index(name)
    if index is None:
        raise GmcError(f"owl allocation needs decoder-layer names (…layers.N…); got {name!r}")
    return index
