"""Fold binary selectors into the weights and remove the selector nodes.

Why: once masks are chosen, the graph should be a plain dense graph again whose target weights
hold zeros in pruned groups, ready to save as an HF checkpoint, to evaluate or to lower. Each
target's weight becomes ``W * expand(B)`` (``W`` replaced first by the artifact's updated weight
when ``weights`` names it: SparseGPT, reconstruction, recovery); each ``GroupSelector`` call
becomes ``aten.linear`` again and the selector submodule is deleted. This is gmc's only fold:
``--save-dense``, ``gmc lower --backend dense`` and ``gmc eval`` of an artifact all run it.

``in_place=False`` (default) gives the graph new weight tensors and leaves the originals (shared
with the eager model) untouched. ``in_place=True`` writes the folded values into the shared
tensors, so the eager model the graph was traced from holds the same folded weights: that is how
the eager form (``save_pretrained``, ``generate``, lm-eval) is derived from the pass.

Precondition: ``insert_group_selectors`` ran. ``masks`` defaults to the selectors the nodes hold;
selectors must be binary. Postcondition: no ``GroupSelector`` node left; ``graph.lint()`` passes.
"""
from __future__ import annotations

import copy
from typing import Mapping, Optional

import torch

from gmc.graph.selector import GroupSelector


@torch.no_grad()
def fold_masks(
    gm: torch.fx.GraphModule,
    masks: Optional[Mapping[str, torch.Tensor]] = None,
    weights: Optional[Mapping[str, torch.Tensor]] = None,
    in_place: bool = False,
) -> torch.fx.GraphModule:
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_module":
            continue
        selector = gm.get_submodule(node.target)
        if not isinstance(selector, GroupSelector):
            continue
        chosen = masks[selector.name] if masks is not None else selector.selectors
        if chosen is not None:
            updated = weights.get(selector.name) if weights else None
            _fold_weight(gm, node.args[1].target, selector, chosen, updated, in_place)
        with graph.inserting_before(node):
            linear = graph.call_function(torch.ops.aten.linear.default, args=node.args, kwargs=node.kwargs)
        linear.meta = copy.copy(node.meta)
        node.replace_all_uses_with(linear)
        graph.erase_node(node)
        gm.delete_submodule(node.target)
    graph.lint()
    gm.recompile()
    return gm


def _fold_weight(gm, attr: str, selector: GroupSelector, selectors: torch.Tensor,
                 updated: Optional[torch.Tensor], in_place: bool) -> None:
    owner_name, _, leaf = attr.rpartition(".")
    owner = gm.get_submodule(owner_name)
    weight = getattr(owner, leaf)
    values = selectors.detach()
    if values.is_floating_point() and not bool(((values == 0) | (values == 1)).all()):
        raise ValueError(f"selectors of {selector.name} are not binary; threshold them before folding")
    source = weight if updated is None else updated.to(weight.device, weight.dtype)
    mask = selector.pattern.expand(values.to(weight.device, weight.dtype), tuple(weight.shape))
    if in_place:
        if source is not weight:
            weight.copy_(source)
        weight.mul_(mask)
        return
    folded = torch.nn.Parameter(source.detach() * mask, requires_grad=False)
    delattr(owner, leaf)
    owner.register_parameter(leaf, folded)
