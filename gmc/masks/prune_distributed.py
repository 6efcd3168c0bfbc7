"""``prune_distributed``: ``prune`` for a torchrun worker -- the learned methods on the sharded eager model.

    check -> process group -> calibration text, model (every rank) -> blocks -> fingerprint
          -> targets, selectors attached to the eager model, FSDP2 per decoder layer
          -> learn_masks (data parallel) -> rank 0 writes the artifact

``gmc prune`` runs this when ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` are set; ``gmc.masks.distributed``
holds the mechanics (process group, collectives, sharding), ``gmc.masks.prune`` the single-process route.
"""
from __future__ import annotations

import os
from typing import Optional

from gmc.errors import GmcError
from gmc.formats.artifact import MaskArtifact, build_manifest, model_fingerprint, save_artifact
from gmc.formats.outputs import check_outputs
from gmc.graph.selector import attach_selectors
from gmc.graph.targets import eager_targets, target_layers
from gmc.graph.trace import LogitsOnly
from gmc.inputs.calib import described_blocks, load_texts
from gmc.inputs.model import load_model
from gmc.masks.checkpoint import remove_checkpoint
from gmc.masks.distributed import execution_order, process_group, shard_model
from gmc.masks.prune import PruneConfig
from gmc.masks.sources import LEARNED_METHODS, SOURCES
from gmc.masks.sources.learned import mask_task
from gmc.masks.training import check_world_size, learn_masks


def prune_distributed(config: PruneConfig) -> Optional[MaskArtifact]:
    """Run the learned method of ``config`` on this torchrun worker's share; rank 0 writes and
    returns the artifact, the other ranks return None."""
    check_distributed(config, int(os.environ["WORLD_SIZE"]))
    check_outputs(config.output, "masks", inputs=[config.model, config.calib], overwrite=config.overwrite,
                  checkpoint=config.checkpoint)
    with process_group(config.device) as dist:
        lines = dist.on_all(lambda: load_texts(config.calib, split="train") if config.reads_text else None,
                            "reading the calibration text")
        # every rank loads the full model on the host; fully_shard then keeps 1/W of it
        loaded = dist.on_all(lambda: load_model(config.model, config.dtype, "cpu", config.trust_remote_code),
                             f"loading {config.model}")
        blocks, described = described_blocks(loaded, lines, config.seq_len, config.nsamples, config.seed)
        fingerprint = model_fingerprint(loaded.model)
        model = loaded.model
        targets = eager_targets(model, config.targets)
        selectors = attach_selectors(model, targets, config.pattern)
        layers = target_layers(model, targets)
        shard_model(model, layers, dist, config.learn.grad_checkpointing, config.learn.fsdp_offload)
        by_name = {t.name: t for t in targets}
        targets = [by_name[name] for name in execution_order(model, selectors, dist.device)]
        selectors = {t.name: selectors[t.name] for t in targets}
        shapes = {t.name: t.shape for t in targets}
        result = learn_masks(LogitsOnly(model), targets, selectors, blocks, mask_task(config, fingerprint),
                             config.learn, dist=dist)
        artifact = None
        if dist.main:
            manifest = build_manifest(
                model_ref=loaded.ref, fingerprint=fingerprint, pattern=config.pattern, masks=result.masks,
                shapes=shapes, method=config.method, allocation=config.allocation,
                target_sparsity=config.sparsity, calibration=described, seed=config.seed,
                nsamples=int(blocks.shape[0]), seq_len=int(blocks.shape[1]), **result.manifest,
            )
            artifact = MaskArtifact(result.masks, manifest, {})
            save_artifact(config.output, artifact, result.files, overwrite=config.overwrite)
            remove_checkpoint(result.checkpoint_dir)  # only once the artifact is in place
        dist.barrier()  # no rank leaves (and tears the group down) before the artifact exists
    return artifact


def check_distributed(config: PruneConfig, world_size: int) -> None:
    """What a distributed run refuses, checked before any collective or model load."""
    if not SOURCES[config.method].learns:
        raise GmcError(f"--method {config.method} does not run under torchrun: only the learned methods "
                       f"({', '.join(LEARNED_METHODS)}) are distributed; run it as a single process")
    if config.learn.init != "none":  # a prior's one-shot source runs on the whole, unsharded model
        raise GmcError(f"--init {config.learn.init} is not available under torchrun: start from no prior "
                       f"(--init none) or prune in one process")
    if config.recover_steps:
        raise GmcError("--recover-steps is not available under torchrun: write the artifact, then run "
                       "gmc recover on it in a single process")
    check_world_size(config.learn.batch_size, world_size)
    if config.save_dense:
        raise GmcError("--save-dense is not available under torchrun (the model is sharded): write the "
                       "artifact, then fold it in a single process")
