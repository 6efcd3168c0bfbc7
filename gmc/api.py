"""The in-memory API: prune and lower a model object, in the style of torchao's ``quantize_``.

    calib = calibration_blocks(tokenizer, "wikitext2", nsamples=128, seq_len=512)  # [128, 512] ids
    masks = prune_(model, PruneConfig(method="groupmask", sparsity=0.5, group="1x256"), calib)
    lower_(model, masks)        # target linears -> GroupSparseLinear modules on their kept groups
    model.save_pretrained(out)  # a packed checkpoint: from_pretrained(out) after `import gmc`

The CLI commands are files in, files out around the same functions: ``gmc prune`` runs
``gmc.masks.prune.prune`` (which shares ``choose_artifact`` with ``prune_``) and ``gmc lower`` runs
``gmc.lower.stage.lower_artifact`` (the same ``pack_targets`` and pass lists as ``lower_``).
"""
from __future__ import annotations

import dataclasses
import tempfile
from typing import Optional

import torch

from gmc.errors import GmcError
from gmc.formats.artifact import MaskArtifact, model_fingerprint
from gmc.formats.hf_checkpoint import attach_packed_config
from gmc.graph.pipeline import LowerOptions, pack_targets, prepare
from gmc.inputs.calib import calibration_blocks
from gmc.inputs.model import LoadedModel
from gmc.kernels.linear import swap_group_sparse_linears
from gmc.masks.prune import PruneConfig, choose_artifact, remove_checkpoint

__all__ = ["PruneConfig", "LowerOptions", "calibration_blocks", "prune_", "lower_"]


def prune_(model: torch.nn.Module, config: PruneConfig, calib: Optional[torch.Tensor] = None,
           tokenizer=None) -> MaskArtifact:
    """Choose masks for ``model`` (a transformers causal LM) by ``config``'s method and fold them
    into it in place (pruned groups zero; SparseGPT's or recovery's updated weights written).
    ``calib``: ``[n, seq_len]`` token ids (``calibration_blocks``); magnitude needs none. Returns
    the masks artifact (``save_artifact`` writes it; ``lower_`` packs the model by it)."""
    if calib is None and config.needs_blocks:
        raise GmcError(f"--method {config.method} needs calibration blocks: pass calib=calibration_blocks(...)")
    if calib is not None and (calib.dim() != 2 or calib.dtype not in (torch.int32, torch.int64)):
        raise GmcError(f"bad calib: expected [n, seq_len] integer token ids, got {tuple(calib.shape)} {calib.dtype}")
    ref = getattr(model.config, "_name_or_path", "") or type(model).__name__
    loaded = LoadedModel(model, tokenizer, ref)
    with tempfile.TemporaryDirectory(prefix="gmc-prune-") as scratch:  # a learned run's checkpoints
        run = config if config.output else dataclasses.replace(config, output=f"{scratch}/masks")
        prepared = prepare(model, run.pattern, run.targets)
        artifact, chosen = choose_artifact(run, loaded, prepared, model_fingerprint(model), calib, "in-memory blocks")
        for checkpoint in chosen.checkpoints:
            remove_checkpoint(checkpoint)
    artifact.apply_to(model, check_fingerprint=False)
    return artifact


def lower_(model: torch.nn.Module, masks: MaskArtifact, options: LowerOptions = LowerOptions()) -> torch.nn.Module:
    """Swap ``model``'s masked target linears for ``GroupSparseLinear`` modules on their packed kept
    groups, in place, and mark its config so ``model.save_pretrained`` writes a packed checkpoint."""
    if not masks.pattern.packable:
        raise GmcError(f"lower_ packs group patterns (1x256, 32x32, ...), not the N:M pattern {masks.pattern}")
    packed = pack_targets(model, masks.masks, masks.pattern, masks.weights or None, options.quantize)
    swap_group_sparse_linears(model, packed)
    attach_packed_config(model, {key: masks.manifest[key] for key in ("method", "global_sparsity")
                                 if key in masks.manifest})
    return model
