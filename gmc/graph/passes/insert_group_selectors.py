"""Insert one group-selector node per target linear.

Why: mask learning, calibration statistics and heuristic masks all need to act on each target's
weight inside the traced graph. Each target ``aten.linear(x, W, b)`` becomes a ``call_module``
of a ``GroupSelector`` holding that target's selectors: ``linear(x, W * expand(B), b)`` when
enabled, the dense linear when disabled (the teacher), with a backward that keeps no full-size
mask (see ``gmc.graph.selector``). The selectors start empty (dense) until a mask source sets them.

Precondition: targets from ``find_targets`` on this ``gm``. Postcondition: one ``call_module``
node per target, same args and ``meta`` as the linear it replaces, no other node touched.
"""
from __future__ import annotations

import copy

import torch

from gmc.graph.passes.find_targets import Target
from gmc.graph.selector import GroupSelector
from gmc.groups import Pattern

SELECTOR_PREFIX = "gmc_selector_"


def insert_group_selectors(
    gm: torch.fx.GraphModule, targets: list[Target], pattern: Pattern
) -> torch.fx.GraphModule:
    graph = gm.graph
    for target in targets:
        node = target.node
        module_name = SELECTOR_PREFIX + target.name.replace(".", "_")
        gm.add_submodule(module_name, GroupSelector(target.name, pattern, target.shape))
        with graph.inserting_before(node):
            selector = graph.call_module(module_name, args=node.args, kwargs=node.kwargs)
        selector.meta = copy.copy(node.meta)
        node.replace_all_uses_with(selector)
        graph.erase_node(node)
        target.node = selector
    graph.lint()
    gm.recompile()
    return gm
