"""The ONNX translation of ``gmc::group_sparse_linear`` and its onnxruntime implementation.

``gmc.formats.onnx.export_onnx`` exports a lowered program (one op node per target) with
``torch.onnx.export(dynamo=True)``, and the exporter translates each op node with one of two
onnxscript functions, chosen at export time through ``custom_translation_table``:

- custom op (default, ``custom_op_node``): one ``gmc::GroupSparseLinear`` node per target (domain
  ``gmc``, version 1) with inputs ``(x, values, row_idx int32, row_ptr, bias)`` and attributes
  ``d_out``, ``g_in``; the packed tensors are initializers. ``register_onnxruntime_op`` defines its
  onnxruntime implementation as an onnxruntime-extensions Python op (float32) that calls the op
  itself, so ``onnxruntime_session`` runs the file in the process that registered it.
- standard ops (``standard_ops=True``, ``standard_ops_nodes``): the same algorithm written with
  standard ONNX ops that any runtime loads: per input block a ``Slice`` of ``x`` and a ``MatMul``
  with that block's packed ``[w_v, R_v]`` values, a ``Concat`` of the block outputs ``[..., R]``
  and one ``ScatterElements(reduction="add")`` into ``[..., d_out]``; still only kept weights are
  stored. The block widths are static (``d_in``, ``g_in``); where each block starts in ``values``
  is read from ``row_ptr`` in the graph, so one translation serves every layer, and the exporter's
  optimizer folds those offsets and slices into one initializer per block (``row_ptr`` and
  ``values`` are initializers).

Weight-only int8 layers (the op's ``scales``) are not translated: export a float lowered model.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np
import onnxscript
import torch
from onnx.defs import OpSchema
from onnxscript import opset18 as op

from gmc.errors import GmcError
from gmc.kernels.gated_mlp import group_sparse_gated_mlp
from gmc.kernels.group_sparse_linear import group_sparse_linear

ONNX_OP = "gmc::GroupSparseLinear"
_INT32, _INT64 = 6, 7  # onnx.TensorProto data types
_P = OpSchema.FormalParameter
_SCHEMA = OpSchema(
    "GroupSparseLinear", "gmc", 1,
    doc="y [..., d_out] = x [..., d_in] @ W.T + bias, W in gmc's packed BSC format (gmc/kernels/packed.py)",
    inputs=[_P("x", "T"), _P("values", "T"), _P("row_idx", "tensor(int32)"), _P("row_ptr", "tensor(int32)"),
            _P("bias", "T")],
    outputs=[_P("y", "T")],
    type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "the onnxruntime op runs float")],
    attributes=[OpSchema.Attribute("d_out", OpSchema.AttrType.INT, "output features"),
                OpSchema.Attribute("g_in", OpSchema.AttrType.INT, "input columns per group")],
)
_GROUP_SPARSE_LINEAR = onnxscript.values.Op(onnxscript.values.Opset("gmc", 1), "GroupSparseLinear", _SCHEMA)


def _ints(*values: int):
    return op.Constant(value_ints=list(values))


QUANTIZED_REFUSED = ("ONNX export of int8 or int4 packed layers (group_sparse_linear with scales) is not supported: "
                "export the float lowered model")


def _refuse_scales(scales) -> None:
    if scales is not None:
        raise GmcError(QUANTIZED_REFUSED)


def custom_op_node(x, values, row_idx, row_ptr, bias, d_out: int, g_in: int, scales=None, d_in=None):
    """The op as one ``gmc::GroupSparseLinear`` node (``bias`` zeros when the op has none; ``d_in``
    as ``standard_ops_nodes`` takes it, unused: the node reads ``x``'s width itself)."""
    _refuse_scales(scales)
    if bias is None:
        bias = op.CastLike(op.ConstantOfShape(_ints(d_out)), x)  # [d_out]
    return _GROUP_SPARSE_LINEAR(x, values, op.Cast(row_idx, to=_INT32), row_ptr, bias, d_out=d_out, g_in=g_in)


def standard_ops_nodes(x, values, row_idx, row_ptr, bias, d_out: int, g_in: int, scales=None, d_in=None):
    """The op in standard ONNX ops: per block ``x[..., cols_v] @ values_v``, then one scatter-add
    (``d_in``: ``x``'s width where the exporter does not know it, inside a translation)."""
    _refuse_scales(scales)
    d_in = x.shape[-1] if d_in is None else d_in
    starts = op.Mul(op.Cast(row_ptr, to=_INT64), _ints(g_in))  # [G_in + 1] offset of each block in values
    products = []
    for v, col in enumerate(range(0, d_in, g_in)):
        width = min(g_in, d_in - col)
        block = op.Slice(values, op.Slice(starts, _ints(v), _ints(v + 1)), op.Slice(starts, _ints(v + 1), _ints(v + 2)))
        x_v = op.Slice(x, _ints(col), _ints(col + width), _ints(-1))  # [..., w_v]
        products.append(op.MatMul(x_v, op.Reshape(block, _ints(width, -1))))  # [..., R_v]
    lead = op.Shape(x, end=-1)  # [...]
    out_shape = op.Concat(lead, _ints(d_out), axis=0)
    out = op.CastLike(op.ConstantOfShape(out_shape) if bias is None else op.Expand(bias, out_shape), x)  # [..., d_out]
    index = op.Expand(row_idx, op.Concat(lead, op.Shape(row_idx), axis=0))  # [..., R]
    return op.ScatterElements(out, index, op.Concat(*products, axis=-1), axis=-1, reduction="add")


def gated_mlp_nodes(linear):
    """``gmc::group_sparse_gated_mlp`` as its two products, each translated by ``linear``, and
    ``silu(gate) * up`` between them (the op's torch implementation, ``gated_mlp_torch``)."""
    def translation(x, values, row_idx, row_ptr, bias, down_values, down_row_idx, down_row_ptr, down_bias,
                    d_ff: int, d_out: int, g_in: int, scales=None, down_scales=None):
        h = linear(x, values, row_idx, row_ptr, bias, 2 * d_ff, g_in, scales)  # [..., 2 d_ff]: gate | up
        gate = op.Slice(h, _ints(0), _ints(d_ff), _ints(-1))
        up = op.Slice(h, _ints(d_ff), _ints(2 * d_ff), _ints(-1))
        hidden = op.Mul(op.Mul(gate, op.Sigmoid(gate)), up)  # [..., d_ff]
        return linear(hidden, down_values, down_row_idx, down_row_ptr, down_bias, d_out, g_in, down_scales, d_ff)
    return translation


def translation_table(standard_ops: bool = False) -> dict:
    """``custom_translation_table`` for ``torch.onnx.export(dynamo=True)`` of a lowered program."""
    linear = standard_ops_nodes if standard_ops else custom_op_node
    return {group_sparse_linear: linear, group_sparse_gated_mlp: gated_mlp_nodes(linear)}


@functools.cache
def register_onnxruntime_op() -> str:
    """Define the onnxruntime-extensions op once; return the custom-op library path."""
    try:
        from onnxruntime_extensions import PyCustomOpDef, get_library_path, onnx_op
    except ImportError as error:
        raise GmcError("running gmc::GroupSparseLinear needs onnxruntime-extensions: "
                       "pip install onnxruntime-extensions (or export with --onnx-standard-ops)") from error

    @onnx_op(
        op_type=ONNX_OP,
        inputs=[PyCustomOpDef.dt_float, PyCustomOpDef.dt_float, PyCustomOpDef.dt_int32,
                PyCustomOpDef.dt_int32, PyCustomOpDef.dt_float],
        outputs=[PyCustomOpDef.dt_float],
        attrs={"d_out": PyCustomOpDef.dt_int64, "g_in": PyCustomOpDef.dt_int64},
    )
    def _group_sparse_linear(x, values, row_idx, row_ptr, bias, d_out, g_in):
        return onnxruntime_group_sparse_linear(x, values, row_idx, row_ptr, bias, d_out, g_in)

    return get_library_path()


def onnxruntime_group_sparse_linear(x, values, row_idx, row_ptr, bias, d_out: int, g_in: int) -> np.ndarray:
    """The onnxruntime op on numpy arrays: the torch op on the same memory (``np.require`` copies
    only an array torch cannot wrap; the op writes none of its inputs)."""
    tensors = [torch.from_numpy(np.require(a, requirements=("C", "W"))) for a in (x, values, row_idx, row_ptr, bias)]
    return group_sparse_linear(*tensors, int(d_out), int(g_in)).numpy()


def onnxruntime_session(path: str | os.PathLike):
    """An ``InferenceSession`` for a gmc ONNX file: custom op registered, CUDA used if present."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.register_custom_ops_library(register_onnxruntime_op())
    available = ort.get_available_providers()
    providers = [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in available]
    return ort.InferenceSession(str(Path(path)), options, providers=providers)
