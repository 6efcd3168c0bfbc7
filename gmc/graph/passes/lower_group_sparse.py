"""Lower masked target linears to ``gmc::group_sparse_linear`` on packed weights.

Why: a folded graph still multiplies by every zero of a pruned group. After this pass each target
``aten.linear(x, W, b)`` reads only the kept groups (``gmc/kernels/packed.py``): half the weight bytes at
50%, which is the decode time on memory-bound hardware, and one custom-op node per target that
``torch.export`` and the ONNX exporter keep as a unit.

Preconditions:
- ``gm`` comes from ``gmc.graph.trace.trace_model`` (parameters are ``get_attr`` nodes named
  ``model.<HF parameter name>``), with selectors already folded or never inserted: targets are
  plain ``aten.linear`` nodes;
- ``packed`` maps HF module names (``model.layers.0.self_attn.q_proj``) to ``PackedLinear``, e.g.
  from ``gmc.graph.pipeline.pack_targets``; every name must match exactly one linear of ``gm`` whose weight
  has the packed shape, and its bias (if any) is taken from the graph.

Each lowered node gets its packed tensors as new buffers under ``gmc_packed.<i>`` (with
``scales`` as the op's last argument when the layer is weight-only int8 or int4, ``quantize``); the graph's
reference to the dense weight is dropped once no node uses it (the tensor itself, shared with the
eager model, is not touched), so a re-export of ``gm`` carries only the packed targets.
``node.meta`` (``val``, stack trace) is copied to the replacement, then ``graph.lint()``.

A layer that keeps every group (``gmc.kernels.packed.pack_dense``: an output head on gmc's GEMV) may share
its dense weight with an embedding (tied word embeddings): such ``aten.embedding`` lookups then
read the packed values as ``values.view(d_in, d_out).t()`` (the same numbers, ``is_whole``), so
the program holds that matrix once, not a dense copy beside the packed one.
"""
from __future__ import annotations

import copy
from typing import Mapping

import torch

from gmc.errors import GmcError
from gmc.graph.trace import attr_tensor, drop_if_unused, linear_nodes
from gmc.kernels.group_sparse_linear import group_sparse_linear  # noqa: F401  (registers the op)
from gmc.kernels.packed import PackedLinear, is_whole

_OWNER = "gmc_packed"


def lower_group_sparse(gm: torch.fx.GraphModule, packed: Mapping[str, PackedLinear]) -> torch.fx.GraphModule:
    """Replace each target ``aten.linear`` named in ``packed`` by ``gmc::group_sparse_linear``."""
    graph = gm.graph
    linears = linear_nodes(gm)
    missing = sorted(set(packed) - set(linears))
    if missing:
        raise GmcError(f"cannot lower {missing[0]!r}: no aten.linear of the graph uses {missing[0]}.weight "
                       f"({len(missing)} packed layers unmatched)")
    owner = torch.nn.Module()
    gm.add_module(_OWNER, owner)
    for index, (name, layer) in enumerate(packed.items()):
        node = linears[name]
        weight_node = node.args[1]
        weight = attr_tensor(gm, weight_node.target)
        if tuple(weight.shape) != layer.shape:
            raise GmcError(f"cannot lower {name!r}: packed shape {layer.shape} != graph weight {tuple(weight.shape)}")
        device = weight.device
        inputs = _register_packed(gm, owner, index, layer.to(device))
        x = node.args[0]
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        with graph.inserting_before(node):
            attrs = {leaf: graph.get_attr(f"{_OWNER}.{index}.{leaf}") for leaf in inputs}
            args = (x, attrs["values"], attrs["row_idx"], attrs["row_ptr"], bias, layer.shape[0], layer.spec.g_in)
            if "scales" in attrs:
                args += (attrs["scales"],)
            lowered = graph.call_function(torch.ops.gmc.group_sparse_linear.default, args=args)
        lowered.meta = copy.copy(node.meta)
        node.replace_all_uses_with(lowered)
        graph.erase_node(node)
        rewired = []  # a tied embedding of a whole layer reads its packed values instead
        if is_whole(layer):
            rewired = _embeddings_read_packed(gm, weight, f"{_OWNER}.{index}.values", layer.shape)
        for dense in {weight_node, *rewired}:
            drop_if_unused(gm, dense)
    graph.lint()
    gm.recompile()
    return gm


def _embeddings_read_packed(gm: torch.fx.GraphModule, weight: torch.Tensor, values: str,
                            shape: tuple[int, int]) -> list[torch.fx.Node]:
    """Every ``aten.embedding`` of ``weight`` (by any attribute name) reads ``values`` transposed;
    returns the ``get_attr`` nodes of ``weight`` it looked at (for ``drop_if_unused``)."""
    graph = gm.graph
    seen = []
    for node in list(graph.nodes):
        if node.op != "get_attr" or not _same_tensor(attr_tensor(gm, node.target), weight):
            continue
        for user in list(node.users):
            if user.target is torch.ops.aten.embedding.default and user.args[0] is node:
                with graph.inserting_before(user):
                    flat = graph.get_attr(values)  # [d_out * d_in] = weight.T, flattened
                    table = graph.call_function(torch.ops.aten.view.default, (flat, [shape[1], shape[0]]))
                    table = graph.call_function(torch.ops.aten.permute.default, (table, [1, 0]))  # [d_out, d_in]
                user.replace_input_with(node, table)
        seen.append(node)
    return seen


def _same_tensor(a, b) -> bool:
    return isinstance(a, torch.Tensor) and (a.data_ptr(), a.shape, a.stride(), a.dtype) == (
        b.data_ptr(), b.shape, b.stride(), b.dtype)


def _register_packed(gm, owner: torch.nn.Module, index: int, layer: PackedLinear) -> tuple[str, ...]:
    """Hold one layer's kernel inputs as buffers of ``gm.gmc_packed.<index>``."""
    holder = torch.nn.Module()
    holder.register_buffer("values", layer.values)  # [nnz]
    holder.register_buffer("row_idx", layer.row_idx)  # [R] int64
    holder.register_buffer("row_ptr", layer.row_ptr)  # [G_in + 1] int32
    leaves = ("values", "row_idx", "row_ptr")
    if layer.scales is not None:
        holder.register_buffer("scales", layer.scales)  # [R] fp32, int8 values
        leaves += ("scales",)
    owner.add_module(str(index), holder)
    return leaves

