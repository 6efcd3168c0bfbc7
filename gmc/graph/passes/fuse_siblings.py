"""Fuse group-sparse ops that read the same input into one op (horizontal fusion).

Why: a lowered decode step runs one op per target: seven per Llama decoder layer, 211 per
SmolLM2 token with its head. q/k/v read one normed hidden state and gate/up another; fused, a
layer makes four calls, and the kernel streams one block of ``R_q + R_k + R_v`` kept rows where it
streamed three short ones (a lowered SmolLM2 k/v block keeps ~96 rows, which streamed at a third
of the big projections' GB/s: docs/lowering.md).

Preconditions: ``gm`` is a graph after ``lower_group_sparse`` (its op nodes read their packed
tensors through ``get_attr`` nodes, the bias a ``get_attr`` or ``None``).

Op nodes are siblings when they read the same ``x`` node (with its ``meta["val"]``: ``d_in``) and
``g_in``, the same values dtype (all float, all int8 or all int4), and no other node reads their packed
tensors (a tied head's values are also an embedding table: it is never fused). Each set of two or more becomes
one op on their outputs concatenated (``gmc.kernels.packed.concat_outputs``, buffers under
``gmc_fused.<j>``), inserted where the first of them was, and each former node becomes
``aten.slice`` of its columns of that output (``node.meta`` copied). Their packed tensors are
dropped from the graph. ``graph.lint()`` at the end.
"""
from __future__ import annotations

import copy

import torch

from gmc.graph.trace import attr_tensor, drop_if_unused
from gmc.kernels.group_sparse_linear import group_sparse_linear  # noqa: F401  (registers the op)
from gmc.kernels.packed import KernelInputs, concat_outputs

_OWNER = "gmc_fused"
_OP = torch.ops.gmc.group_sparse_linear.default


def fuse_siblings(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Replace each set of sibling ``gmc::group_sparse_linear`` nodes by one op and slices of it."""
    graph = gm.graph
    sets: dict[tuple, list[torch.fx.Node]] = {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target is _OP and _fusable(node) and "val" in node.args[0].meta:
            sets.setdefault(_sibling_key(gm, node), []).append(node)
    owner = None
    for index, nodes in enumerate(nodes for nodes in sets.values() if len(nodes) > 1):
        if owner is None:
            owner = torch.nn.Module()
            gm.add_module(_OWNER, owner)
        _fuse(gm, owner, str(index), nodes)
    graph.lint()
    gm.recompile()
    return gm


def _fusable(node: torch.fx.Node) -> bool:
    """Every packed input of ``node`` is a ``get_attr`` that only this node reads."""
    values, row_idx, row_ptr, bias = node.args[1:5]
    scales = node.args[7] if len(node.args) > 7 else None
    attrs = [a for a in (values, row_idx, row_ptr, bias, scales) if a is not None]
    return all(isinstance(a, torch.fx.Node) and a.op == "get_attr" and len(a.users) == 1 for a in attrs)


def _sibling_key(gm: torch.fx.GraphModule, node: torch.fx.Node) -> tuple:
    x, values = node.args[0], attr_tensor(gm, node.args[1].target)
    scaled = len(node.args) > 7 and node.args[7] is not None
    return x, node.args[6], x.meta["val"].shape[-1], values.dtype, scaled


def _inputs(gm: torch.fx.GraphModule, node: torch.fx.Node) -> KernelInputs:
    values, row_idx, row_ptr, bias = (None if a is None else attr_tensor(gm, a.target) for a in node.args[1:5])
    scales = node.args[7] if len(node.args) > 7 else None
    return KernelInputs(values, row_idx, row_ptr, node.args[5],
                        None if scales is None else attr_tensor(gm, scales.target), bias)


def _fuse(gm: torch.fx.GraphModule, owner: torch.nn.Module, name: str, nodes: list[torch.fx.Node]) -> None:
    graph = gm.graph
    x, g_in = nodes[0].args[0], nodes[0].args[6]
    layers = [_inputs(gm, node) for node in nodes]
    fused = concat_outputs(layers, x.meta["val"].shape[-1], g_in)
    holder = torch.nn.Module()
    leaves = {"values": fused.values, "row_idx": fused.row_idx, "row_ptr": fused.row_ptr,
              "bias": fused.bias, "scales": fused.scales}
    for leaf, tensor in leaves.items():
        if tensor is not None:
            holder.register_buffer(leaf, tensor)
    owner.add_module(name, holder)
    with graph.inserting_before(nodes[0]):
        attr = {leaf: None if tensor is None else graph.get_attr(f"{_OWNER}.{name}.{leaf}")
                for leaf, tensor in leaves.items()}
        args = (x, attr["values"], attr["row_idx"], attr["row_ptr"], attr["bias"], fused.d_out, g_in)
        if fused.scales is not None:
            args += (attr["scales"],)
        op = graph.call_function(_OP, args=args)
    start = 0
    for node, layer in zip(nodes, layers):
        with graph.inserting_before(node):
            part = graph.call_function(torch.ops.aten.slice.Tensor, (op, -1, start, start + layer.d_out))
        part.meta = copy.copy(node.meta)
        start += layer.d_out
        packed = [a for a in node.args[1:] if isinstance(a, torch.fx.Node)]
        node.replace_all_uses_with(part)
        graph.erase_node(node)
        for attr_node in packed:
            drop_if_unused(gm, attr_node)

