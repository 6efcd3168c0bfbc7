"""The Triton kernel on the tiled layout vs the dense masked reference in float64, run by the interpreter.

Every case compares against ``F.linear(x, W, b)`` where ``W`` is the packed layer's own dense
weight (``PackedLinear.unpack``, dequantized for int8/int4): the kernel must compute the function the
packed format stores, over group shapes (ragged rows and columns, an empty output group and an empty
input block), dtypes, quantization and token counts, and with block sizes other than the
interpreter's default (a row slice, a whole tile, several k chunks a block).
"""
import pytest
import torch
import torch.nn.functional as F
from conftest import GROUP_CASES

from gmc.errors import GmcError
from gmc.kernels.packed import integer_product
from gmc.kernels.quantize import quantize

triton_group_sparse = pytest.importorskip("gmc.kernels.triton_group_sparse")
from gmc.kernels.tiled import tile  # noqa: E402

KernelConfig = triton_group_sparse.KernelConfig
SLOW = pytest.mark.slow  # the interpreter's heaviest launches: the fast loop keeps a lighter one of each kind
TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}  # of max |ref|


def _tiled(layer):
    return tile(layer.values, layer.row_idx, layer.row_ptr, layer.scales, *layer.shape, layer.spec.g_in)


def _check(layer, x, config=None):
    tiled = _tiled(layer)
    bias = None if layer.bias is None else layer.bias.to(x.dtype)
    out = triton_group_sparse.triton_group_sparse_linear(x, tiled.values, tiled.entries, tiled.tile_ptr, bias,
                                                         layer.shape[0], layer.spec.g_in, tiled.scales, config=config)
    ref = F.linear(x.double(), layer.unpack().double(), None if bias is None else bias.double())
    assert out.dtype == x.dtype and out.shape == ref.shape
    error = (out.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)
    assert error <= TOLERANCE[x.dtype], f"relative error {error:.2e}"
    return out


@pytest.mark.parametrize("group,shape", GROUP_CASES)
@pytest.mark.parametrize("tokens", [1, 7, 40])
@pytest.mark.parametrize("sparsity", [0.3, 0.9])
def test_kernel_matches_the_dense_reference_fp32(packed_case, group, shape, tokens, sparsity):
    packed, _ = packed_case(group, shape, sparsity)
    _check(packed, torch.randn(tokens, shape[1]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group,shape", [("1x256", (96, 576)), ("32x32", (100, 70)), ("16x16", (80, 96))])
@pytest.mark.parametrize("tokens", [1, 33])
def test_kernel_half_precision(packed_case, dtype, group, shape, tokens):
    packed, _ = packed_case(group, shape, 0.5, dtype=dtype)
    _check(packed, torch.randn(tokens, shape[1]).to(dtype))


@pytest.mark.parametrize("how", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group,shape", [("1x64", (128, 320)), ("1x256", (96, 576)), ("32x32", (96, 128))])
@pytest.mark.parametrize("tokens", [1, 20])
def test_kernel_dequantizes_int8_and_int4_in_registers(packed_case, how, dtype, group, shape, tokens):
    packed, _ = packed_case(group, shape, 0.5)
    _check(quantize(packed, how), torch.randn(tokens, shape[1]).to(dtype))


@pytest.mark.parametrize("config,how", [
    pytest.param(KernelConfig(16, 32, 64, 4, 1), "none", marks=SLOW),
    pytest.param(KernelConfig(16, 32, 64, 4, 1), "int4", marks=SLOW),
    (KernelConfig(32, 128, 32, 4, 1), "int8"), (KernelConfig(64, 64, 128, 4, 1), "int4"),
    pytest.param(KernelConfig(32, 16, 32, 4, 1), "none", marks=SLOW)])
def test_kernel_block_sizes(packed_case, config, how):
    """Slices of a tile, a whole tile, several k chunks a block (int4: whole 32-k scale groups): one function."""
    packed, _ = packed_case("1x256", (140, 600), 0.5)  # a 128-row tile and a ragged one; 40 tokens: ragged tiles
    _check(quantize(packed, how), torch.randn(40, 600), config)


@pytest.mark.parametrize("config", [KernelConfig(16, 32, 256, 4, 1, split=3),
                                    pytest.param(KernelConfig(16, 16, 128, 4, 1, split=2), marks=SLOW),
                                    KernelConfig(32, 64, 64, 4, 1, split=4), KernelConfig(2, 32, 128, 4, 1, split=3)])
@pytest.mark.parametrize("how", ["none", "int8", "int4"])
@pytest.mark.parametrize("tokens", [1, pytest.param(5, marks=pytest.mark.slow)])  # 5: ragged token tiles of 2, 16, 32
def test_split_programs_and_several_blocks_a_step(packed_case, config, how, tokens):
    """A 1x64 layer read four (or two) blocks a step, its tiles' entries split between programs whose
    partial sums meet in the workspace; the counters are left zero, and a second call gives the same bits."""
    from gmc.kernels.triton_group_sparse import _WORKSPACES

    packed, _ = packed_case("1x64", (140, 640), 0.5)  # ragged against every block_r (140 = 128 + 12)
    x = torch.randn(tokens, 640)
    first = _check(quantize(packed, how), x, config)
    assert torch.equal(_check(quantize(packed, how), x, config), first)
    sums, arrived = _WORKSPACES[x.device]
    assert not arrived.any()


@pytest.mark.parametrize("config,how,dtype", [
    (KernelConfig(1, 32, 256, 4, 1), "none", torch.float32),
    pytest.param(KernelConfig(1, 32, 256, 4, 1), "int4", torch.bfloat16, marks=SLOW),
    pytest.param(KernelConfig(4, 16, 64, 4, 1), "int8", torch.float16, marks=SLOW),
    (KernelConfig(8, 128, 32, 4, 1), "none", torch.bfloat16),
    pytest.param(KernelConfig(1, 16, 256, 2, 4, split=2), "none", torch.bfloat16, marks=SLOW)])  # the one-token
# pick of a split layer
def test_cuda_core_products_of_a_few_tokens(packed_case, config, how, dtype):
    """Token tiles under 16 rows multiply on CUDA cores: one token a program, a few, tiles of several token
    tiles (9 tokens in tiles of 1, 4 or 8), whole 128-row tiles, k chunks of a block."""
    packed, _ = packed_case("1x256", (140, 600), 0.5, dtype if how == "none" else torch.float32)
    _check(quantize(packed, how), torch.randn(9, 600).to(dtype), config)


@pytest.mark.parametrize("group,dtype", [("1x256", torch.float32), ("1x64", torch.float32),
                                         pytest.param("1x256", torch.bfloat16, marks=SLOW)])
def test_int4_codes_through_the_mantissa_compute_what_converted_codes_do(packed_case, group, dtype):
    """``KernelConfig.mantissa``: int4 codes made floats through 2^23's mantissa are the codes exactly, so
    with fp32 x the outputs equal the converting launch's bit for bit, one block a step (1x256) or several
    (1x64); with bf16 x the dequantized weights stay fp32 and the outputs match the float64 reference."""
    packed, _ = packed_case(group, (140, 600), 0.5, torch.float32)
    layer = quantize(packed, "int4")
    x = torch.randn(3, 600).to(dtype)
    converted = _check(layer, x, KernelConfig(1, 32, 256, 4, 1))
    mantissa = _check(layer, x, KernelConfig(1, 32, 256, 4, 1, mantissa=True))
    if dtype == torch.float32:
        assert torch.equal(converted, mantissa)


@pytest.mark.parametrize("group,shape,block_k,how", [("1x256", (140, 600), 256, "int4"),
                                                     ("1x64", (140, 600), 256, "int4"),
                                                     pytest.param("1x256", (96, 576), 128, "int4", marks=SLOW),
                                                     pytest.param("32x32", (100, 96), 128, "int4", marks=SLOW),
                                                     ("16x16", (80, 96), 128, "int4"),
                                                     ("1x256", (140, 600), 256, "int8"),
                                                     ("1x64", (140, 600), 256, "int8"),
                                                     pytest.param("32x32", (100, 96), 128, "int8", marks=SLOW)])
def test_one_token_by_integer_dot_products(packed_case, group, shape, block_k, how):
    """``KernelConfig.dot4``: one token of int8 or int4 values against x quantized to int8 per 32 columns
    computes what the CPU's integer products do (``integer_product``) to float32's rounding, and lies within
    int8 activations' error of the float reference: ragged blocks (576 = 2 x 256 + 64), several narrow blocks
    a step (1x64), 2-D groups (int4's 16 columns: half a subgroup), a split tile's entries, three tokens."""
    packed, _ = packed_case(group, shape, 0.5, torch.float32)
    layer = quantize(packed, how)
    x = torch.randn(3, shape[1])
    tiled = _tiled(layer)
    out = triton_group_sparse.triton_group_sparse_linear(
        x, tiled.values, tiled.entries, tiled.tile_ptr, layer.bias, shape[0], layer.spec.g_in, tiled.scales,
        config=KernelConfig(1, 32, block_k, 4, 1, split=2, dot4=True))
    ref = integer_product(layer, x)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    exact = F.linear(x.double(), layer.unpack().double(), layer.bias.double())
    assert (out.double() - exact).abs().max() <= 2e-2 * exact.abs().max()


def test_integer_dot_products_need_whole_32_column_groups_of_int8(packed_case):
    packed, _ = packed_case("16x16", (80, 96), 0.5, torch.float32)
    layer = quantize(packed, "int8")
    tiled = _tiled(layer)
    with pytest.raises(GmcError, match="blocks of 16 stored columns are not whole 32-column groups"):
        triton_group_sparse.triton_group_sparse_linear(
            torch.randn(1, 96), tiled.values, tiled.entries, tiled.tile_ptr, None, 80, 16, tiled.scales,
            config=KernelConfig(1, 32, 64, 4, 1, dot4=True))


def test_integer_dot_products_take_one_token_and_codes_alone():
    with pytest.raises(GmcError, match="dot4 runs one token"):
        KernelConfig(16, 32, 256, 4, 1, dot4=True)
    with pytest.raises(GmcError, match="not with mantissa"):
        KernelConfig(1, 32, 256, 4, 1, mantissa=True, dot4=True)


def test_kernel_writes_every_output_of_an_empty_layer(packed_case):
    packed, _ = packed_case("1x64", (128, 320), 1.0)  # every group pruned: the output is the bias
    _check(packed, torch.randn(5, 320))


def test_kernel_strided_input(packed_case):
    packed, _ = packed_case("1x64", (128, 320), 0.5)
    _check(packed, torch.randn(320, 20).t())  # [20, 320], non-contiguous


@pytest.mark.parametrize("group,shape", [("1x64", (128, 320)), ("1x256", (96, 576)), ("32x32", (100, 70))])
@pytest.mark.parametrize("how,dtype", [("none", torch.float32), ("none", torch.bfloat16), ("int8", torch.bfloat16),
                                       ("int4", torch.bfloat16)])
def test_dense_weight_launch_writes_the_layers_weight(packed_case, group, shape, how, dtype):
    """Every element of the dense weight written (the buffer starts as NaN), each kept value dequantized as
    the packed layer stores it, zeros elsewhere: ragged rows and columns, an empty output group and an
    empty input block (``random_selectors``), 2-D tiles of 64 rows (32x32)."""
    packed, _ = packed_case(group, shape, 0.5, dtype=dtype if how == "none" else torch.float32)
    layer = packed if how == "none" else quantize(packed, how)
    tiled = _tiled(layer)
    dense = torch.full(shape, float("nan"), dtype=dtype)
    launch = triton_group_sparse.plan_dense(tiled.values, tiled.entries, tiled.tile_ptr, dense, *shape,
                                            layer.spec.g_in, tiled.scales)
    launch.kernel[launch.grid](*launch.args, **launch.constexprs)
    assert not dense.isnan().any()
    # dequantized in fp32, then rounded to bf16 (the interpreter's cast may round the other way: one ulp)
    ulp = 2 ** -7 if dtype == torch.bfloat16 and how != "none" else 1e-6
    torch.testing.assert_close(dense, layer.unpack().to(dtype), rtol=ulp, atol=1e-6)


@pytest.mark.slow  # the interpreter's tiled kernel over a prompt at the threshold
def test_prefill_runs_through_the_dense_weight(packed_case, monkeypatch):
    """From DENSE_PREFILL_TOKENS tokens a layer whose tiles keep most blocks is multiplied through its dense
    weight (one dense-weight launch, then F.linear), within the kernel's tolerance of the float64 reference; a
    sparse 2-D layer, a shorter prompt or a given config keep the tiled kernel."""
    planned = []
    plan_dense = triton_group_sparse.plan_dense
    monkeypatch.setattr(triton_group_sparse, "plan_dense", lambda *a, **k: planned.append(1) or plan_dense(*a, **k))
    monkeypatch.setattr(triton_group_sparse, "DENSE_PREFILL_TOKENS", 48)  # the interpreter's tiled kernel: short
    tokens = triton_group_sparse.DENSE_PREFILL_TOKENS
    packed, _ = packed_case("1x64", (128, 320), 0.5)
    x = torch.randn(tokens, 320)
    _check(packed, x)
    assert planned == [1]
    _check(packed, x, KernelConfig(16, 32, 64, 4, 1))  # a config: the tiled kernel
    assert planned == [1]
    _check(quantize(packed, "int4"), torch.randn(tokens + 3, 320).to(torch.bfloat16))
    assert planned == [1, 1]
    _check(packed, torch.randn(tokens - 1, 320))
    sparse, _ = packed_case("64x64", (192, 256), 0.9)  # most of its tiles' blocks pruned: tiles skip them
    _check(sparse, torch.randn(tokens, 256))
    assert planned == [1, 1]
    choose = triton_group_sparse.dense_prefill
    entries, tile_ptr = torch.empty(40, 11), torch.empty(11)  # 10 tiles of 4 blocks, 40 entries: every pair
    assert choose(tokens, entries, tile_ptr, 1024, 256) and not choose(tokens - 1, entries, tile_ptr, 1024, 256)
    assert not choose(tokens, entries[:19], tile_ptr, 1024, 256)  # under half the pairs
    assert not choose(None, entries, tile_ptr, 1024, 256)  # a count known only at run time


def test_kernel_refuses_the_packed_layout_and_integer_input(packed_case):
    packed, _ = packed_case("1x64", (128, 320), 0.5)
    with pytest.raises(GmcError, match="reads the tiled layout"):
        triton_group_sparse.triton_group_sparse_linear(torch.randn(2, 320), packed.values, packed.row_idx,
                                                       packed.row_ptr, packed.bias, 128, 64)
    tiled = _tiled(packed)
    with pytest.raises(GmcError):
        triton_group_sparse.triton_group_sparse_linear(torch.ones(2, 320, dtype=torch.int32), tiled.values,
                                                       tiled.entries, tiled.tile_ptr, None, 128, 64)


def test_configs_follow_the_measured_picks():
    """The picks are the H200 sweeps' fastest (docs/gpu.md): one token on CUDA cores, 32-row slices,
    256 columns a step, 3 stages, a tile's entries split until about two programs share a
    multiprocessor (int4: four, 3 or 4 stages by the Triton release); 2-16 tokens and int8 on tensor
    cores, 5 stages, about four programs a multiprocessor (int4: three); a float 1x256 layer whose
    entries split takes 16-row slices of 2 warps at one token and 64-row slices at 2-16; whole 128-row
    tiles for prefill, also when the token count is only known at run time."""
    choose = triton_group_sparse.choose_config

    def picked(tokens, d_out, d_in, how="none", g_in=256):
        c = choose(tokens, d_out, g_in, 128, torch.bfloat16, how, 132, d_in=d_in)
        return c.block_t, c.sub_r, c.block_k, c.num_warps, c.num_stages, c.split

    assert picked(1, 4096, 4096) == (1, 16, 256, 2, 4, 2)  # q/k/v/o: 128 32-row slices, two programs each
    assert picked(1, 11008, 4096) == (1, 32, 256, 4, 3, 1)  # gate/up: 344 slices fill 132 SMs alone
    assert picked(1, 4096, 11008) == (1, 16, 256, 2, 4, 2)  # down
    assert picked(1, 4096, 4096, g_in=64) == (1, 32, 256, 4, 3, 2)  # 1x64: four blocks a step
    assert picked(1, 4096, 4096, "int4") == (1, 32, 256, 4, triton_group_sparse.INT4_DECODE_STAGES, 4)
    assert picked(1, 4096, 4096, "int8") == (16, 32, 256, 4, 5, 4)
    assert picked(4, 4096, 4096) == picked(16, 4096, 4096) == picked(16, 4096, 11008) == (16, 64, 256, 4, 5, 4)
    assert picked(16, 11008, 4096) == (16, 32, 256, 4, 5, 1)
    assert picked(16, 4096, 4096, "int4") == (16, 32, 256, 4, 5, 3)
    assert picked(1, 576, 576)[-1] == 1  # a small layer's few entries are not split
    prefill = choose(2048, 4096, 256, 128, torch.bfloat16, "none", 132, d_in=4096)
    assert (prefill.block_t, prefill.sub_r, prefill.block_k, prefill.num_warps) == (128, 128, 64, 8)
    assert choose(None, 4096, 256, 128, torch.bfloat16, "none", 132) == prefill


def test_one_token_int4_stages_follow_the_triton_release():
    """3 stages where the H200 sweep ran them fastest without spills (Triton 3.6), 4 from 3.9 (3 spill)."""
    stages = triton_group_sparse.int4_decode_stages
    assert [stages(v) for v in ("3.6.0", "3.8.1", "3.9.0", "3.10.0+git1a2b", "4.0.0")] == [3, 3, 4, 4, 4]
