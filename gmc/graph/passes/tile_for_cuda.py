"""Put every lowered op on CUDA buffers into the layout the CUDA kernel reads (``gmc/kernels/tiled.py``).

Why: the packed layout (input-block major) is the format on disk and what the CPU kernel
streams; a GPU program owns output rows and wants each kept row contiguous and 16-byte aligned
(``gmc/kernels/triton_group_sparse.py``). The op reads either layout (``row_idx`` 1-D: packed,
2-D: tiled), so the conversion is a change of buffers, not of nodes, and the graph's signature and
op count stay as they were: an exported or compiled CUDA program holds the tiled buffers and its
kernel launches read them directly. A layer that keeps every group in float (the lowered output
head) becomes ``aten.linear`` on its values seen as the dense weight (``values.view(d_in, d_out).t()``,
no copy): cuBLAS streams a dense matrix as fast as any kernel, and a tied embedding keeps reading
the same tensor.

Preconditions: ``gm`` after ``lower_group_sparse`` (and the fusion passes, which read the packed
layout): its op nodes read their tensors through ``get_attr`` nodes, ``x`` carries
``meta["val"]``. Ops on CPU buffers, or already tiled, are left as they are. Buffers go under
``gmc_tiled.<i>``; the packed ones are dropped once nothing reads them. ``graph.lint()`` at the end.
"""
from __future__ import annotations

import copy

import torch

from gmc.graph.trace import attr_tensor, drop_if_unused
from gmc.kernels.gated_mlp import group_sparse_gated_mlp
from gmc.kernels.group_sparse_linear import group_sparse_linear
from gmc.kernels.tiled import is_tiled, tile

_OWNER = "gmc_tiled"
_LINEAR = torch.ops.aten.linear.default


def tile_for_cuda(gm: torch.fx.GraphModule, device_type: str = "cuda") -> torch.fx.GraphModule:
    """Replace the packed buffers of each ``gmc`` op on ``device_type`` buffers by tiled ones (whole float
    layers: ``aten.linear``). ``device_type`` is CUDA's in every pass list; the tests tile CPU graphs,
    whose op then runs the layout through its torch implementation."""
    graph = gm.graph
    owner = None
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in (group_sparse_linear, group_sparse_gated_mlp):
            continue
        values = attr_tensor(gm, node.args[1].target)
        if values.device.type != device_type or is_tiled(attr_tensor(gm, node.args[2].target)):
            continue
        if owner is None:
            owner = torch.nn.Module()
            gm.add_module(_OWNER, owner)
        if node.target is group_sparse_linear and _whole_float(gm, node):
            _to_dense_linear(gm, node)
            continue
        index = sum(1 for _ in owner.children())
        x_width = node.args[0].meta["val"].shape[-1]
        if node.target is group_sparse_linear:  # (x, values, row_idx, row_ptr, bias, d_out, g_in, scales?)
            layers = [(1, 2, 3, 7, node.args[5], x_width)]
        else:  # (x, values, row_idx, row_ptr, bias, dvalues, drow_idx, drow_ptr, dbias, d_ff, d_out, g_in, s?, ds?)
            layers = [(1, 2, 3, 12, 2 * node.args[9], x_width), (5, 6, 7, 13, node.args[10], node.args[9])]
        g_in = node.args[6] if node.target is group_sparse_linear else node.args[11]
        _replace_layers(gm, owner, str(index), node, layers, g_in)
    graph.lint()
    gm.recompile()
    return gm


def _arg(node: torch.fx.Node, index: int):
    return node.args[index] if len(node.args) > index else None


def _whole_float(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    d_out, d_in = node.args[5], node.args[0].meta["val"].shape[-1]
    return _arg(node, 7) is None and attr_tensor(gm, node.args[1].target).numel() == d_out * d_in


def _to_dense_linear(gm: torch.fx.GraphModule, node: torch.fx.Node) -> None:
    """``values [d_in * d_out]`` of a whole layer is ``weight.T`` flattened (``gmc.kernels.packed.pack_dense``)."""
    graph = gm.graph
    d_out, d_in = node.args[5], node.args[0].meta["val"].shape[-1]
    with graph.inserting_before(node):
        table = graph.call_function(torch.ops.aten.view.default, (node.args[1], [d_in, d_out]))
        weight = graph.call_function(torch.ops.aten.permute.default, (table, [1, 0]))  # [d_out, d_in]
        linear = graph.call_function(_LINEAR, (node.args[0], weight, node.args[4]))
    linear.meta = copy.copy(node.meta)
    indices = [node.args[2], node.args[3]]
    node.replace_all_uses_with(linear)
    graph.erase_node(node)
    for attr in indices:
        drop_if_unused(gm, attr)


def _replace_layers(gm, owner, name: str, node: torch.fx.Node, layers, g_in: int) -> None:
    """Tile each ``(values, row_idx, row_ptr, scales, d_out, d_in)`` argument group of ``node``."""
    graph = gm.graph
    holder = torch.nn.Module()
    owner.add_module(name, holder)
    args, dropped = list(node.args), []
    for part, (v, r, p, s, d_out, d_in) in enumerate(layers):
        scales = _arg(node, s)
        tiled = tile(attr_tensor(gm, args[v].target), attr_tensor(gm, args[r].target),
                     attr_tensor(gm, args[p].target), None if scales is None else attr_tensor(gm, scales.target),
                     d_out, d_in, g_in)
        leaves = {v: tiled.values, r: tiled.entries, p: tiled.tile_ptr, s: tiled.scales}
        for position, tensor in leaves.items():
            if tensor is None:
                continue
            leaf = f"{part}_{position}"
            holder.register_buffer(leaf, tensor)
            with graph.inserting_before(node):
                attr = graph.get_attr(f"{_OWNER}.{name}.{leaf}")
            dropped.append(args[position])
            args[position] = attr
    node.args = tuple(args)
    for attr in dropped:
        drop_if_unused(gm, attr)
