"""How learned selectors meet the sparsity budget: a schedule, a scheduled top-k, or the paper's penalty.

``schedule`` (gmc's default; docs/learning.md, "A budget that always lands"): the paper's
selectors and penalty, ``keep iff logit + offset > 0`` and ``lambda * |log(r / r_t(k))|``, but
against a target ``r_t(k)`` that ramps (below) instead of the full target from step 1, so groups
leave gradually, in the order the distillation gradient pushes them; the last ``LANDING``
fraction of the steps then runs ``topk`` at the full target, so the run ends exactly on budget and
its export is its last training mask. Adam's first steps move every logit by about the learning
rate whatever its gradient's size, so a ranking that is read from the logits from step 1 on
(``topk`` from a cold start) is close to arbitrary until it has accumulated; the threshold of the
penalty only drops groups whose gradient has pushed them consistently (docs/quality.md).

``topk``:
    kept(k)  = 1 - s * ramp(k)                       ramp(k) = 1 - (1 - min(1, k / (f * steps)))^3
    tau      = logit of the last group kept when groups are taken in descending logit order
               until ``kept(k)`` of the parameters (one ranking over all targets for ``adaptive``,
               one per target for ``uniform``)
    hard     = 1[logit ranks above tau]              exactly the budget, every step
    soft     = sigmoid((logit - tau) / T)            the straight-through gradient path
The hard forward always holds the scheduled budget, so the training masks land on the target at
step ``f * steps`` whatever ``--steps`` is, and the export (the same ranking at the full target)
is the final training mask: no threshold is ever moved. The cubic ramp (Zhu & Gupta 2017) prunes
fast while the mask is mostly dense and slowly near the target, where each group costs more.
The allocation is still learned: one ranking over all targets lets layers trade groups.

``penalty`` (the paper, ``--recipe paper``): keep iff ``logit + offset > 0`` and add
``lambda * |log(r / r_t)|`` to the loss; the export moves a threshold if training missed.
"""
from __future__ import annotations

from typing import Optional

import torch

from gmc.masks.hypernet import never_empty

BUDGETS = ("schedule", "topk", "penalty")
LEARNED_ALLOCATIONS = ("adaptive", "uniform")  # one ranking over all targets | one per target
LANDING = 0.1  # --budget schedule: the last tenth of the steps holds the exact top-k budget


def last_ramp_step(steps: int) -> int:
    """``--budget schedule``: the last step before the landing (steps past it hold the exact top-k budget)."""
    return int((1.0 - LANDING) * steps)


def scheduled_sparsity(step: int, steps: int, sparsity: float, ramp: float) -> float:
    """Sparsity the hard selectors hold at ``step`` (1-based) of ``steps``: cubic ramp to
    ``sparsity`` over the first ``ramp`` fraction of the run, then flat."""
    if ramp <= 0.0:
        return sparsity
    progress = min(1.0, step / max(1.0, ramp * steps))
    return sparsity * (1.0 - (1.0 - progress) ** 3)


def topk_keep(logits: list[torch.Tensor], sizes: list[torch.Tensor], keep_params: list[float] | float,
              per_target: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Boolean keep masks and the (detached) logit thresholds of a ranking by logit.

    ``keep_params``: parameters to keep, one number (one ranking over all targets) or one per
    target (``per_target``). Among equal logits the earlier group wins (stable order), and every
    target keeps at least its best group.
    """
    if per_target:
        budgets = keep_params if isinstance(keep_params, list) else [keep_params] * len(logits)
        pairs = [_rank_keep([logit], [s], b) for logit, s, b in zip(logits, sizes, budgets)]
        return [p[0][0] for p in pairs], [p[1] for p in pairs]
    keeps, tau = _rank_keep(logits, sizes, float(keep_params))
    return keeps, [tau] * len(logits)


def _rank_keep(logits, sizes, budget: float):
    flat = torch.cat([logit.detach().reshape(-1).float() for logit in logits])
    size = torch.cat([s.reshape(-1).double() for s in sizes]).to(flat.device)
    order = flat.argsort(descending=True, stable=True)
    cumulative = size[order].cumsum(0)
    count = int((cumulative - budget).abs().argmin()) + 1
    keep = torch.zeros_like(flat, dtype=torch.bool)
    keep[order[:count]] = True
    last = flat[order[count - 1]]
    following = flat[order[count]] if count < flat.numel() else last - 1.0
    tau = (last + following) / 2  # the decision boundary between the last kept and first dropped
    keeps, start = [], 0
    for logit in logits:
        part = keep[start:start + logit.numel()].view(logit.shape)
        if not bool(part.any()):
            part = part.clone()
            part.view(-1)[logit.detach().argmax()] = True
        keeps.append(part)
        start += logit.numel()
    return keeps, tau


def topk_selectors(logits: list[torch.Tensor], sizes: list[torch.Tensor], keep_params, per_target: bool,
                   temperature: float) -> list[torch.Tensor]:
    """Hard 0/1 selectors at exactly ``keep_params`` in the forward; ``sigmoid((l - tau) / T)`` in
    the backward (straight-through)."""
    keeps, taus = topk_keep(logits, sizes, keep_params, per_target)
    out = []
    for logit, keep, tau in zip(logits, keeps, taus):
        soft = torch.sigmoid((logit - tau.to(logit.dtype)) / temperature)
        out.append(keep.to(soft.dtype) + (soft - soft.detach()))
    return out


class Budget:
    """The parameters each step's selectors keep, from the scheduled sparsity: one number over all targets
    (``adaptive``) or one per target (``uniform``)."""

    def __init__(self, names, sizes, sparsity, allocation, final_keep: Optional[float]):
        self.names, self.sizes, self.sparsity = names, sizes, sparsity
        self.total = float(sum(s.double().sum() for s in sizes))
        self.per_target = allocation == "uniform"
        # with a prior, its mask's own count (within a group per target of the target)
        self.final_keep = final_keep if final_keep is not None else (1.0 - sparsity) * self.total

    def keep_params(self, sparsity: float):
        """Parameters to keep at a scheduled ``sparsity``: one number, or one per target (uniform)."""
        fraction = (1.0 - sparsity) / (1.0 - self.sparsity) * self.final_keep / self.total
        if self.per_target:
            return [fraction * float(s.sum()) for s in self.sizes]
        return fraction * self.total

    def kept(self, selectors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The parameters each target's selectors keep (soft or hard; one per target, ``names`` order)."""
        return [(h * s).sum() for h, s in zip(selectors, self.sizes)]

    def sparsity_of(self, masks: list[torch.Tensor]) -> float:
        """``1 - kept / total`` of bool ``masks`` (paper Eq. 2), counted in float64: exact."""
        kept = self.kept([m.to(s.device, torch.float64) for m, s in zip(masks, self.sizes)])
        return 1.0 - float(sum(kept)) / self.total

    def target_sparsity(self, index: int, mask: torch.Tensor) -> float:
        """``1 - kept / params`` of target ``index``'s bool ``mask``."""
        size = self.sizes[index].to(mask.device, torch.float64)
        return 1.0 - float((mask.double() * size).sum()) / float(size.sum())


def budget_threshold(logits: dict, sizes: list[torch.Tensor], sparsity: float, offset: float):
    """Keep the highest-logit groups of ``logits`` (``sizes``: their groups' parameters) until
    ``1 - sparsity`` of their parameters."""
    flat = torch.cat([logit.reshape(-1) + offset for logit in logits.values()])
    size = torch.cat([s.reshape(-1).double() for s in sizes])
    order = flat.argsort(descending=True, stable=True)
    budget = (1.0 - sparsity) * float(size.sum())
    count = int((size[order].cumsum(0) - budget).abs().argmin()) + 1
    threshold = float(flat[order[count - 1]])
    return {n: never_empty(logit + offset >= threshold, logit) for n, logit in logits.items()}, threshold
