"""``magnitude``: keep the groups of largest ``|W|`` per parameter. It reads the weights alone, no
calibration data: the floor that every method which looks at data has to beat."""
from __future__ import annotations

from typing import Mapping

import torch

from gmc.masks.heuristics import ALLOCATIONS, heuristic_masks
from gmc.masks.sources.base import ChosenMasks, MaskSource, target_weights


def magnitude_scores(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``|W_ij|`` of every target, ``[d_out, d_in]`` fp32."""
    return {name: weight.detach().abs().float() for name, weight in weights.items()}


def choose(config, loaded, gm, targets, selectors, blocks, fingerprint) -> ChosenMasks:
    scores = magnitude_scores(target_weights(gm, targets))
    return ChosenMasks(heuristic_masks(scores, config.pattern, config.sparsity, config.allocation))


def prior(config, loaded, gm, targets, selectors, blocks):
    scores = magnitude_scores(target_weights(gm, targets))
    return heuristic_masks(scores, config.pattern, config.sparsity, "uniform"), scores


SOURCE = MaskSource("magnitude", "one-shot, the groups of largest |W| (no calibration data)", ALLOCATIONS,
                    needs_blocks=False, learns=False, choose=choose, prior=prior)
