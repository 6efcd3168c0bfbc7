"""ONNX exports of the op (custom op and standard ops) run in onnxruntime and match the dense reference."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import masked_copy, random_masks, tiny_model

from gmc.errors import GmcError
from gmc.graph.pipeline import LowerOptions, lower
from gmc.graph.trace import export_logits
from gmc.groups import GroupSpec

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
from gmc.formats.onnx import export_onnx  # noqa: E402  (needs onnx)
from gmc.kernels.onnx_group_sparse import (  # noqa: E402
    custom_op_node,
    onnxruntime_group_sparse_linear,
    onnxruntime_session,
    standard_ops_nodes,
    translation_table,
)

MODES = ["custom-op", "standard-ops"]


@pytest.fixture(scope="module")
def lowered_tiny():
    spec = GroupSpec(1, 32)
    model = tiny_model("llama", intermediate_size=128, vocab_size=256)
    masks = random_masks(model, spec)
    dense = masked_copy(model, masks, spec)
    gm, _ = lower(model, masks, spec)
    return export_logits(gm, 256), dense


def _check_graph(path, mode, n_ops):
    graph = onnx.load(str(path)).graph
    custom = [n for n in graph.node if n.domain == "gmc" and n.op_type == "GroupSparseLinear"]
    assert len(custom) == (n_ops if mode == "custom-op" else 0)
    if mode == "standard-ops":
        assert {n.domain for n in graph.node} <= {"", "ai.onnx"}
        assert sum(n.op_type == "ScatterElements" for n in graph.node) == n_ops


@pytest.mark.parametrize("mode", [MODES[0], pytest.param(MODES[1], marks=pytest.mark.slow)])
def test_onnx_export_runs_in_onnxruntime_and_matches(lowered_tiny, tmp_path, mode):
    program, dense = lowered_tiny
    path = export_onnx(program, tmp_path / "tiny.onnx", standard_ops=mode == "standard-ops")
    _check_graph(path, mode, 9)  # per layer: q/k/v fused, o, the gated MLP's two products; the head
    session = onnxruntime_session(path)
    ids = torch.randint(0, 256, (3, 7))  # batch and length differ from the export example
    got = session.run(None, {"input_ids": ids.numpy()})[0]
    with torch.no_grad():
        expected = dense(ids).logits.numpy()
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-4)


class _OneOp(torch.nn.Module):
    def __init__(self, packed, bias: bool):
        super().__init__()
        self.register_buffer("values", packed.values)
        self.register_buffer("row_idx", packed.row_idx)
        self.register_buffer("row_ptr", packed.row_ptr)
        self.register_buffer("bias", packed.bias if bias else None)
        self.d_out, self.g_in = packed.shape[0], packed.spec.g_in

    def forward(self, x):
        return torch.ops.gmc.group_sparse_linear(x, self.values, self.row_idx, self.row_ptr, self.bias,
                                                 self.d_out, self.g_in)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("group,shape,bias", [("1x256", (96, 576), True), ("32x32", (100, 70), False)])
def test_op_translations_ragged_shapes_and_empty_blocks(packed_case, tmp_path, mode, group, shape, bias):
    """Ragged last block and output group, an empty input block and an empty output group (conftest)."""
    packed, dense = packed_case(group, shape, 0.5)
    seq = torch.export.Dim("seq", min=2, max=64)
    program = torch.onnx.export(_OneOp(packed, bias).eval(), (torch.randn(1, 4, shape[1]),), dynamo=True,
                                dynamic_shapes=({1: seq},),
                                custom_translation_table=translation_table(mode == "standard-ops"))
    program.save(tmp_path / "op.onnx")
    _check_graph(tmp_path / "op.onnx", mode, 1)
    x = torch.randn(1, 9, shape[1])
    (got,) = onnxruntime_session(tmp_path / "op.onnx").run(None, {program.model.graph.inputs[0].name: x.numpy()})
    expected = F.linear(x, dense, packed.bias if bias else None)
    np.testing.assert_allclose(got, expected.numpy(), atol=1e-4, rtol=1e-4)


def test_onnxruntime_implementation_matches_reference(packed_case):
    packed, dense = packed_case("1x256", (96, 576), 0.5)
    x = torch.randn(2, 3, 576)
    args = (packed.values, packed.row_idx.int(), packed.row_ptr, packed.bias)
    got = onnxruntime_group_sparse_linear(x.numpy(), *(a.numpy() for a in args), np.int64(96), np.int64(256))
    np.testing.assert_allclose(got, F.linear(x, dense, packed.bias).numpy(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("how", ["int8", "int4"])
def test_quantized_layers_are_refused_clearly(tmp_path, how):
    spec = GroupSpec(1, 32)
    model = tiny_model("llama", intermediate_size=128, vocab_size=256)
    gm, _ = lower(model, random_masks(model, spec), spec, options=LowerOptions(quantize=how))
    with pytest.raises(GmcError, match="int8 or int4 packed layers"):
        export_onnx(export_logits(gm, 256), tmp_path / "int8.onnx")
    assert not (tmp_path / "int8.onnx").exists()
    for translation in (custom_op_node, standard_ops_nodes):  # direct torch.onnx.export users
        with pytest.raises(GmcError, match="int8 or int4 packed layers"):
            translation(None, None, None, None, None, 96, 32, scales=object())
