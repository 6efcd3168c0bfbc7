"""``--backend dense``: the masks (and any learned weights) folded into a plain HF checkpoint.

Pruned groups are zeros; any tool that reads HF checkpoints runs it, at dense speed. The only
backend that takes N:M masks.
"""
from __future__ import annotations

from pathlib import Path

from gmc.formats.hf_checkpoint import save_dense
from gmc.graph.pipeline import fold
from gmc.lower.backend import Backend, LowerResult, target_bytes


class DenseBackend(Backend):
    name = "dense"
    help = "the masks folded into a plain HF checkpoint (zeros)"
    kind = "dense"
    devices = ("cpu", "cuda", "mps")
    group_patterns_only = False

    def steps(self, config) -> int:
        return 2

    def write(self, config, artifact, loaded, steps) -> LowerResult:
        steps("folding the masks")
        fold(loaded.model, artifact.masks, artifact.pattern, artifact.weights, in_place=True)
        dense = target_bytes(loaded.model, artifact.masks)
        steps("saving")
        save_dense(loaded.model, loaded.tokenizer, config.output, overwrite=config.overwrite)
        return LowerResult(Path(config.output), dense, dense)
