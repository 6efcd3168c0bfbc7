"""``groupmask`` and ``direct``: masks learned by self-distillation under the sparsity budget
(``gmc.masks.training``). ``groupmask`` computes the group logits with a hypernetwork; ``direct`` trains
free per-group logits (the ablation), so the hypernetwork's options (``head``, ``rank``) do not apply to
it. Both start from a one-shot source's prior with ``--init`` (``config.init_source``: this module
reaches the other rows of the table through the config) and run data parallel under torchrun
(``gmc.masks.prune_distributed``)."""
from __future__ import annotations

from gmc.masks.budget import LEARNED_ALLOCATIONS
from gmc.masks.prior import mask_prior
from gmc.masks.sources.base import ChosenMasks, MaskSource
from gmc.masks.training import MaskTask, learn_masks


def choose(config, loaded, gm, targets, selectors, blocks, fingerprint) -> ChosenMasks:
    prior = mask_prior(config, loaded, gm, targets, selectors, blocks)
    result = learn_masks(gm, targets, selectors, blocks, mask_task(config, fingerprint), config.learn, prior=prior,
                         recover_steps=config.recover_steps)
    return ChosenMasks(result.masks, result.weights, files=list(result.files), manifest=dict(result.manifest),
                       checkpoints=[result.checkpoint_dir], graph=result.graph)


def mask_task(config, fingerprint: str) -> MaskTask:
    """The learned run of ``config`` (a ``PruneConfig``) on the model of ``fingerprint``."""
    return MaskTask(config.method, config.pattern, config.sparsity, config.allocation, config.seed, fingerprint,
                    config.checkpoint)


GROUPMASK = MaskSource("groupmask", "learned by self-distillation, group logits from a hypernetwork",
                       LEARNED_ALLOCATIONS, needs_blocks=True, learns=True, choose=choose)
DIRECT = MaskSource("direct", "learned, free per-group logits (the hypernetwork's ablation)",
                    LEARNED_ALLOCATIONS, needs_blocks=True, learns=True, choose=choose, ignores=("head", "rank"))
