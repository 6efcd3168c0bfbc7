"""What a mask source is: the row of the table ``gmc.masks.sources.SOURCES`` that ``--method NAME`` picks,
and what its ``choose`` returns (``ChosenMasks``, which ``gmc.masks.prune`` turns into an artifact)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

if TYPE_CHECKING:
    from gmc.graph.selector import GroupSelector
    from gmc.graph.targets import Target
    from gmc.inputs.model import LoadedModel
    from gmc.masks.recover import LearnedGraph


@dataclass
class ChosenMasks:
    """What a mask source (and recovery) produced, before it becomes an artifact."""

    masks: dict[str, torch.Tensor]
    weights: dict[str, torch.Tensor] = field(default_factory=dict)  # updated target weights, if any
    files: list = field(default_factory=list)  # (name, bytes) written into the artifact
    manifest: dict = field(default_factory=dict)  # extra manifest entries
    checkpoints: list[Path] = field(default_factory=list)  # removed once the artifact is written
    teacher: Optional[torch.nn.Module] = None  # the dense model, when the source changed the weights
    graph: Optional["LearnedGraph"] = None  # a learned run's graph, student and teacher: what recovery continues on


# choose(config, loaded, gm, targets, selectors, blocks, fingerprint) -> ChosenMasks: ``config`` is the
# run's gmc.masks.prune.PruneConfig (not imported: prune reads this table), ``gm`` the traced model with a
# GroupSelector per target (``selectors``, by target name), ``blocks`` the calibration token blocks
# [n, seq_len] (None when the source needs none), ``fingerprint`` the weights' hash
Choose = Callable[[Any, "LoadedModel", torch.fx.GraphModule, list["Target"], dict[str, "GroupSelector"],
                   Optional[torch.Tensor], str], ChosenMasks]
# prior(config, loaded, gm, targets, selectors, blocks) -> (masks, element scores or None): the one-shot
# masks at config.sparsity with every target keeping the same share (the prior's allocation), and the
# per-weight scores they rank by, if any (gmc.masks.prior turns them into a learned run's start)
Prior = Callable[[Any, "LoadedModel", torch.fx.GraphModule, list["Target"], dict[str, "GroupSelector"],
                  torch.Tensor], tuple[dict[str, torch.Tensor], Optional[dict[str, torch.Tensor]]]]


@dataclass(frozen=True)
class MaskSource:
    """One ``--method``: what it needs and accepts, and how it chooses masks."""

    name: str  # --method NAME
    help: str  # its part of --method's help
    allocations: tuple[str, ...]  # the --allocation values it takes, its default first
    needs_blocks: bool  # it reads calibration blocks
    learns: bool  # it trains selectors by LearnConfig (and so runs under torchrun, data parallel)
    choose: Choose
    prior: Optional[Prior] = None  # the start it gives a learned run as --init NAME
    ignores: tuple[str, ...] = ()  # LearnConfig fields a learning source does not read (refused when passed)


def target_weights(gm: torch.fx.GraphModule, targets: list["Target"]) -> dict[str, torch.Tensor]:
    """Each target's weight ``[d_out, d_in]`` by target name (the graph's own parameter)."""
    return {t.name: gm.get_parameter(t.node.args[1].target) for t in targets}
