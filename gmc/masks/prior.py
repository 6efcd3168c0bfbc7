"""Mask priors (``--init``): a one-shot method's group scores as the starting logits of a learned mask.

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

``--init NAME`` offers every mask source of ``gmc.masks.sources`` that gives a prior (``INITS``
there): its masks at the target (uniform allocation) and the element scores they rank by (magnitude,
wanda). ``sparsegpt`` runs SparseGPT's mask choice (weights updated on a copy, then discarded) and gives
no scores (they are not a single ranking): its mask alone is the prior, ``+/-PRIOR_SCALE``. The source
is the run's ``PruneConfig.init_source``, resolved from the table when the config is validated.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

import torch

from gmc.groups import GroupSpec

PRIOR_NSAMPLES = 64  # calibration blocks of a learned run's one-shot prior: the first of its own
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


def mask_prior(config, loaded, gm, targets, selectors, blocks: torch.Tensor) -> Optional[MaskPrior]:
    """The start of the learned run of ``config`` (a ``PruneConfig``) by ``--init``, or None (``none``);
    the one-shot source sees the first ``PRIOR_NSAMPLES`` of the run's calibration blocks."""
    source = config.init_source
    if source is None:
        return None
    masks, scores = source.prior(config, loaded, gm, targets, selectors, blocks[:PRIOR_NSAMPLES])
    logits = prior_from_masks(masks) if scores is None else prior_from_scores(scores, masks, config.pattern)
    return MaskPrior(logits, masks, source.name)


def prior_from_scores(scores: Mapping[str, torch.Tensor], masks: Mapping[str, torch.Tensor],
                      pattern: GroupSpec) -> dict:
    """Prior logits ``{name: [G_out, G_in]}`` of one-shot ``masks`` from the element ``scores``
    (``[d_out, d_in]`` each) they rank by."""
    priors = {}
    for name, element in scores.items():
        density = pattern.group_sum(element) / pattern.group_sizes(tuple(element.shape))  # [G_out, G_in]
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
    return priors


def prior_from_masks(masks: Mapping[str, torch.Tensor]) -> dict:
    """Prior logits that encode a mask only: ``+PRIOR_SCALE`` kept, ``-PRIOR_SCALE`` dropped."""
    return {n: torch.where(m.bool(), PRIOR_SCALE, -PRIOR_SCALE).float() for n, m in masks.items()}
