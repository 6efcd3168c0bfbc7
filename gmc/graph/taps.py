"""The decoder blocks' outputs of a logits graph, and the graph that returns them beside its logits.

Layer-wise distillation (``--layer-kd``, ``gmc.masks.training``) compares the student's residual
stream after chosen decoder blocks with the dense teacher's. ``block_outputs`` finds those values in
a traced graph from the module path ``torch.export`` records on every node (``nn_module_stack``):
the output of block ``i`` is the last node run inside ``*.layers.i`` that a node outside it reads
(the residual add after the MLP in Llama, Qwen and Mistral). ``with_outputs`` returns a graph that
shares the original's parameters and modules (its selectors included) and returns
``(logits, *taps)``.
"""
from __future__ import annotations

import re

from torch import fx

from gmc.errors import GmcError

_BLOCK = re.compile(r"\.layers\.(\d+)$")


def block_outputs(gm: fx.GraphModule) -> list[str]:
    """The names of the nodes that are the decoder blocks' outputs, block 0 first."""
    owner: dict[fx.Node, int] = {}
    for node in gm.graph.nodes:
        for path, _ in (node.meta.get("nn_module_stack") or {}).values():
            found = _BLOCK.search(path)
            if found:
                owner[node] = int(found.group(1))  # the innermost block on the path wins
    outputs: dict[int, fx.Node] = {}
    for node, block in owner.items():  # execution order: a later escaping node replaces an earlier one
        if any(owner.get(user) != block for user in node.users):
            outputs[block] = node
    if not outputs or sorted(outputs) != list(range(len(outputs))):
        raise GmcError(f"cannot find the decoder blocks' outputs in the graph of "
                       f"{gm.meta.get('gmc_model_class', 'this model')} (found blocks {sorted(outputs)}): "
                       f"layer-wise distillation needs a graph traced by gmc from a model with "
                       f"model.layers.N decoder blocks; use --layer-kd 0")
    return [outputs[i].name for i in range(len(outputs))]


def chosen_blocks(count: int, every: int) -> list[int]:
    """Every ``every``-th of ``count`` blocks, counted back from the last one (which is always chosen)."""
    return sorted(range(count - 1, -1, -every))


def with_outputs(gm: fx.GraphModule, names: list[str]) -> fx.GraphModule:
    """A graph computing ``gm``'s output and returning ``(output, *values of the nodes named)``."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    result = graph.graph_copy(gm.graph, env)
    result = result[0] if isinstance(result, (tuple, list)) and len(result) == 1 else result
    nodes = {node.name: node for node in gm.graph.nodes}
    graph.output((result, *(env[nodes[name]] for name in names)))
    tapped = fx.GraphModule(gm, graph)
    tapped.meta.update(gm.meta)
    return tapped
