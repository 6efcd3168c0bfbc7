"""Triton kernels vs the dense masked reference, run by the interpreter (conftest sets it)."""
import pytest
import torch
import torch.nn.functional as F
from conftest import GROUP_CASES

from gmc.errors import GmcError

triton_group_sparse = pytest.importorskip("gmc.kernels.triton_group_sparse")


def _call(x, packed):
    return triton_group_sparse.triton_group_sparse_linear(
        x, packed.values, packed.row_idx, packed.row_ptr, packed.bias, packed.shape[0], packed.spec.g_in
    )


@pytest.mark.parametrize("group,shape", GROUP_CASES)
@pytest.mark.parametrize("tokens", [1, 7, 128])
@pytest.mark.parametrize("sparsity", [0.3, 0.5, 0.9])
def test_triton_matches_dense_masked_reference_fp32(packed_case, group, shape, tokens, sparsity):
    packed, dense = packed_case(group, shape, sparsity)
    x = torch.randn(tokens, shape[1])
    torch.testing.assert_close(_call(x, packed), F.linear(x, dense, packed.bias), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group,shape", [("1x256", (96, 576)), ("32x32", (100, 70)), ("16x16", (80, 96))])
@pytest.mark.parametrize("tokens", [1, 7, 128])
def test_triton_half_precision(packed_case, dtype, group, shape, tokens):
    packed, dense = packed_case(group, shape, 0.5, dtype=dtype)
    x = torch.randn(tokens, shape[1]).to(dtype)
    out = _call(x, packed)
    expected = F.linear(x.float(), dense, packed.bias.float())
    assert out.dtype == dtype
    scale = expected.abs().max().item()
    torch.testing.assert_close(out.float(), expected, atol=2e-2 * scale, rtol=2e-2)


def test_triton_strided_input(packed_case):
    packed, dense = packed_case("1x64", (128, 320), 0.5)
    x = torch.randn(320, 20).t()  # [20, 320], non-contiguous
    torch.testing.assert_close(_call(x, packed), F.linear(x, dense, packed.bias), atol=1e-4, rtol=1e-4)


def test_triton_rejects_integer_input(packed_case):
    packed, _ = packed_case("1x64", (128, 320), 0.5)
    with pytest.raises(GmcError):
        _call(torch.ones(2, 320, dtype=torch.int32), packed)


def test_triton_refuses_int8_values(packed_case):
    from gmc.kernels.packed import quantize_int8

    layer = quantize_int8(packed_case("1x64", (128, 320), 0.5)[0])
    with pytest.raises(GmcError, match="int8 packed values are CPU-only"):
        triton_group_sparse.triton_group_sparse_linear(torch.randn(2, 320), layer.values, layer.row_idx, layer.row_ptr,
                                                       layer.bias, 128, 64, layer.scales)
