"""Fuse a lowered gated MLP into one op: ``down(silu(gate) * up)`` -> ``gmc::group_sparse_gated_mlp``.

Why: a compiled decode step pays per op call (the C shim, checks, the output, a fork and join on
several threads) and per generated kernel; Llama, Qwen2/3 and Mistral MLPs were two op calls
with the activation's kernel between them in every layer. One op runs both products and the
activation (``gmc/kernels/gated_mlp.py``), 30 fewer calls and kernels per SmolLM2 token
(docs/lowering.md).

Preconditions: ``gm`` after ``fuse_siblings`` (the MLP's gate and up projections are one op whose
output is ``[gate | up]``) on a graph whose op nodes read their packed tensors through
``get_attr`` nodes.

Matched, for each ``gmc::group_sparse_linear`` node ``down``::

    down.x = mul(silu(slice(fused, -1, 0, d_ff)), slice(fused, -1, d_ff, 2 d_ff))   (either operand order)
    fused  = gmc::group_sparse_linear with d_out = 2 d_ff and down's g_in, both quantized (int8, int4) or neither

where nothing else reads ``fused``, either slice, the silu or the product. The op replaces
``down`` (``node.meta`` copied) and reads the packed tensors of both; the rest is erased. Other
activations (GELU, ...) and unfused gate/up pairs are left as they are. ``graph.lint()`` at the end.
"""
from __future__ import annotations

import copy
from typing import NamedTuple, Optional

import torch

from gmc.kernels.gated_mlp import group_sparse_gated_mlp
from gmc.kernels.group_sparse_linear import group_sparse_linear

_SILU = torch.ops.aten.silu.default
_MUL = torch.ops.aten.mul.Tensor
_SLICE = torch.ops.aten.slice.Tensor


class _Match(NamedTuple):
    fused: torch.fx.Node  # the gate/up op
    gate: torch.fx.Node  # its slices
    up: torch.fx.Node
    silu: torch.fx.Node
    product: torch.fx.Node
    d_ff: int


def fuse_gated_mlp(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Replace each lowered ``down(silu(gate) * up)`` by one ``gmc::group_sparse_gated_mlp`` node."""
    graph = gm.graph
    for down in [node for node in graph.nodes if _calls(node, group_sparse_linear)]:
        match = _match(down)
        if match is not None:
            _replace(graph, down, match)
    graph.lint()
    gm.recompile()
    return gm


def _calls(node, target) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is target


def _only_user(node: torch.fx.Node, user: torch.fx.Node) -> bool:
    return list(node.users) == [user]


def _scales(node: torch.fx.Node) -> Optional[torch.fx.Node]:
    return node.args[7] if len(node.args) > 7 else None


def _match(down: torch.fx.Node) -> Optional[_Match]:
    product = down.args[0]
    if not _calls(product, _MUL) or not _only_user(product, down):
        return None
    first, second = product.args
    silu, up = (first, second) if _calls(first, _SILU) else (second, first)
    if not _calls(silu, _SILU) or not _only_user(silu, product) or not _calls(up, _SLICE):
        return None
    gate = silu.args[0]
    if not _calls(gate, _SLICE) or not _only_user(gate, silu) or not _only_user(up, product):
        return None
    fused = gate.args[0]
    if not _calls(fused, group_sparse_linear) or up.args[0] is not fused or set(fused.users) != {gate, up}:
        return None
    d_ff, odd = divmod(fused.args[5], 2)
    if odd or tuple(gate.args[1:]) not in ((-1, 0, d_ff), (-1, 0, d_ff, 1)) or \
            tuple(up.args[1:]) not in ((-1, d_ff, 2 * d_ff), (-1, d_ff, 2 * d_ff, 1)):
        return None
    if fused.args[6] != down.args[6] or (_scales(fused) is None) != (_scales(down) is None):
        return None
    return _Match(fused, gate, up, silu, product, d_ff)


def _replace(graph: torch.fx.Graph, down: torch.fx.Node, match: _Match) -> None:
    fused = match.fused
    args = (fused.args[0], *fused.args[1:5], *down.args[1:5], match.d_ff, down.args[5], down.args[6])
    if _scales(fused) is not None:
        args += (_scales(fused), _scales(down))
    with graph.inserting_before(down):
        node = graph.call_function(group_sparse_gated_mlp, args)
    node.meta = copy.copy(down.meta)
    down.replace_all_uses_with(node)
    for dead in (down, match.product, match.silu, match.up, match.gate, fused):  # users before their inputs
        graph.erase_node(dead)
