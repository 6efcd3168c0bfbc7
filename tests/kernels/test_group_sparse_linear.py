import pytest
import torch
import torch.nn.functional as F
from conftest import GROUP_CASES

from gmc.errors import GmcError
from gmc.kernels.group_sparse_linear import (
    group_sparse_linear,
    group_sparse_linear_torch,
)


def _call(op, x, packed):
    return op(x, packed.values, packed.row_idx, packed.row_ptr, packed.bias, packed.shape[0], packed.spec.g_in)


@pytest.mark.parametrize("group,shape", GROUP_CASES)
@pytest.mark.parametrize("tokens", [1, 7, 128])
@pytest.mark.parametrize("sparsity", [0.3, 0.5, 0.9])
def test_cpu_op_matches_dense_masked_reference_fp32(packed_case, group, shape, tokens, sparsity):
    packed, dense = packed_case(group, shape, sparsity)
    x = torch.randn(tokens, shape[1])
    expected = F.linear(x, dense, packed.bias)
    torch.testing.assert_close(_call(group_sparse_linear, x, packed), expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(_call(group_sparse_linear_torch, x, packed), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 128])
def test_cpu_op_half_precision(packed_case, dtype, tokens):
    """bfloat16 runs compiled (fp32 accumulation: test_cpu_bf16_int8.py); float16 goes to the
    torch implementation."""
    packed, dense = packed_case("1x256", (96, 576), 0.5, dtype=dtype)
    x = torch.randn(tokens, 576).to(dtype)
    out = _call(group_sparse_linear, x, packed)
    expected = F.linear(x.float(), dense, packed.bias.float())
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, atol=5e-2 * expected.abs().max().item(), rtol=2e-2)
    if dtype == torch.float16:
        torch.testing.assert_close(out, _call(group_sparse_linear_torch, x, packed))


def test_cpu_op_keeps_leading_dims_and_no_bias(packed_case):
    packed, dense = packed_case("32x32", (100, 70), 0.5)
    x = torch.randn(2, 3, 70)
    out = group_sparse_linear(x, packed.values, packed.row_idx, packed.row_ptr, None, 100, 32)
    assert out.shape == (2, 3, 100)
    torch.testing.assert_close(out, F.linear(x, dense), atol=1e-4, rtol=1e-4)


def test_all_pruned_layer_gives_bias(packed_case):
    packed, _ = packed_case("1x64", (16, 128), 1.0)
    assert packed.values.numel() == 0
    out = _call(group_sparse_linear, torch.randn(3, 128), packed)
    torch.testing.assert_close(out, packed.bias.expand(3, 16))


def test_op_is_one_node_in_torch_export(packed_case):
    packed, dense = packed_case("1x64", (128, 320), 0.5)

    class Tiny(torch.nn.Module):
        def forward(self, x):
            return torch.ops.gmc.group_sparse_linear(
                x, packed.values, packed.row_idx, packed.row_ptr, packed.bias, 128, 64
            )

    seq = torch.export.Dim("seq", min=2, max=512)
    program = torch.export.export(Tiny(), (torch.randn(5, 320),), dynamic_shapes=({0: seq},))
    ops = [n.target for n in program.graph.nodes if n.op == "call_function"]
    assert ops == [torch.ops.gmc.group_sparse_linear.default]
    x = torch.randn(9, 320)
    torch.testing.assert_close(program.module()(x), F.linear(x, dense, packed.bias), atol=1e-4, rtol=1e-4)


def test_dtype_mismatch_is_a_gmc_error(packed_case):
    packed, _ = packed_case("1x64", (128, 320), 0.5)
    with pytest.raises(GmcError, match="float64"):
        _call(group_sparse_linear, torch.randn(2, 320, dtype=torch.float64), packed)


@pytest.mark.parametrize("how", ["none", "int8", "int4"])
def test_module_in_the_cuda_layout_saves_and_loads_the_packed_one(packed_case, how):
    """A ``GroupSparseLinear`` holds the tiled layout where its buffers are CUDA's (forced here on the CPU,
    where the op runs that layout through its torch implementation): the same outputs, a state dict in
    the packed layout (what a checkpoint stores from any device), and a packed state loaded into it."""
    from gmc.kernels.linear import GroupSparseLinear
    from gmc.kernels.quantize import quantize

    packed, _ = packed_case("1x64", (128, 320), 0.5)
    layer = quantize(packed, how)
    module, tiled = GroupSparseLinear(layer), GroupSparseLinear(layer)
    tiled._hold(layer, tiled=True)
    assert tiled.tiled and not module.tiled and tiled.row_idx.dim() == 2
    x = torch.randn(5, 320)
    torch.testing.assert_close(tiled(x), F.linear(x, layer.unpack().float(), layer.bias), atol=1e-5, rtol=1e-5)
    state = tiled.state_dict()
    assert set(state) == set(module.state_dict())
    for key, value in module.state_dict().items():
        assert torch.equal(state[key], value), key
    back = tiled.packed()
    assert torch.equal(back.values, layer.values) and torch.equal(back.row_idx, layer.row_idx)
    other = GroupSparseLinear(layer)
    other._hold(layer, tiled=True)
    other.values.zero_()
    other.load_state_dict(state)  # packed numbers into a tiled module: loaded, then tiled again
    assert other.tiled
    torch.testing.assert_close(other(x), tiled(x))


@pytest.mark.parametrize("how", ["none", "int8", "int4"])
@pytest.mark.parametrize("broken,words", [
    ("decreasing", "row_ptr decreases at position 2"),
    ("from 1", "row_ptr starts at 1; pointers must start at 0"),
    ("short", "the length of row_idx"),
    ("values", "values hold"),
])
def test_op_refuses_row_pointers_that_do_not_fit_its_buffers(packed_case, how, broken, words):
    """The C++ kernel hands such a layer back and the torch implementation names what is wrong,
    instead of reading past a buffer (an error from inside the op) or skipping a block (wrong output)."""
    from gmc.kernels.quantize import quantize

    layer = quantize(packed_case("1x64", (128, 320), 0.5)[0], how)
    values, row_ptr = layer.values, layer.row_ptr.clone()
    if broken == "decreasing":
        row_ptr[2] = row_ptr[1] - 1
    elif broken == "from 1":
        row_ptr[0] = 1
    elif broken == "short":
        row_ptr[-1] -= 1
    else:
        values = values[:-1].clone()
    with pytest.raises(GmcError, match=f"^group_sparse_linear: .*{words}"):
        group_sparse_linear(torch.randn(3, 320), values, layer.row_idx, row_ptr, layer.bias, 128, 64, layer.scales)


def test_loading_a_state_dict_checks_and_reindexes_the_groups():
    """``load_state_dict`` into a ``GroupSparseLinear`` rebuilds its row index from the group indices it
    loads (so it never runs stale rows) and refuses indices that break the layout, naming the tensor."""
    from gmc.groups import GroupSpec
    from gmc.kernels.linear import GroupSparseLinear
    from gmc.kernels.packed import pack

    spec, shape = GroupSpec(1, 64), (128, 320)
    even = torch.zeros(spec.grid(shape), dtype=torch.bool)
    even[::2] = True
    a, b = pack(torch.randn(shape), even, spec), pack(torch.randn(shape), even.roll(1, 0), spec)  # same sizes
    module = GroupSparseLinear(a)
    state = {key: value.clone() for key, value in GroupSparseLinear(b).state_dict().items()}
    module.load_state_dict(state)
    x = torch.randn(3, 320)
    torch.testing.assert_close(module(x), F.linear(x, b.unpack()), atol=1e-4, rtol=1e-4)
    state["group_idx"][0] = -1
    with pytest.raises(GmcError, match="^packed layer: group_idx holds -1 at position 0"):
        module.load_state_dict(state)
