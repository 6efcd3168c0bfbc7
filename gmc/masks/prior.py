"""Mask priors: a one-shot method's group scores as the starting logits of a learned mask.

MaskLLM's lesson (Fang et al. 2024): learned masks converge far faster from a one-shot mask than
from "keep everything". gmc turns a heuristic into a prior *logit* per group::

    d_g    = score per parameter of group g (magnitude |W| or Wanda |W| * ||X||, summed per group)
    keep_g = the heuristic's mask at the target sparsity (uniform allocation: every target keeps
             1 - s, best groups first)
    u_g    = (log d_g - log c) / std(log d)      c = the target's cut between kept and dropped
    prior  = PRIOR_SCALE * clip(u, -3, 3), nudged to +/-0.05 where rounding put it on the wrong side

and the mask source starts at ``logits = head(features) + prior`` with the head's last layer
zero at init (free logits: zero + prior). So the step-0 logits *are* the prior: the ranking by
logit is the heuristic's ranking, the export at the target is exactly the heuristic mask, and
groups near the heuristic's cut sit near the decision boundary, where the straight-through
gradient is largest, while clearly good or bad groups start saturated. Why a buffer added to the
output and not an initialisation of the head's weights: a head maps a 128-dim feature to G logits,
and no low-rank or full head initialisation reproduces an arbitrary G-vector cheaply; a buffer is
exact for every mask source and costs one float per group.

``sparsegpt`` runs SparseGPT's mask choice (weights updated on a copy, then discarded) and uses
its mask as the prior, ``+/-PRIOR_SCALE`` (its scores are not a single ranking).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Mapping, Optional

import torch

from gmc.errors import GmcError
from gmc.groups import GroupSpec
from gmc.masks.heuristics import element_scores, heuristic_masks

INITS = ("none", "magnitude", "wanda", "sparsegpt")
PRIOR_SCALE = 1.0  # logits per standard deviation of log group density
_CLIP = 3.0
_MARGIN = 0.05


@dataclass
class MaskPrior:
    """Prior logits and the one-shot masks they encode, ``{name: [G_out, G_in]}`` each."""
    logits: dict
    masks: dict
    init: str

    def kept_params(self, pattern, shapes: Mapping[str, tuple[int, int]]) -> float:
        return float(sum((pattern.group_sizes(shapes[n]) * m.double()).sum() for n, m in self.masks.items()))


def prior_from_scores(weights: Mapping[str, torch.Tensor], pattern: GroupSpec, sparsity: float, method: str,
                      act_norms: Optional[Mapping[str, torch.Tensor]] = None) -> tuple[dict, dict]:
    """Prior logits and the heuristic masks they encode, both ``{name: [G_out, G_in]}``."""
    masks = heuristic_masks(weights, pattern, sparsity, method, "uniform", act_norms)
    priors = {}
    for name, weight in weights.items():
        scores = element_scores(weight, method, (act_norms or {}).get(name))
        density = pattern.group_sum(scores) / pattern.group_sizes(tuple(weight.shape))  # [G_out, G_in]
        log_d = density.double().clamp_min(1e-30).log()
        keep = masks[name]
        kept, dropped = log_d[keep], log_d[~keep]
        if dropped.numel() and kept.numel():
            cut = (kept.min() + dropped.max()) / 2
        else:
            cut = log_d.min() - 1.0 if kept.numel() else log_d.max() + 1.0
        spread = log_d.std().clamp_min(1e-6) if log_d.numel() > 1 else torch.tensor(1.0, dtype=torch.float64)
        u = ((log_d - cut) / spread).clamp(-_CLIP, _CLIP)
        u = torch.where(keep, u.clamp_min(_MARGIN), u.clamp_max(-_MARGIN))
        priors[name] = (PRIOR_SCALE * u).float()
    return priors, masks


def prior_from_masks(masks: Mapping[str, torch.Tensor]) -> dict:
    """Prior logits that encode a mask only: ``+PRIOR_SCALE`` kept, ``-PRIOR_SCALE`` dropped."""
    return {n: torch.where(m.bool(), PRIOR_SCALE, -PRIOR_SCALE).float() for n, m in masks.items()}


def sparsegpt_prior(loaded, pattern: GroupSpec, sparsity: float, blocks: torch.Tensor, chosen) -> tuple[dict, dict]:
    """SparseGPT's masks (chosen with weight updates on a copy of the model) as a prior."""
    from gmc.masks.sparsegpt import sparsegpt_prune

    clone = copy.copy(loaded)
    clone.model = copy.deepcopy(loaded.model)
    try:
        masks, _ = sparsegpt_prune(clone, pattern, sparsity, blocks, chosen)
    finally:
        del clone
    return prior_from_masks(masks), masks


def check_init(init: str) -> None:
    if init not in INITS:
        raise GmcError(f"bad --init {init!r}: expected one of {', '.join(INITS)}")
