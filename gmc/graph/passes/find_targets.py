"""Find the target linears of a traced causal LM.

Why: every later pass (selectors, folding, lowering) acts on the same set of linears, named by
the HF module names that masks are keyed by. A target is an ``aten.linear`` node whose weight is
a ``get_attr`` of a 2-D tensor and whose module name passes the ``TargetFilter``
(``gmc.graph.targets``: the one definition of what a target is, shared with the eager form).

Precondition: ``gm`` comes from ``gmc.graph.trace.trace_model`` (parameters as ``get_attr`` nodes).
Postcondition: the graph is unchanged; targets come in execution order.
"""
from __future__ import annotations

import torch

from gmc.graph.targets import Target, TargetFilter
from gmc.graph.trace import attr_tensor, linear_nodes


def find_targets(gm: torch.fx.GraphModule, chosen: TargetFilter = TargetFilter()) -> list[Target]:
    """Target linears of ``gm`` in execution order."""
    targets = [Target(name, tuple(attr_tensor(gm, node.args[1].target).shape), node)
               for name, node in linear_nodes(gm).items() if chosen(name)]
    if not targets:
        raise chosen.none_found(gm.meta.get("gmc_model_class", "the model"))
    return targets
