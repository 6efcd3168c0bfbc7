"""bfloat16 and weight-only int8 in the compiled CPU kernel against the dense
reference ``F.linear(x, packed.unpack(), bias)``.

Three kinds of layer: bf16 values with bf16 x, int8 values (``quantize_int8``) with fp32 x, and
int8 values with bf16 x. Each runs through the op with the torch implementation made to fail (so
the compiled kernel is what ran), through every product the kernel can be forced to, and
multithreaded; the quantization itself is bounded by half a scale per weight; the runtime library
of compiled packages runs them too, in a process without gmc.
"""
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from conftest import GROUP_CASES

from gmc.errors import GmcError
from gmc.kernels import cpu_group_sparse
from gmc.kernels import group_sparse_linear as op_module
from gmc.kernels.group_sparse_linear import (
    cpu_backend,
    group_sparse_linear,
    group_sparse_linear_torch,
)
from gmc.kernels.packed import PackedLinear, quantize_int8

KINDS = ["bf16", "int8", "int8-bf16x"]  # (values, x): bf16/bf16, int8/fp32, int8/bf16
PATHS = {"stream": 1, "tiles": 2, "gemm": 3}


@pytest.fixture(scope="module")
def kernel():
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler on this machine: the torch implementation runs")
    if os.environ.get(cpu_group_sparse.ENV_SWITCH, "").lower() == "torch":
        pytest.skip(f"{cpu_group_sparse.ENV_SWITCH}=torch")
    module = cpu_group_sparse.kernel()
    assert module is not None, cpu_backend()
    return module


@pytest.fixture
def compiled_only(kernel, monkeypatch):
    """The op's torch implementation fails if called: what passes ran in C++."""
    def refuse(*args):
        raise AssertionError("the torch implementation ran, not the compiled kernel")

    monkeypatch.setattr(op_module, "group_sparse_linear_torch", refuse)
    assert cpu_backend().startswith("compiled")


def _layer(packed_case, kind, group, shape, sparsity=0.5):
    """``(layer, x dtype)``: the packed case as ``kind``, its bias in x's dtype."""
    packed, _ = packed_case(group, shape, sparsity)
    if kind == "int8":
        return quantize_int8(packed), torch.float32
    bf16 = packed.to(dtype=torch.bfloat16)
    return (bf16 if kind == "bf16" else quantize_int8(bf16)), torch.bfloat16


def _check(out, x, layer, bias):
    """Output dtype is x's; fp32 output equals the dequantized reference tightly, bf16 to its rounding."""
    expected = F.linear(x.float(), layer.unpack().float(), None if bias is None else bias.float())
    scale = expected.abs().max().item() + 1e-6
    assert out.dtype == x.dtype and out.shape == expected.shape
    if x.dtype == torch.float32:
        torch.testing.assert_close(out, expected, atol=1e-5 * scale, rtol=1e-5)
    else:
        torch.testing.assert_close(out.float(), expected, atol=1e-3 * scale, rtol=1e-2)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("group,shape", GROUP_CASES)
@pytest.mark.parametrize("tokens", [1, 3, 5, 40])
@pytest.mark.parametrize("with_bias", [True, False])
def test_op_runs_compiled_and_matches_reference(compiled_only, packed_case, kind, group, shape, tokens, with_bias):
    """Auto choice of product: stream (T <= 4), tiles (5), gemm (40); ragged shapes, empty rows/blocks."""
    layer, dtype = _layer(packed_case, kind, group, shape)
    bias = layer.bias if with_bias else None
    x = torch.randn(tokens, shape[1]).to(dtype)
    out = group_sparse_linear(x, layer.values, layer.row_idx, layer.row_ptr, bias, shape[0], layer.spec.g_in,
                              layer.scales)
    _check(out, x, layer, bias)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("group,shape", GROUP_CASES)
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_forced_products_match_reference(kernel, packed_case, kind, path, group, shape, tokens):
    layer, dtype = _layer(packed_case, kind, group, shape, 0.3)
    x = torch.randn(tokens, shape[1]).to(dtype)
    out = kernel.forward(x, layer.values, layer.row_idx, layer.row_ptr, layer.bias, shape[0], layer.spec.g_in,
                         PATHS[path], layer.scales)
    _check(out, x, layer, layer.bias)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_multithreaded_large_layer(kernel, packed_case, kind, path, tokens):
    """Row ranges split inside blocks, stream chunks past 1024 rows, gemm panels past 256 columns."""
    layer, dtype = _layer(packed_case, kind, "1x64", (2600, 200), 0.2)
    x = torch.randn(tokens, 200).to(dtype)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            out = kernel.forward(x, layer.values, layer.row_idx, layer.row_ptr, layer.bias, 2600, 64, PATHS[path],
                                 layer.scales)
            _check(out, x, layer, layer.bias)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 128])
def test_int8_torch_implementation_matches_reference(packed_case, dtype, tokens):
    """The fallback (float16 x reaches it through the op: C++ hands it back)."""
    packed, _ = packed_case("1x256", (96, 576), 0.5)
    layer = quantize_int8(packed.to(dtype=dtype))
    x = torch.randn(2, tokens, 576).to(dtype)
    args = (layer.values, layer.row_idx, layer.row_ptr, layer.bias, 96, 256, layer.scales)
    expected = F.linear(x.float(), layer.unpack(), layer.bias.float())
    for out in (group_sparse_linear_torch(x, *args), group_sparse_linear(x, *args)):
        assert out.dtype == dtype and out.shape == (2, tokens, 96)
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out.float(), expected, atol=tolerance * expected.abs().max().item(), rtol=tolerance)


@pytest.mark.parametrize("group,shape", GROUP_CASES)
def test_quantize_int8_error_is_at_most_half_a_scale(packed_case, group, shape):
    packed, dense = packed_case(group, shape, 0.5)
    layer = quantize_int8(packed)
    assert layer.values.dtype == torch.int8 and layer.scales.dtype == torch.float32
    assert layer.scales.shape == layer.row_idx.shape and torch.equal(layer.bias, packed.bias)
    # the scale of every kept weight, laid out densely (0 where pruned)
    ones = PackedLinear(torch.ones_like(layer.values), layer.group_idx, layer.group_ptr, layer.shape, layer.spec,
                        scales=layer.scales)
    scale = ones.unpack()  # [d_out, d_in]
    error = (layer.unpack() - dense).abs()
    assert (error <= scale * (0.5 + 1e-5)).all(), (error - scale / 2).max()
    assert int(layer.values.abs().max()) == 127  # each column's largest weight maps to +-127
    assert not layer.unpack()[scale == 0].any()  # pruned weights stay pruned
    assert quantize_int8(layer) is layer


def test_all_zero_column_has_scale_one(packed_case):
    packed, _ = packed_case("1x64", (128, 320), 0.5)
    n0 = int(packed.row_ptr[1])  # kept rows of block 0
    packed.values[: 64 * n0].view(64, n0)[:, 0] = 0
    layer = quantize_int8(packed)
    assert layer.scales[0] == 1 and (layer.values[: 64 * n0].view(64, n0)[:, 0] == 0).all()
    assert layer.scales[1:n0].lt(1).all()  # randn columns: max |w| < 127


def test_int8_layer_is_validated_and_not_cast(packed_case):
    packed, _ = packed_case("1x64", (128, 320), 0.5)
    layer = quantize_int8(packed)
    parts = (layer.values, layer.group_idx, layer.group_ptr, layer.shape, layer.spec, layer.bias)
    with pytest.raises(GmcError, match="need their scales"):
        PackedLinear(*parts)
    with pytest.raises(GmcError, match="fp32 scales of shape"):
        PackedLinear(*parts, layer.scales[:-1])
    with pytest.raises(GmcError, match="fp32 scales of shape"):
        PackedLinear(*parts, layer.scales.double())
    with pytest.raises(GmcError, match="take no scales"):
        PackedLinear(packed.values, *parts[1:], layer.scales)
    with pytest.raises(GmcError, match="quantize_int8"):
        packed.to(dtype=torch.int8)
    with pytest.raises(GmcError, match="unpack"):
        layer.to(dtype=torch.float32)
    moved = layer.to("cpu")
    assert torch.equal(moved.scales, layer.scales) and moved.values.dtype == torch.int8
    index_bytes = 4 * (layer.group_idx.numel() + layer.group_ptr.numel())
    assert layer.nbytes == layer.values.numel() + 4 * layer.scales.numel() + index_bytes


def test_op_contract_errors_name_the_scales(packed_case):
    """What the kernel refuses goes to the torch implementation, which raises the GmcError."""
    packed, _ = packed_case("1x64", (128, 320), 0.5)
    layer = quantize_int8(packed)
    x = torch.randn(2, 320)
    with pytest.raises(GmcError, match="need their scales"):
        group_sparse_linear(x, layer.values, layer.row_idx, layer.row_ptr, None, 128, 64)
    with pytest.raises(GmcError, match="scales go with int8 values"):
        group_sparse_linear(x, packed.values, packed.row_idx, packed.row_ptr, None, 128, 64, layer.scales)
    with pytest.raises(GmcError, match="scales must be float32"):
        group_sparse_linear(x, layer.values, layer.row_idx, layer.row_ptr, None, 128, 64, layer.scales.bfloat16())


def test_schema_scales_is_an_optional_trailing_argument(packed_case):
    last = torch.ops.gmc.group_sparse_linear.default._schema.arguments[-1]
    assert last.name == "scales" and last.default_value is None
    layer = quantize_int8(packed_case("1x256", (96, 576), 0.5)[0])
    x = torch.randn(3, 576)
    out = torch.ops.gmc.group_sparse_linear(x, layer.values, layer.row_idx, layer.row_ptr, layer.bias, 96, 256,
                                            scales=layer.scales)
    _check(out, x, layer, layer.bias)


# The runtime library of compiled packages (GMC_RUNTIME_LIBRARY) in a process that never imports gmc.
_RUNTIME_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    torch.ops.load_library(sys.argv[1])
    cases = torch.load(sys.argv[2])
    outs = [torch.ops.gmc.group_sparse_linear(*args) for args in cases]
    assert not any(name == "gmc" or name.startswith("gmc.") for name in sys.modules)
    torch.save(outs, sys.argv[3])
""")


@pytest.mark.slow
def test_runtime_library_runs_bf16_and_int8(kernel, packed_case, tmp_path):
    from gmc.formats.compiled import SCHEMAS

    library = cpu_group_sparse.build_runtime_library(SCHEMAS)
    cases, expected = [], []
    for kind in KINDS:
        layer, dtype = _layer(packed_case, kind, "1x256", (96, 576))
        x = torch.randn(3, 576).to(dtype)
        args = [x, layer.values, layer.row_idx, layer.row_ptr, layer.bias, 96, 256]
        cases.append(args + ([layer.scales] if layer.scales is not None else []))
        expected.append((x, layer))
    torch.save(cases, tmp_path / "cases.pt")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-c", _RUNTIME_SCRIPT, str(library), str(tmp_path / "cases.pt"),
                             str(tmp_path / "outs.pt")], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    for out, (x, layer) in zip(torch.load(tmp_path / "outs.pt"), expected):
        _check(out, x, layer, layer.bias)
