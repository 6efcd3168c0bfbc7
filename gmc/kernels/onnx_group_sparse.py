"""``gmc.GroupSparseLinear`` in ONNX: the op's schema and the nodes a packed layer becomes.

Two forms of one packed layer (``gmc.kernels.packed.PackedLinear``) inside an ONNX graph:

- the custom op (``custom_op_nodes``): one ``GroupSparseLinear`` node of domain ``gmc`` (version 2),
  run by gmc's native ONNX Runtime library (``gmc.kernels.ort_ops``, the same C++ core as the torch
  op). Inputs ``(x, values, row_idx int32, row_ptr int32, bias?, scales?)``, attributes ``d_out`` and
  ``g_in``; values are float32, int8 (``scales``: float32 per packed column) or int4 (uint8, two
  codes a byte; ``scales``: the float16 scale and offset per 32 k rows of ``gmc.kernels.packed``).
  ``register_schema`` tells ``onnx.checker`` and shape inference about it.
- standard ops (``standard_op_nodes``, float values only): per input block a ``Slice`` of ``x`` and a
  ``MatMul`` with that block's ``[w_v, R_v]`` values, a ``Concat`` of the block products ``[..., R]``
  and one ``ScatterElements(reduction="add")`` into ``[..., d_out]``: still only the kept weights are
  stored, and any ONNX runtime (onnxruntime-gpu included) opens it.

Each function returns the nodes and the initializers (named after ``prefix``) that compute ``y``
from ``x``; ``gmc.lower.onnx_pack`` puts them in place of a ``MatMul``.
"""
from __future__ import annotations

import functools

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from onnx.defs import OpSchema

from gmc.errors import GmcError
from gmc.kernels.packed import PackedLinear, block_widths

# Version 2: int8 values in words of 4 (gmc.kernels.packed); the runtime library runs no version-1 node,
# whose int8 values were row-major.
DOMAIN, OP_TYPE, VERSION = "gmc", "GroupSparseLinear", 2
_P = OpSchema.FormalParameter
_OPTIONAL = OpSchema.FormalParameterOption.Optional
SCHEMA = OpSchema(
    OP_TYPE, DOMAIN, VERSION,
    doc="y [..., d_out] = x [..., d_in] @ W.T + bias with W in gmc's packed block-sparse-column format "
        "(gmc/kernels/packed.py): float32, int8 (scales float32 [R]) or int4 (uint8, scales float16) values",
    inputs=[_P("x", "T"), _P("values", "V"), _P("row_idx", "tensor(int32)"), _P("row_ptr", "tensor(int32)"),
            _P("bias", "T", param_option=_OPTIONAL), _P("scales", "S", param_option=_OPTIONAL)],
    outputs=[_P("y", "T")],
    type_constraints=[("T", ["tensor(float)"], "activations"),
                      ("V", ["tensor(float)", "tensor(int8)", "tensor(uint8)"], "kept values: float, int8 or int4"),
                      ("S", ["tensor(float)", "tensor(float16)"], "int8 column scales or int4 scales and offsets")],
    attributes=[OpSchema.Attribute("d_out", OpSchema.AttrType.INT, "output features"),
                OpSchema.Attribute("g_in", OpSchema.AttrType.INT, "input columns per group")],
)


@functools.cache
def register_schema() -> None:
    """Make ``gmc.GroupSparseLinear`` known to ``onnx.checker`` and shape inference (once a process).

    Shape inference of a custom domain needs a function; the op's output shape is ``x``'s with its
    last axis ``d_out``, which ``custom_op_nodes`` also writes as the node's value info."""
    if not onnx.defs.has(OP_TYPE, DOMAIN):
        onnx.defs.register_schema(SCHEMA)


def _initializer(array: np.ndarray, name: str) -> TensorProto:
    return numpy_helper.from_array(np.ascontiguousarray(array), name)


def custom_op_nodes(layer: PackedLinear, x: str, y: str, prefix: str) -> tuple[list, list]:
    """``layer`` as one ``gmc.GroupSparseLinear`` node ``x -> y`` and its packed initializers."""
    inits = [_initializer(layer.values.cpu().numpy(), f"{prefix}.values"),
             _initializer(layer.row_idx.cpu().numpy().astype(np.int32), f"{prefix}.row_idx"),
             _initializer(layer.row_ptr.cpu().numpy().astype(np.int32), f"{prefix}.row_ptr")]
    inputs = [x, *(t.name for t in inits), "", ""]
    if layer.bias is not None:
        inits.append(_initializer(layer.bias.detach().float().cpu().numpy(), f"{prefix}.bias"))
        inputs[4] = inits[-1].name
    if layer.scales is not None:
        inits.append(_initializer(layer.scales.cpu().numpy(), f"{prefix}.scales"))
        inputs[5] = inits[-1].name
    while inputs[-1] == "":
        inputs.pop()
    node = helper.make_node(OP_TYPE, inputs, [y], name=f"{prefix}/GroupSparseLinear", domain=DOMAIN,
                            d_out=layer.shape[0], g_in=layer.spec.g_in)
    return [node], inits


def standard_op_nodes(layer: PackedLinear, x: str, y: str, prefix: str) -> tuple[list, list]:
    """``layer`` (float values) in standard ONNX ops ``x -> y``: per block ``x[..., cols_v] @
    values_v``, then one scatter-add of the ``[..., R]`` products into ``[..., d_out]``."""
    if layer.scales is not None:
        raise GmcError(f"{layer.label}: standard ONNX ops run float values only, not {layer.quantized}; "
                       "use the gmc.GroupSparseLinear op (drop --onnx-standard-ops) or --quantize none")
    d_out, g_in = layer.shape[0], layer.spec.g_in
    values = layer.values.detach().float().cpu().numpy()
    ptr = layer.row_ptr.tolist()
    nodes, inits, products = [], [], []

    def const(array, name):
        inits.append(_initializer(np.asarray(array), f"{prefix}.{name}"))
        return inits[-1].name

    minus_one = const(np.array([-1], np.int64), "axis")
    for v, width in enumerate(block_widths(layer.spec, layer.shape).tolist()):
        n_rows = ptr[v + 1] - ptr[v]
        if n_rows == 0:
            continue
        col = v * g_in
        start = ptr[v] * g_in
        block = values[start:start + width * n_rows].reshape(width, n_rows)  # [w_v, R_v]
        x_v, p_v = f"{prefix}/x{v}", f"{prefix}/p{v}"
        nodes.append(helper.make_node("Slice", [x, const(np.array([col], np.int64), f"start{v}"),
                                                const(np.array([col + width], np.int64), f"end{v}"), minus_one],
                                      [x_v], name=f"{prefix}/Slice{v}"))
        nodes.append(helper.make_node("MatMul", [x_v, const(block, f"values{v}")], [p_v], name=f"{prefix}/MatMul{v}"))
        products.append(p_v)
    lead, out_shape, index_shape = f"{prefix}/lead", f"{prefix}/out_shape", f"{prefix}/index_shape"
    nodes.append(helper.make_node("Shape", [x], [lead], name=f"{prefix}/Shape", end=-1))  # [...]
    nodes.append(helper.make_node("Concat", [lead, const(np.array([d_out], np.int64), "d_out")], [out_shape],
                                  name=f"{prefix}/OutShape", axis=0))
    base = f"{prefix}/base"
    if layer.bias is not None:
        nodes.append(helper.make_node("Expand", [const(layer.bias.detach().float().cpu().numpy(), "bias"), out_shape],
                                      [base], name=f"{prefix}/Bias"))
    else:
        nodes.append(helper.make_node("ConstantOfShape", [out_shape], [base], name=f"{prefix}/Zeros",
                                      value=helper.make_tensor("zero", TensorProto.FLOAT, [1], [0.0])))
    if not products:  # nothing kept: y is the bias (or zeros)
        nodes.append(helper.make_node("Identity", [base], [y], name=f"{prefix}/Identity"))
        return nodes, inits
    kept_rows = np.asarray(layer.row_idx.cpu().numpy(), np.int64)  # [R] block after block, as the products
    updates, index = f"{prefix}/updates", f"{prefix}/index"
    nodes.append(helper.make_node("Concat", products, [updates], name=f"{prefix}/Concat", axis=-1))
    nodes.append(helper.make_node("Concat", [lead, const(np.array([kept_rows.size], np.int64), "R")], [index_shape],
                                  name=f"{prefix}/IndexShape", axis=0))
    nodes.append(helper.make_node("Expand", [const(kept_rows, "row_idx"), index_shape], [index],
                                  name=f"{prefix}/Index"))
    nodes.append(helper.make_node("ScatterElements", [base, index, updates], [y], name=f"{prefix}/ScatterAdd",
                                  axis=-1, reduction="add"))
    return nodes, inits
