"""gmc::group_sparse_gated_mlp: the C++ kernel and the torch implementation against the dense masked
MLP (``F.linear`` on ``unpack()``, float64), over each product's path (stream, tiles, gemm), ragged
widths, float, int8 and int4 values, fp32 and bf16 x, 1 and 2 threads; what it does not compile goes to
the torch implementation."""
import pytest
import torch
import torch.nn.functional as F

from gmc.groups import GroupSpec
from gmc.kernels import gated_mlp as op_module
from gmc.kernels.gated_mlp import gated_mlp_torch, group_sparse_gated_mlp
from gmc.kernels.packed import KernelInputs, block_values, concat_outputs, pack, stored_values
from gmc.kernels.quantize import quantize


@pytest.fixture
def torch_calls(count_calls):
    """Counts the calls of the op's torch implementation."""
    return count_calls(op_module, "gated_mlp_torch")


def _layers(d_model, d_ff, group, sparsity, seed, how="none", biases=False):
    """(gate/up fused as fuse_siblings makes it, down) packed, and their dense masked weights."""
    spec = GroupSpec(*map(int, group.split("x")))
    gen = torch.Generator().manual_seed(seed)

    def one(d_out, d_in, bias):
        grid = (-(-d_out // spec.g_out), -(-d_in // spec.g_in))
        keep = torch.rand(grid, generator=gen) >= sparsity
        keep[0, 0] = False  # an empty group in every layer
        layer = pack(torch.randn(d_out, d_in, generator=gen) / d_in ** 0.5, keep, spec,
                     torch.randn(d_out, generator=gen) if bias else None)
        return quantize(layer, how)

    gate, up, down = one(d_ff, d_model, biases), one(d_ff, d_model, biases), one(d_model, d_ff, biases)
    fused = concat_outputs([KernelInputs(p.values, p.row_idx, p.row_ptr, p.shape[0], p.scales, p.bias)
                            for p in (gate, up)], d_model, spec.g_in)
    return fused, down, (gate, up, down)


def _args(x, fused, down, d_ff, g_in):
    dtype = x.dtype
    values = fused.values if fused.scales is not None else fused.values.to(dtype)
    down_values = down.values if down.scales is not None else down.values.to(dtype)
    bias = None if fused.bias is None else fused.bias.to(dtype)
    down_bias = None if down.bias is None else down.bias.to(dtype)
    return (x, values, fused.row_idx, fused.row_ptr, bias, down_values, down.row_idx, down.row_ptr, down_bias, d_ff,
            down.shape[0], g_in, fused.scales, down.scales)


def _reference(x, layers):
    gate, up, down = (layer.unpack().double() for layer in layers)
    b = [None if layer.bias is None else layer.bias.double() for layer in layers]
    x = x.double()
    hidden = F.silu(F.linear(x, gate, b[0])) * F.linear(x, up, b[1])
    return F.linear(hidden, down, b[2])


@pytest.mark.parametrize("tokens", [1, 5, 40])  # stream, register tiles, gemm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("how", ["none", "int8", "int4"])
@pytest.mark.parametrize("d_model,d_ff,group,sparsity,biases", [
    (96, 160, "1x64", 0.5, False),    # ragged both ways: 96 = 64 + 32, 160 = 2 x 64 + 32
    (64, 128, "16x16", 0.3, True),    # 2-D groups, every bias
    (80, 96, "1x32", 0.9, False),     # rows no block keeps
])
def test_kernel_matches_the_dense_masked_mlp(kernel, torch_calls, tokens, dtype, how, d_model, d_ff, group, sparsity,
                                             biases):
    fused, down, layers = _layers(d_model, d_ff, group, sparsity, seed=tokens, how=how, biases=biases)
    g_in = int(group.split("x")[1])
    x = torch.randn(2, tokens, d_model, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = group_sparse_gated_mlp(*_args(x, fused, down, d_ff, g_in))
    assert out.dtype == dtype and out.shape == (2, tokens, d_model) and torch_calls == []
    expected = _reference(x, layers).float()
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    # these quantize x to int8 per 32 numbers (test_cpu_low_precision)
    if how in ("int4", "int8"):
        tolerance = dict(atol=max(0.05 * expected.abs().max().item(), tolerance["atol"]), rtol=0)
    torch.testing.assert_close(out.float(), expected, **tolerance)
    torch.testing.assert_close(gated_mlp_torch(*_args(x, fused, down, d_ff, g_in)).float(), expected, **tolerance)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("how", ["none", "int8", "int4"])
def test_kernel_on_threads_matches_the_dense_masked_mlp(kernel, torch_calls, threads, how):
    """Layers above the kernel's parallel threshold (2^15 kept weights): on two threads each product
    splits the layer's k rows (decode) or output rows between them."""
    fused, down, layers = _layers(256, 576, "1x64", 0.5, seed=3, how=how)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        for tokens in (1, 40):
            x = torch.randn(1, tokens, 256, generator=torch.Generator().manual_seed(tokens))
            out = group_sparse_gated_mlp(*_args(x, fused, down, 576, 64))
            expected = _reference(x, layers).float()
            integer = how in ("int4", "int8")  # x quantized to int8 per 32 numbers
            tolerance = dict(atol=0.05 * expected.abs().max().item(), rtol=0) if integer else dict(atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(out, expected, **tolerance)
    finally:
        torch.set_num_threads(saved)
    assert torch_calls == []


def test_the_activation_is_silu_of_the_first_half_times_the_second(kernel):
    """Gate and up swapped give another result: the op reads [gate | up] in that order."""
    fused, down, (gate, up, _) = _layers(64, 64, "1x32", 0.0, seed=5)
    swapped = concat_outputs([KernelInputs(p.values, p.row_idx, p.row_ptr, p.shape[0], p.scales, p.bias)
                              for p in (up, gate)], 64, 32)
    x = torch.randn(1, 1, 64, generator=torch.Generator().manual_seed(0))
    a = group_sparse_gated_mlp(*_args(x, fused, down, 64, 32))
    b = group_sparse_gated_mlp(*_args(x, swapped, down, 64, 32))
    assert (a - b).abs().max() > 1e-3


@pytest.mark.parametrize("bad", ["float16", "unsorted"])
def test_inputs_the_kernel_does_not_compile_take_the_torch_path(kernel, torch_calls, bad):
    fused, down, layers = _layers(96, 160, "1x64", 0.5, seed=7)
    x = torch.randn(1, 3, 96, generator=torch.Generator().manual_seed(0))
    args = list(_args(x, fused, down, 160, 64))
    if bad == "float16":
        args[0] = x.half()
        args[1], args[5] = args[1].half(), args[5].half()
    else:  # down's rows descending inside its first block: the kernel hands the call back
        start, end = down.row_ptr[0].item(), down.row_ptr[1].item()
        rows = down.row_idx.clone()
        rows[start:end] = rows[start:end].flip(0)
        args[6] = rows
        args[5] = _reversed_columns(down, start, end)
    out = group_sparse_gated_mlp(*args)
    assert torch_calls == [1]
    torch.testing.assert_close(out.float(), _reference(x, layers).float(), atol=2e-2 if bad == "float16" else 1e-5,
                               rtol=2e-2 if bad == "float16" else 1e-5)


def _reversed_columns(layer, start, end):
    """``layer.values`` with the columns of its first block in reverse order (matching flipped rows)."""
    width, g_in = min(layer.spec.g_in, layer.shape[1]), layer.spec.g_in
    values = layer.values.clone()
    block = block_values(values, g_in, start, end - start, width).flip(1)
    values[start * g_in: start * g_in + width * (end - start)] = stored_values(block)
    return values


def test_export_keeps_one_op_node():
    class MLP(torch.nn.Module):
        def __init__(self, args):
            super().__init__()
            self.args = args[1:]

        def forward(self, x):
            return group_sparse_gated_mlp(x, *self.args)

    fused, down, _ = _layers(96, 160, "1x64", 0.5, seed=9)
    x = torch.randn(1, 2, 96)
    program = torch.export.export(MLP(_args(x, fused, down, 160, 64)), (x,))
    targets = [n.target for n in program.graph.nodes if n.op == "call_function"]
    assert targets == [group_sparse_gated_mlp]
    torch.testing.assert_close(program.module()(x), group_sparse_gated_mlp(*_args(x, fused, down, 160, 64)))
