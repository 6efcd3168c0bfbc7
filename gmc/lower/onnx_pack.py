"""The ONNX packing pass: each ``MatMul`` of a dense decoder graph whose weight has all-zero groups
becomes gmc's group-sparse op over the kept groups (``gmc.kernels.onnx_group_sparse``).

The graph in is what onnxruntime-genai's model builder writes for the masks folded into the model
(pruned groups are zeros): its attention, KV cache and norms are the runtime's own fused ops, and
its weights are ``MatMul`` initializers ``B [d_in, d_out]`` (q, k and v side by side in one). The
pass reads each weight's all-zero groups of the artifact's pattern (``gmc.lower.from_zeros``), packs
the rest, and puts the op's nodes in the ``MatMul``'s place, so the graph's inputs, outputs and
every other node stay the builder's. The packing is exact: a kept group holding zeros is kept whole,
and a dropped group's weights were all zero. A weight that is neither pruned nor quantized stays a
``MatMul`` (the runtime's dense product is the fastest for it).

The output head (the ``MatMul`` writing a graph output) is never a target; with ``--quantize`` it is
packed whole at int8, as the packed backend's head is (``gmc.graph.pipeline.packed_head``). Standard
ops take float values only (``standard_op_nodes`` refuses the others).
"""
from __future__ import annotations

from dataclasses import dataclass

import onnx
import torch
from onnx import numpy_helper

from gmc.errors import GmcError
from gmc.graph.pipeline import HEAD_GROUP
from gmc.groups import GroupSpec, parse_pattern
from gmc.kernels.onnx_group_sparse import DOMAIN, VERSION, custom_op_nodes, register_schema, standard_op_nodes
from gmc.kernels.packed import pack, pack_dense
from gmc.kernels.quantize import quantize
from gmc.lower.from_zeros import zero_groups


@dataclass(frozen=True)
class PackedGraph:
    """What ``pack_onnx`` did to a graph."""

    layers: int  # MatMuls replaced by the group-sparse op (the head included)
    kept: int  # weights those layers keep (the head's included)
    weights: int  # weights those layers had
    packed_bytes: int  # the replaced weights as stored now: kept values, scales, indices
    dense_bytes: int  # the same weights as the builder stored them


def pack_onnx(model: onnx.ModelProto, pattern, quantize_as: str = "none", standard_ops: bool = False
              ) -> PackedGraph:
    """Rewrite ``model`` (external data loaded) in place: every ``MatMul`` whose weight has all-zero
    groups of ``pattern`` (or every weight, with ``quantize_as`` int8 or int4) as a group-sparse op."""
    spec = parse_pattern(pattern)
    if not isinstance(spec, GroupSpec):
        raise GmcError(f"the ONNX lowering packs group patterns (GOUTxGIN such as 1x256), not {spec}")
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    outputs = {o.name for o in graph.output}
    users: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            users[name] = users.get(name, 0) + 1
    build = standard_op_nodes if standard_ops else custom_op_nodes
    nodes, dropped, done = [], set(), PackedGraph(0, 0, 0, 0, 0)
    for node in graph.node:
        found = _layer(node, inits, outputs, spec, quantize_as)
        if found is None:
            nodes.append(node)
            continue
        layer, kept = found
        prefix = node.name.rsplit("/", 1)[0] if "/" in node.name else node.name
        new_nodes, new_inits = build(layer, node.input[0], node.output[0], prefix.strip("/").replace("/", "."))
        nodes.extend(new_nodes)
        graph.initializer.extend(new_inits)
        if users[node.input[1]] == 1:
            dropped.add(node.input[1])
        weights = layer.shape[0] * layer.shape[1]
        done = PackedGraph(done.layers + 1, done.kept + kept, done.weights + weights,
                           done.packed_bytes + sum(t.ByteSize() for t in new_inits),
                           done.dense_bytes + 4 * weights)  # the builder's float32 MatMul weights
    if not done.layers:
        raise GmcError(f"no MatMul weight of the ONNX graph has an all-zero {spec} group and none was quantized: "
                       "nothing to lower (are these the artifact's masks?)")
    kept_inits = [t for t in graph.initializer if t.name not in dropped]
    del graph.initializer[:]
    graph.initializer.extend(kept_inits)
    del graph.node[:]
    graph.node.extend(nodes)
    if not standard_ops:
        register_schema()  # onnx.checker and shape inference of this process know the op
        if not any(entry.domain == DOMAIN for entry in model.opset_import):
            model.opset_import.append(onnx.helper.make_opsetid(DOMAIN, VERSION))
    return done


def _layer(node, inits, outputs, spec: GroupSpec, quantize_as: str):
    """``(packed layer, weights it keeps)`` that replace ``node``, or None where it stays."""
    if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or node.input[1] not in inits:
        return None
    tensor = inits[node.input[1]]
    if len(tensor.dims) != 2 or tensor.data_type != onnx.TensorProto.FLOAT:
        return None
    weight = torch.from_numpy(numpy_helper.to_array(tensor).copy()).t()  # [d_out, d_in]
    if node.output[0] in outputs:  # the head
        return None if quantize_as == "none" else (quantize(pack_dense(weight, HEAD_GROUP), "int8"), weight.numel())
    empty, counts = zero_groups(weight, spec)
    if not counts.zero_groups and quantize_as == "none":
        return None
    return quantize(pack(weight, ~empty, spec), quantize_as), counts.params - counts.in_zero_groups
