"""The ONNX forms of one packed layer: the standard-op nodes run in onnxruntime and match the dense
reference; the custom op's schema is known to onnx's checker and shape inference. (The custom op's
native library runs in ``test_ort_ops.py``; whole models in ``tests/lower/test_onnx_backend.py``.)"""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gmc.errors import GmcError
from gmc.kernels.quantize import quantize

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper  # noqa: E402

from gmc.kernels.onnx_group_sparse import (  # noqa: E402
    DOMAIN,
    custom_op_nodes,
    register_schema,
    standard_op_nodes,
)


def _one_layer_model(nodes, inits, d_in: int, d_out: int, custom: bool = False) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "layer", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", d_in])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "s", d_out])], inits)
    opsets = [helper.make_opsetid("", 18)] + ([helper.make_opsetid(DOMAIN, 1)] if custom else [])
    return helper.make_model(graph, opset_imports=opsets)


@pytest.mark.parametrize("group,shape,bias", [("1x256", (96, 576), True), ("32x32", (100, 70), False),
                                              ("1x64", (128, 320), True)])
def test_standard_op_nodes_match_the_dense_reference(packed_case, group, shape, bias):
    """Ragged last block and output group, an empty input block and an empty output group (conftest)."""
    packed, dense = packed_case(group, shape, 0.5)
    if not bias:
        packed.bias = None
    nodes, inits = standard_op_nodes(packed, "x", "y", "layer")
    model = _one_layer_model(nodes, inits, shape[1], shape[0])
    onnx.checker.check_model(model, full_check=True)
    assert {n.op_type for n in nodes} >= {"Slice", "MatMul", "ScatterElements"}
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for x in (torch.randn(1, 1, shape[1]), torch.randn(2, 9, shape[1])):
        (got,) = session.run(None, {"x": x.numpy()})
        np.testing.assert_allclose(got, F.linear(x, dense, packed.bias).numpy(), atol=1e-4, rtol=1e-4)


def test_a_layer_that_keeps_nothing_is_its_bias(packed_case):
    packed, _ = packed_case("1x64", (32, 128), 1.0)
    nodes, inits = standard_op_nodes(packed, "x", "y", "layer")
    session = ort.InferenceSession(_one_layer_model(nodes, inits, 128, 32).SerializeToString())
    (got,) = session.run(None, {"x": np.ones((1, 2, 128), np.float32)})
    np.testing.assert_allclose(got, np.broadcast_to(packed.bias.numpy(), (1, 2, 32)))


def test_standard_ops_refuse_quantized_values(packed_case):
    packed, _ = packed_case("1x64", (64, 128), 0.5)
    with pytest.raises(GmcError, match="standard ONNX ops run float values only, not int4"):
        standard_op_nodes(quantize(packed, "int4"), "x", "y", "layer")


@pytest.mark.parametrize("how", ["none", "int8", "int4"])
def test_custom_op_node_passes_the_checker_and_shape_inference(packed_case, how):
    register_schema()
    packed, _ = packed_case("1x64", (96, 320), 0.5)
    packed = quantize(packed, how)
    nodes, inits = custom_op_nodes(packed, "x", "y", "layer")
    (node,) = nodes
    assert (node.domain, node.op_type) == ("gmc", "GroupSparseLinear")
    assert len(node.input) == (5 if how == "none" else 6)  # bias, then scales (int8 / int4 only)
    types = {t.name.rsplit(".", 1)[1]: t.data_type for t in inits}
    assert types["row_idx"] == types["row_ptr"] == TensorProto.INT32
    assert types["values"] == {"none": TensorProto.FLOAT, "int8": TensorProto.INT8, "int4": TensorProto.UINT8}[how]
    model = _one_layer_model(nodes, inits, 320, 96, custom=True)
    onnx.checker.check_model(model, full_check=True)
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    assert inferred.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT
