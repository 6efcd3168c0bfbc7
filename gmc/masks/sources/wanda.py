"""``wanda`` (Sun et al. 2024): keep the groups of largest ``|W_ij| * ||X_j||_2``, ``X_j`` the j-th input
feature over the calibration tokens. One forward pass over the blocks measures the norms (an observer on
every target's GroupSelector); the weights are not updated."""
from __future__ import annotations

from typing import Mapping

import torch
from tqdm.auto import tqdm

from gmc.graph.selector import GroupSelector
from gmc.masks.heuristics import ALLOCATIONS, heuristic_masks
from gmc.masks.sources.base import ChosenMasks, MaskSource, target_weights


class ActivationNorms:
    """Observer for ``GroupSelector.observer``: accumulates ``sum_t x_tj^2`` per input feature."""

    def __init__(self, d_in: int):
        self.sum_sq = torch.zeros(d_in, dtype=torch.float64)
        self.tokens = 0

    def __call__(self, x: torch.Tensor) -> None:
        flat = x.detach().reshape(-1, x.shape[-1]).double()  # [tokens, d_in]
        self.sum_sq += flat.pow(2).sum(0).cpu()
        self.tokens += flat.shape[0]

    def norm(self) -> torch.Tensor:
        """``||X_j||_2`` over all observed tokens, ``[d_in]`` fp32."""
        return self.sum_sq.sqrt().float()


@torch.no_grad()
def activation_norms(gm: torch.fx.GraphModule, selectors: dict[str, GroupSelector], blocks: torch.Tensor,
                     progress: bool = True) -> dict:
    """``||X_j||_2`` of the input of every target of ``selectors`` (``gm``'s) over the calibration blocks."""
    observers = {name: ActivationNorms(selector.shape[1]) for name, selector in selectors.items()}
    for name, observer in observers.items():
        selectors[name].observer = observer
    device = next(iter(gm.parameters())).device
    try:
        for block in tqdm(blocks, desc="calibration", unit="seq", leave=False, disable=not progress):
            gm(block[None].to(device))
    finally:
        for selector in selectors.values():
            selector.observer = None
    return {name: observer.norm() for name, observer in observers.items()}


def wanda_scores(weights: Mapping[str, torch.Tensor], norms: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``|W_ij| * ||X_j||_2`` of every target, ``[d_out, d_in]`` fp32."""
    return {name: weight.detach().abs().float() * norms[name].float()[None, :]  # [d_out, d_in] * [1, d_in]
            for name, weight in weights.items()}


def choose(config, loaded, gm, targets, selectors, blocks, fingerprint) -> ChosenMasks:
    norms = activation_norms(gm, selectors, blocks, config.learn.progress)
    scores = wanda_scores(target_weights(gm, targets), norms)
    return ChosenMasks(heuristic_masks(scores, config.pattern, config.sparsity, config.allocation))


def prior(config, loaded, gm, targets, selectors, blocks):
    norms = activation_norms(gm, selectors, blocks, config.learn.progress)
    scores = wanda_scores(target_weights(gm, targets), norms)
    return heuristic_masks(scores, config.pattern, config.sparsity, "uniform"), scores


SOURCE = MaskSource("wanda", "one-shot, the groups of largest |W| * ||X|| (activation norms on calibration data)",
                    ALLOCATIONS, needs_blocks=True, learns=False, choose=choose, prior=prior)
