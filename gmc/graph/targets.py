"""The target set: which linears of a causal LM gmc prunes, decided in one place.

A target is a linear with a 2-D weight whose HF module name (``model.layers.3.self_attn.q_proj``,
the key masks are stored under) passes a ``TargetFilter``: it matches ``include`` (default: the
q, k, v, o, gate, up and down projections of every decoder layer), does not match ``ignore``, and
is never ``lm_head`` or an embedding. The same filter answers on a graph node (the pass
``gmc.graph.passes.find_targets``) and on an eager module (``eager_targets``: FSDP2 and SparseGPT's
block-by-block solve run the eager model), so the two forms agree by construction.

Helpers that read a target's name (``layer_index``, ``projection``) live here too.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from gmc.errors import GmcError

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # table order
DEFAULT_TARGETS = r"\.(" + "|".join(PROJECTIONS) + r")$"
_NEVER = re.compile(r"(^|\.)(lm_head|embed_tokens|wte|wpe)$")
_LAYER = re.compile(r"\.layers\.(\d+)\.")


def _compile(pattern: str, option: str) -> re.Pattern:
    try:
        return re.compile(pattern)
    except re.error as error:
        raise GmcError(f"bad {option} regex {pattern!r}: {error}") from error


@dataclass
class Target:
    name: str  # HF module name, e.g. model.layers.3.self_attn.q_proj
    shape: tuple[int, int]  # (d_out, d_in) of the weight
    node: Optional[torch.fx.Node] = None  # the graph node that runs it (None for the eager form)


@dataclass(frozen=True)
class TargetFilter:
    """``include``/``ignore`` are regexes searched in the module name (``--include``/``--ignore``)."""

    include: Optional[str] = None
    ignore: Optional[str] = None
    _include: re.Pattern = field(init=False, repr=False, compare=False)
    _ignore: Optional[re.Pattern] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "_include", _compile(self.include or DEFAULT_TARGETS, "--include"))
        object.__setattr__(self, "_ignore", _compile(self.ignore, "--ignore") if self.ignore else None)

    def __call__(self, name: str) -> bool:
        if _NEVER.search(name) or not self._include.search(name):
            return False
        return self._ignore is None or not self._ignore.search(name)

    def none_found(self, where: str) -> GmcError:
        return GmcError(f"no target linears found in {where} "
                        f"(include={self.include or DEFAULT_TARGETS!r}, ignore={self.ignore!r})")


def eager_targets(model: nn.Module, chosen: TargetFilter = TargetFilter()) -> list[Target]:
    """The targets of an eager model, in module order (the graph pass gives execution order)."""
    targets = [Target(name, tuple(module.weight.shape)) for name, module in model.named_modules()
               if isinstance(module, nn.Linear) and chosen(name)]
    if not targets:
        raise chosen.none_found(type(model).__name__)
    return targets


def decoder_layers(model: nn.Module, chosen: TargetFilter = TargetFilter()) -> tuple[nn.ModuleList, str]:
    """The decoder blocks, the ``ModuleList`` whose children hold the targets, and its module-name
    prefix (``model.layers``): the units SparseGPT solves and FSDP2 shards one by one."""
    for prefix, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) and any(
                isinstance(leaf, nn.Linear) and chosen(f"{prefix}.{name}") for name, leaf in module.named_modules()):
            return module, prefix
    raise GmcError(f"no decoder layers (a ModuleList of blocks) hold the target linears of {type(model).__name__}")


def target_layers(model: nn.Module, targets: list[Target]) -> list[nn.Module]:
    """The decoder blocks that hold ``targets`` (of ``decoder_layers``): the units FSDP2 shards."""
    names = {t.name for t in targets}
    blocks, prefix = decoder_layers(model, names.__contains__)
    return [block for index, block in enumerate(blocks) if any(n.startswith(f"{prefix}.{index}.") for n in names)]


def layer_index(name: str) -> Optional[int]:
    """``model.layers.12.mlp.up_proj`` -> 12; None for a name outside the decoder layers."""
    match = _LAYER.search(f".{name}.")
    return None if match is None else int(match[1])


def projection(name: str) -> str:
    """``model.layers.12.self_attn.q_proj`` -> ``q``; other leaves are returned whole."""
    return name.rsplit(".", 1)[-1].removesuffix("_proj")


def projection_rank(name: str) -> int:
    """Position of a target's projection in ``PROJECTIONS`` (unknown leaves last): table order."""
    leaf = name.rsplit(".", 1)[-1]
    return PROJECTIONS.index(leaf) if leaf in PROJECTIONS else len(PROJECTIONS)

