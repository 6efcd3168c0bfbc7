"""Split a logits graph at its output head: ``trunk(input_ids) -> hidden`` and ``head(hidden) -> logits``.

The head is the last ``aten.linear`` of the graph (``lm_head``) and whatever follows it on the
way to the output (a logit soft-cap, a cast). Mask learning caches the dense trunk's output per
calibration block and reruns only the head each step (``gmc.masks.teacher``): the same function as
the whole graph, at the head's share of its cost.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import fx


def split_output_head(gm: fx.GraphModule, taps: Sequence[str] = ()) -> Optional[tuple[fx.GraphModule, fx.GraphModule]]:
    """``(trunk, head)`` sharing ``gm``'s parameters and modules, or None when the output is not
    reached through one final ``aten.linear`` that reads nothing computed before it but its input.
    With ``taps`` (node names, ``gmc.graph.taps``) the trunk returns ``(hidden, *their values)``."""
    nodes = list(gm.graph.nodes)
    output = nodes[-1]
    linears = [n for n in nodes if n.op == "call_function" and n.target is torch.ops.aten.linear.default]
    if output.op != "output" or not linears:
        return None
    head_linear = linears[-1]
    hidden = head_linear.args[0]
    result = output.args[0]
    result = result[0] if isinstance(result, (tuple, list)) and len(result) == 1 else result
    if not isinstance(result, fx.Node):
        return None

    head_graph = fx.Graph()
    env = {hidden: head_graph.placeholder("hidden")}
    for node in nodes[nodes.index(head_linear):-1]:
        inputs = node.all_input_nodes
        if node.op == "get_attr":
            continue
        if all(n in env or n.op == "get_attr" for n in inputs):
            for n in inputs:
                if n not in env:
                    env[n] = head_graph.node_copy(n)
            env[node] = head_graph.node_copy(node, lambda n: env[n])
    if result not in env:
        return None
    head_graph.output(env[result])

    trunk_graph = fx.Graph()
    trunk_env: dict = {}
    trunk_graph.graph_copy(gm.graph, trunk_env)
    named = {node.name: node for node in nodes}
    trunk_graph.output((trunk_env[hidden], *(trunk_env[named[name]] for name in taps)) if taps else trunk_env[hidden])
    parts = fx.GraphModule(gm, trunk_graph), fx.GraphModule(gm, head_graph)
    for part in parts:
        part.graph.eliminate_dead_code()
        part.recompile()
    return parts
