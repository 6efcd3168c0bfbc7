"""ONNX exports of a tiny lowered Llama (custom op and standard ops) run in onnxruntime and match."""
import numpy as np
import pytest
import torch

from gmc.groups import GroupSpec
from gmc.kernels.group_sparse_linear import group_sparse_linear_reference
from gmc.kernels.onnx_group_sparse import export_onnx, group_sparse_linear_numpy, onnxruntime_session
from gmc.lowered import pack_model, swap_group_sparse_linears

from .test_lowered_model import folded, random_masks, tiny_llama

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def lowered_tiny():
    spec = GroupSpec(1, 32)
    model = tiny_llama()
    masks = random_masks(model, spec)
    dense = folded(model, masks, spec)
    return swap_group_sparse_linears(model, pack_model(model, masks, spec)), dense


@pytest.mark.parametrize(
    "standard_ops", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["custom-op", "standard-ops"]
)
def test_onnx_export_runs_in_onnxruntime_and_matches(lowered_tiny, tmp_path, standard_ops):
    model, dense = lowered_tiny
    path = export_onnx(model, tmp_path / "tiny.onnx", standard_ops=standard_ops)
    graph = onnx.load(str(path)).graph
    custom = [n for n in graph.node if n.domain == "gmc" and n.op_type == "GroupSparseLinear"]
    assert len(custom) == (0 if standard_ops else 14)
    if standard_ops:
        assert {n.domain for n in graph.node} <= {"", "ai.onnx"}
        assert sum(n.op_type == "ScatterElements" for n in graph.node) == 14
    session = onnxruntime_session(path)
    ids = torch.randint(0, 256, (3, 7))  # batch and length differ from the export example
    got = session.run(None, {"input_ids": ids.numpy()})[0]
    with torch.no_grad():
        expected = dense(ids).logits.numpy()
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-4)


def test_numpy_implementation_matches_reference(packed_case):
    packed, _ = packed_case("1x256", (96, 576), 0.5)
    x = torch.randn(2, 3, 576)
    args = (packed.values, packed.row_idx.int(), packed.row_ptr, packed.bias, 96, 256)
    got = group_sparse_linear_numpy(x.numpy(), *(a.numpy() if torch.is_tensor(a) else a for a in args))
    np.testing.assert_allclose(got, group_sparse_linear_reference(x, *args).numpy(), atol=1e-4, rtol=1e-4)
