"""Fold binary selectors into the weights and remove the selector nodes.

Why: after masks are chosen, the graph should be a plain dense graph again whose target weights
hold zeros in pruned groups, ready to save as an HF checkpoint or to lower. Folding replaces each
target's weight attribute by a new tensor ``W * expand(B)``; the original (shared with the eager
model) is left untouched. Each ``GroupSelector`` call becomes ``aten.linear`` again and the
selector submodule is deleted.

Precondition: ``insert_group_selectors`` ran. ``masks`` defaults to the selectors the nodes hold;
selectors must be binary.
"""
from __future__ import annotations

import copy
from typing import Optional

import torch

from gmc.selector import GroupSelector


@torch.no_grad()
def fold_masks(gm: torch.fx.GraphModule, masks: Optional[dict[str, torch.Tensor]] = None) -> torch.fx.GraphModule:
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_module":
            continue
        selector = gm.get_submodule(node.target)
        if not isinstance(selector, GroupSelector):
            continue
        chosen = masks[selector.name] if masks is not None else selector.selectors
        weight_node = node.args[1]
        if chosen is not None:
            _replace_weight(gm, weight_node.target, selector, chosen)
        with graph.inserting_before(node):
            linear = graph.call_function(torch.ops.aten.linear.default, args=node.args, kwargs=node.kwargs)
        linear.meta = copy.copy(node.meta)
        node.replace_all_uses_with(linear)
        graph.erase_node(node)
        gm.delete_submodule(node.target)
    graph.lint()
    gm.recompile()
    return gm


def _replace_weight(gm, attr: str, selector: GroupSelector, selectors: torch.Tensor) -> None:
    owner_name, _, leaf = attr.rpartition(".")
    owner = gm.get_submodule(owner_name)
    weight = getattr(owner, leaf)
    values = selectors.detach()
    if values.is_floating_point() and not bool(((values == 0) | (values == 1)).all()):
        raise ValueError(f"selectors of {selector.name} are not binary; threshold them before folding")
    mask = selector.pattern.expand(values.to(weight.device, weight.dtype), tuple(weight.shape))
    folded = torch.nn.Parameter(weight.detach() * mask, requires_grad=False)
    delattr(owner, leaf)
    owner.register_parameter(leaf, folded)
