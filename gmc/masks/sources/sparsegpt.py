"""``sparsegpt``: SparseGPT's one-shot masks, chosen while the kept weights are updated to make up for the
pruned ones (``gmc.masks.sparsegpt``), decoder block by decoder block; every target keeps the same share."""
from __future__ import annotations

import copy

from gmc.masks.sources.base import ChosenMasks, MaskSource
from gmc.masks.sparsegpt import sparsegpt_prune


def choose(config, loaded, gm, targets, selectors, blocks, fingerprint) -> ChosenMasks:
    # SparseGPT updates the model in place: recovery needs the dense teacher
    teacher = copy.deepcopy(loaded.model) if config.recover_steps else None
    masks, weights = sparsegpt_prune(loaded, config.pattern, config.sparsity, blocks,
                                     {t.name for t in targets}.__contains__)
    return ChosenMasks(masks, weights, teacher=teacher)


def prior(config, loaded, gm, targets, selectors, blocks):
    """SparseGPT's masks, chosen with weight updates on a copy of the model (the copy is then dropped).
    Its choices are not one ranking, so it gives no scores: the prior encodes the masks alone."""
    clone = copy.copy(loaded)
    clone.model = copy.deepcopy(loaded.model)
    chosen = {t.name for t in targets}.__contains__
    try:
        masks, _ = sparsegpt_prune(clone, config.pattern, config.sparsity, blocks, chosen)
    finally:
        del clone
    return masks, None


SOURCE = MaskSource("sparsegpt", "one-shot OBS, masks chosen while the kept weights are updated (SparseGPT)",
                    ("uniform",), needs_blocks=True, learns=False, choose=choose, prior=prior)
