"""Fuse a decode step's attention, from the q/k/v product to the o product, into one ``gmc::attention_block``.

Why: in a compiled one-token step the calling thread runs, per layer, the q/k/v op, the rope's
generated kernel, the attention op and the o op, with about ten views, buffers and tensor handles
between them, while the other threads wait (docs/lowering.md, "Why compiled decode is built this
way"). One op call does it all (``gmc/kernels/attention_block.py``), with the products and the
attention of the ops it replaces.

Preconditions: ``gm`` is a decode step program (``gmc.graph.decode``: one token, the attention a
``gmc::decode_attention`` node) after ``fuse_siblings`` (the layer's q, k and v projections are one
op whose output is ``[q | k | v]``).

Matched, for each ``gmc::decode_attention`` node ``att`` (float32, CPU)::

    qkv    = gmc::group_sparse_linear(x, ...)             d_out (H + 2 H_kv) D; read by the three slices only
    q/k/v  = transpose(view(slice(qkv, -1, a, b), [1, 1, -1, D]), 1, 2)
    rope t = add(mul(t, cos), mul(cat([neg(slice(t, -1, D/2, end)), slice(t, -1, 0, D/2)], -1), sin))
    kc     = index_copy_(keys, 2, index, rope k)          keys, values: placeholders (the cache)
    vc     = index_copy_(values, 2, index, v)
    att    = decode_attention(rope q, narrow(kc, 2, 0, length), narrow(vc, 2, 0, length), mask, scale)
    out    = gmc::group_sparse_linear(reshape(transpose(att, 1, 2), [1, 1, -1]), ...)   (the o projection)

with one ``cos``, ``sin``, ``index`` and ``length`` for both, products of one ``g_in``, and every
intermediate read inside the match only. The op replaces ``out`` (``node.meta`` copied) and writes
the cache itself; the matched nodes are erased. Layers that differ (Qwen3's q/k norms, other
rotary forms, bf16) keep their nodes. ``graph.lint()`` at the end.
"""
from __future__ import annotations

import copy
from typing import NamedTuple, Optional

import torch

from gmc.kernels.attention_block import attention_block
from gmc.kernels.decode_attention import decode_attention
from gmc.kernels.group_sparse_linear import group_sparse_linear

aten = torch.ops.aten
_LAST = (-1, 3)  # the head dimension of a [B, H, T, D] tensor, as the graph may name it


class _Match(NamedTuple):
    out: torch.fx.Node
    args: tuple
    erased: list  # every matched node but ``out``


def fuse_attention(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Replace each matched attention subgraph of a decode step by one ``gmc::attention_block`` node."""
    graph = gm.graph
    for att in [node for node in graph.nodes if _calls(node, decode_attention)]:
        match = _match(att)
        if match is not None:
            _replace(graph, match)
    graph.lint()
    gm.recompile()
    return gm


def _calls(node, *targets) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in targets


def _sole_user(node: torch.fx.Node) -> Optional[torch.fx.Node]:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _val(node):
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _heads(t: torch.fx.Node, qkv_of: dict) -> Optional[tuple]:
    """``(qkv, start, end, D)`` when ``t`` is ``transpose(view(slice(qkv, -1, start, end), [1, 1, -1, D]), 1, 2)``."""
    if not _calls(t, aten.transpose.int) or tuple(t.args[1:]) not in ((1, 2), (2, 1)):
        return None
    view = t.args[0]
    if not _calls(view, aten.view.default, aten.reshape.default) or _sole_user(view) is not t:
        return None
    shape = list(view.args[1])
    part = view.args[0]
    if len(shape) != 4 or not isinstance(shape[-1], int) or not _calls(part, aten.slice.Tensor) \
            or _sole_user(part) is not view:
        return None
    if len(part.args) not in (4, 5) or tuple(part.args[4:]) not in ((), (1,)):
        return None
    qkv, dim, start, end = part.args[:4]
    if dim not in (-1, 2) or not _calls(qkv, group_sparse_linear) or not isinstance(start, int) \
            or not isinstance(end, int):
        return None
    qkv_of.setdefault(t, (view, part))
    return qkv, start, min(end, qkv.args[5]), shape[-1]


def _rope(node: torch.fx.Node) -> Optional[tuple]:
    """``(t, cos, sin, nodes)`` when ``node`` is HF's ``t * cos + rotate_half(t) * sin``."""
    if not _calls(node, aten.add.Tensor) or len(node.args) != 2:
        return None
    for plain, rotated in (node.args, reversed(node.args)):
        if not (_calls(plain, aten.mul.Tensor) and _calls(rotated, aten.mul.Tensor)):
            continue
        for t, cos in (plain.args, reversed(plain.args)):
            for cat, sin in (rotated.args, reversed(rotated.args)):
                parts = _halves(cat, t)
                if parts is not None and isinstance(cos, torch.fx.Node) and isinstance(sin, torch.fx.Node):
                    nodes = [node, plain, rotated, *parts]
                    if all(len(n.users) == 1 for n in nodes[1:]):
                        return t, cos, sin, nodes
    return None


def _halves(cat, t) -> Optional[list]:
    """The nodes of ``cat([neg(slice(t, -1, D/2, end)), slice(t, -1, 0, D/2)], -1)``, or None."""
    if not _calls(cat, aten.cat.default) or (cat.args[1] if len(cat.args) > 1 else 0) not in _LAST:
        return None
    pieces = cat.args[0]
    if len(pieces) != 2 or not _calls(pieces[0], aten.neg.default):
        return None
    neg, low = pieces
    high = neg.args[0]
    dim = _val(t).shape[-1] if _val(t) is not None else None
    if dim is None or dim % 2 or not (_calls(high, aten.slice.Tensor) and _calls(low, aten.slice.Tensor)):
        return None
    half = dim // 2
    if high.args[0] is not t or low.args[0] is not t or high.args[1] not in _LAST or low.args[1] not in _LAST:
        return None
    if len(high.args) < 4 or high.args[2] != half or high.args[3] < dim or tuple(low.args[2:4]) != (0, half):
        return None
    return [cat, neg, high, low]


def _narrowed(node) -> Optional[tuple]:
    """``(cache write, length)`` of ``narrow(write, 2, 0, length)``."""
    if not _calls(node, aten.narrow.default) or tuple(node.args[1:3]) != (2, 0):
        return None
    return node.args[0], node.args[3]


def _write(node, index=None) -> Optional[tuple]:
    """``(cache placeholder, index, written)`` of ``index_copy_(cache, 2, index, written)``."""
    if not _calls(node, aten.index_copy_.default) or node.args[1] != 2 or node.args[0].op != "placeholder":
        return None
    if index is not None and node.args[2] is not index:
        return None
    return node.args[0], node.args[2], node.args[3]


def _match(att: torch.fx.Node) -> Optional[_Match]:
    q_rot, kn, vn = att.args[:3]
    mask = att.args[3] if len(att.args) > 3 else att.kwargs.get("mask")
    scale = att.args[4] if len(att.args) > 4 else att.kwargs.get("scale")
    val = _val(att)
    if val is None or val.dtype != torch.float32 or val.device.type != "cpu" or not isinstance(scale, float):
        return None
    k_side, v_side = _narrowed(kn), _narrowed(vn)
    if k_side is None or v_side is None or k_side[1] != v_side[1]:  # nodes compare by identity
        return None
    length = k_side[1]
    k_write = _write(k_side[0])
    v_write = _write(v_side[0], k_write[1]) if k_write is not None else None
    if v_write is None:
        return None
    keys, index, k_rot = k_write
    values, _, v_t = v_write
    q_parts, k_parts = _rope(q_rot), _rope(k_rot)
    if q_parts is None or k_parts is None or q_parts[1:3] != k_parts[1:3]:
        return None
    views: dict = {}
    heads = [_heads(t, views) for t in (q_parts[0], k_parts[0], v_t)]
    if any(h is None for h in heads) or len({h[0] for h in heads}) != 1 or len({h[3] for h in heads}) != 1:
        return None
    qkv, dim = heads[0][0], heads[0][3]
    cache = _val(keys)
    if cache is None or cache.dim() != 4 or cache.shape[3] != dim:
        return None
    kv = cache.shape[1] * dim
    n_q = qkv.args[5] - 2 * kv
    if n_q <= 0 or n_q % dim or [h[1:3] for h in heads] != [(0, n_q), (n_q, n_q + kv), (n_q + kv, n_q + 2 * kv)]:
        return None
    transpose = _sole_user(att)
    reshape = _sole_user(transpose) if _calls(transpose, aten.transpose.int) else None
    out = _sole_user(reshape) if _calls(reshape, aten.reshape.default, aten.view.default) else None
    if not _calls(out, group_sparse_linear) or out.args[0] is not reshape or out.args[6] != qkv.args[6]:
        return None
    q_t, k_t = q_parts[0], k_parts[0]
    erased = [reshape, transpose, att, kn, vn, k_side[0], v_side[0], *q_parts[3], *k_parts[3],
              q_t, k_t, v_t, *(n for t in (q_t, k_t, v_t) for n in views[t]), qkv]
    inside = set(erased) | {out}
    if any(set(n.users) - inside for n in erased):
        return None
    args = (qkv.args[0], *qkv.args[1:5], q_parts[1], q_parts[2], index, keys, values, length, mask, scale,
            *out.args[1:5], n_q // dim, out.args[5], out.args[6], _scales(qkv), _scales(out))
    return _Match(out, args, erased)


def _scales(node: torch.fx.Node):
    return node.args[7] if len(node.args) > 7 else node.kwargs.get("scales")


def _replace(graph: torch.fx.Graph, match: _Match) -> None:
    with graph.inserting_before(match.out):
        node = graph.call_function(attention_block, match.args)
    node.meta = copy.copy(match.out.meta)
    match.out.replace_all_uses_with(node)
    graph.erase_node(match.out)
    for dead in sorted(set(match.erased), key=_order(graph), reverse=True):  # users before their inputs
        graph.erase_node(dead)


def _order(graph: torch.fx.Graph):
    position = {node: i for i, node in enumerate(graph.nodes)}
    return position.__getitem__
