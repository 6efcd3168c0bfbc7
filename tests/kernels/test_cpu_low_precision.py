"""bfloat16, weight-only int8 and weight-only int4 in the compiled CPU kernel against the dense
reference ``F.linear(x, packed.unpack(), bias)``.

Five kinds of layer: bf16 values with bf16 x, int8 values (``quantize_int8``) and int4 values
(``quantize_int4``) each with fp32 and with bf16 x. Each runs through the op with the torch
implementation made to fail (so the compiled kernel is what ran), through every product the kernel
can be forced to, and multithreaded; the quantization itself is bounded by half a step per weight;
the runtime library of compiled packages runs them too, in a process without gmc.
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
from gmc.kernels.packed import INT4_GROUP, PackedLinear, block_values, integer_product, pack_dense
from gmc.kernels.quantize import quantize_int4, quantize_int8

KINDS = ["bf16", "int8", "int8-bf16x", "int4", "int4-bf16x"]  # (values, x): bf16/bf16, int8/fp32, int8/bf16, ...
PATHS = {"stream": 1, "tiles": 2, "gemm": 3}
STREAM_FLOAT = 4  # int4 decode in fp32: the integer stream's accuracy reference


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
    return _as_kind(packed_case(group, shape, sparsity)[0], kind)


def _as_kind(packed: PackedLinear, kind: str):
    """``(layer, x dtype)``: ``packed`` stored as ``kind`` (KINDS), its bias in x's dtype."""
    quantized = {"int8": quantize_int8, "int4": quantize_int4}
    if kind in quantized:
        return quantized[kind](packed), torch.float32
    bf16 = packed.to(dtype=torch.bfloat16)
    return (bf16 if kind == "bf16" else quantized[kind.removesuffix("-bf16x")](bf16)), torch.bfloat16


def _check(out, x, layer, bias, path="auto"):
    """Output dtype is x's; fp32 output equals the dequantized reference tightly, bf16 to its
    rounding; what runs integer dot products (``path`` stream or auto: int4 at any number of
    tokens, int8 too) within the error bound of quantizing x to int8 per 32 numbers."""
    weight = layer.unpack().float()
    expected = F.linear(x.float(), weight, None if bias is None else bias.float())
    scale = expected.abs().max().item() + 1e-6
    assert out.dtype == x.dtype and out.shape == expected.shape
    tokens = x.reshape(-1, x.shape[-1]).shape[0]
    integer = path in ("stream", "auto") and layer.quantized in ("int4", "int8")
    if integer:
        codes = _code_part(layer) if layer.quantized == "int4" else layer.unpack()
        bound = _x_quantization_bound(x.float().reshape(tokens, -1), codes, layer.spec.g_in)
        rounding = 1e-5 if x.dtype == torch.float32 else 2e-2
        error = (out.float() - expected).abs().reshape(tokens, -1)
        assert (error <= bound + rounding * scale).all(), (error - bound).max()
        assert (error > 0).any() or not x.any()  # x was quantized: not the fp32 product
    elif x.dtype == torch.float32:
        torch.testing.assert_close(out, expected, atol=1e-5 * scale, rtol=1e-5)
    else:
        torch.testing.assert_close(out.float(), expected, atol=1e-3 * scale, rtol=1e-2)


def _with_codes(layer: PackedLinear, byte: int) -> torch.Tensor:
    """The dense weight of ``layer``'s int4 scales with every code byte set to ``byte``."""
    return PackedLinear(torch.full_like(layer.values, byte), layer.group_idx, layer.group_ptr, layer.shape,
                        layer.spec, scales=layer.scales).unpack()


def _code_part(layer: PackedLinear) -> torch.Tensor:
    """``q * d`` of every weight of an int4 layer (its dequantized weight less the offsets ``m``):
    what multiplies the quantized x (the offsets multiply x's exact sum)."""
    return layer.unpack() - _with_codes(layer, 0)


def _x_quantization_bound(x: torch.Tensor, weight: torch.Tensor, g_in: int) -> torch.Tensor:
    """``[T, d_out]``: the most that quantizing each subgroup of x (32 numbers of a block, int8,
    ``max|x| / 127`` a step) can move each output: sum over columns of half a step times ``|weight|``
    (``_code_part``: what multiplies the quantized x)."""
    columns = torch.arange(x.shape[1])
    block, within = columns // g_in, columns % g_in
    subgroup = block * -(-g_in // INT4_GROUP) + within // INT4_GROUP  # [d_in]
    peak = torch.zeros(x.shape[0], int(subgroup.max()) + 1).scatter_reduce(1, subgroup.expand_as(x), x.abs(), "amax")
    half_step = peak[:, subgroup] / 127 / 2  # [T, d_in]
    return half_step @ weight.abs().t() * 1.001


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
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_every_group_kept_adds_each_tile_as_one_run(kernel, kind, path, tokens):
    """All groups kept (gmc's dense int8 / int4 rows: a dense layer in the packed layout), so every
    tile's rows are consecutive and their sums go into y by a vector add; ragged shape, every product."""
    gen = torch.Generator().manual_seed(3)
    dense = pack_dense(torch.randn(100, 200, generator=gen), "1x64", torch.randn(100, generator=gen))
    layer, dtype = _as_kind(dense, kind)
    assert layer.row_idx.numel() == 100 * 4  # every row of every block, in order
    x = torch.randn(tokens, 200).to(dtype)
    out = kernel.forward(x, layer.values, layer.row_idx, layer.row_ptr, layer.bias, 100, layer.spec.g_in,
                         PATHS[path], layer.scales)
    _check(out, x, layer, layer.bias, path)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("group,shape", GROUP_CASES)
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_forced_products_match_reference(kernel, packed_case, kind, path, group, shape, tokens):
    layer, dtype = _layer(packed_case, kind, group, shape, 0.3)
    x = torch.randn(tokens, shape[1]).to(dtype)
    out = kernel.forward(x, layer.values, layer.row_idx, layer.row_ptr, layer.bias, shape[0], layer.spec.g_in,
                         PATHS[path], layer.scales)
    _check(out, x, layer, layer.bias, path)


@pytest.mark.parametrize("group,shape", [("1x64", (128, 320)), ("1x256", (96, 576)), ("16x16", (80, 96)),
                                         ("1x64", (72, 301))])
@pytest.mark.parametrize("how,tokens", [("int4", 1), ("int4", 5), ("int8", 1), ("int8", 4), ("int8", 5)])
def test_integer_products_compute_their_reference(compiled_only, packed_case, group, shape, how, tokens):
    """The integer products (int4 and int8, decode and prefill) compute ``integer_product``: each column's
    values against x quantized per 32 k rows of a block, int4's offsets against x itself, to float32's
    rounding (the reference the CUDA kernel's ``dot4`` launches are held to). (72, 301): a last block 45
    wide, whose k rows past its fifth octet int8 stores row-major."""
    if how == "int4" and shape[1] % 8:
        pytest.skip("int4 needs g_in and so d_in's blocks in octets")
    layer = {"int4": quantize_int4, "int8": quantize_int8}[how](packed_case(group, shape, 0.5)[0])
    x = torch.randn(tokens, shape[1])
    out = group_sparse_linear(x, layer.values, layer.row_idx, layer.row_ptr, layer.bias, shape[0], layer.spec.g_in,
                              layer.scales)
    ref = integer_product(layer, x)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("tokens", [1, 4])
def test_int8_decode_split_over_threads_computes_its_reference(kernel, packed_case, tokens):
    """The int8 stream split along k over 2 and 3 threads (cuts on whole subgroups of 32 k rows,
    inside 256-wide blocks) computes what one thread does: ``integer_product``."""
    layer = quantize_int8(packed_case("1x256", (400, 600), 0.5)[0])  # blocks 256, 256, 88 wide
    x = torch.randn(tokens, 600)
    ref = integer_product(layer, x)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            out = kernel.forward(x, layer.values, layer.row_idx, layer.row_ptr, layer.bias, 400, 256, PATHS["stream"],
                                 layer.scales)
            torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("tokens", [1, 3])
def test_int4_decode_split_by_tile_cost_computes_its_reference(kernel, packed_case, tokens):
    """The int4 stream's shares weigh a tile by its k rows plus INT4_TILE_COST_ROWS, so on SmolLM2's
    fused gate/up (3072 x 576 at 1x256: blocks 256, 256 and 64 wide) the cuts fall elsewhere than an
    equal split of the values would put them, inside blocks and at their edges. Every thread count
    computes ``integer_product``, with the same bits from one run to the next."""
    layer = quantize_int4(packed_case("1x256", (3072, 576), 0.5)[0])
    x = torch.randn(tokens, 576)
    ref = integer_product(layer, x)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3, 4):
            torch.set_num_threads(n)
            args = (x, layer.values, layer.row_idx, layer.row_ptr, layer.bias, 3072, 256, PATHS["stream"],
                    layer.scales)
            out = kernel.forward(*args)
            torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
            assert torch.equal(kernel.forward(*args), out)
    finally:
        torch.set_num_threads(threads)


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
            _check(out, x, layer, layer.bias, path)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kind", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("path", ["stream", "tiles"])
def test_prefill_items_taken_by_free_threads_give_one_threads_output(kernel, packed_case, kind, path):
    """A 250-token prefill of a layer past RANGE_BYTES on 2 threads is cut into items (ranges of rows
    of at most 512 KiB of values; by runs of 32 tokens for int4's integer tiles, the last run 26 long)
    that whichever thread is free takes: bf16 (8 MiB: 16 ranges) and int8 (4 MiB: 8 ranges) by ranges,
    int4's integer tiles (2 MiB: 4 ranges by 8 runs) by both; int4's fp32 tiles (4 items) and, on 3
    threads, int8 (8) have too few and split the rows into one equal range a thread. Every thread count
    gives one thread's output bit for bit, run after run, and that is the reference's."""
    layer, dtype = _layer(packed_case, kind, "1x256", (8192, 1024), 0.5)
    x = torch.randn(250, 1024).to(dtype)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3, 2):
            torch.set_num_threads(n)
            outs.append(kernel.forward(x, layer.values, layer.row_idx, layer.row_ptr, layer.bias, 8192, 256,
                                       PATHS[path], layer.scales))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outs[0], out) for out in outs[1:])
    _check(outs[0], x, layer, layer.bias, path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 128])
def test_int8_torch_implementation_matches_reference(packed_case, dtype, tokens):
    """The fallback (float16 x reaches it through the op: C++ hands it back; fp32 and bf16 x run
    the compiled kernel, whose prefill quantizes x)."""
    packed, _ = packed_case("1x256", (96, 576), 0.5)
    layer = quantize_int8(packed.to(dtype=dtype))
    x = torch.randn(2, tokens, 576).to(dtype)
    args = (layer.values, layer.row_idx, layer.row_ptr, layer.bias, 96, 256, layer.scales)
    expected = F.linear(x.float(), layer.unpack(), layer.bias.float())
    outs = [group_sparse_linear_torch(x, *args)]
    if dtype == torch.float16:
        outs.append(group_sparse_linear(x, *args))
    else:
        _check(group_sparse_linear(x, *args), x, layer, layer.bias)
    for out in outs:
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
    assert layer.scales[0] == 1 and (block_values(layer.values, 64, 0, n0, 64)[:, 0] == 0).all()
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
    with pytest.raises(GmcError, match="scales go with int8 or int4 .uint8. values"):
        group_sparse_linear(x, packed.values, packed.row_idx, packed.row_ptr, None, 128, 64, layer.scales)
    with pytest.raises(GmcError, match="int8 scales must be float32"):
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
def test_runtime_library_runs_bf16_int8_and_int4(kernel, packed_case, tmp_path):
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


# The kernel built for another instruction set (GMC_CPU_KERNEL names it), in a process that never
# loads the native build: its products on the cases, saved for the checks here.
_ISA_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    import gmc.kernels.group_sparse_linear  # noqa: F401
    from gmc.kernels.cpu_group_sparse import backend, kernel
    module = kernel()
    assert backend().endswith(", -march=x86-64-v3)"), backend()
    cases = torch.load(sys.argv[1])
    torch.save([[module.forward(*case) for case in cases] for _ in range(2)], sys.argv[2])
""")
AVX2 = {"avx2", "fma", "f16c", "bmi2"}  # x86-64-v3


def _cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next(line for line in f if line.startswith("flags")).split(":")[1].split())
    except (OSError, StopIteration):
        return set()


@pytest.mark.slow
@pytest.mark.skipif(not AVX2 <= _cpu_flags(), reason="runs the AVX2 build: needs an x86-64-v3 CPU")
def test_avx2_build_matches_reference(kernel, packed_case, tmp_path):
    """The AVX2 code (no AVX-512: two-vector tiles, vpmaddubsw + vpmaddwd integer products, the int8
    sign trick) on what most CPUs run: every product of each kind against the dense reference."""
    cases, expected = [], []
    for kind in KINDS:
        layer, dtype = _layer(packed_case, kind, "1x64", (300, 200), 0.3)
        for path in [*PATHS, *(["float stream"] if kind.startswith("int4") else [])]:
            for tokens in (1, 3, 40):
                x = torch.randn(tokens, 200).to(dtype)
                number = PATHS.get(path, STREAM_FLOAT)
                cases.append([x, layer.values, layer.row_idx, layer.row_ptr, layer.bias, 300, 64, number, layer.scales])
                expected.append((x, layer, path))
    torch.save(cases, tmp_path / "cases.pt")
    env = {**os.environ, cpu_group_sparse.ENV_SWITCH: "x86-64-v3"}
    result = subprocess.run([sys.executable, "-c", _ISA_SCRIPT, str(tmp_path / "cases.pt"),
                             str(tmp_path / "outs.pt")], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    first, second = torch.load(tmp_path / "outs.pt")
    for out, again, (x, layer, path) in zip(first, second, expected):
        _check(out, x, layer, layer.bias, path)
        assert torch.equal(out, again)  # the same numbers from run to run


def _int4_steps(layer: PackedLinear) -> torch.Tensor:
    """The step ``d`` of every kept weight of an int4 layer, laid out densely (0 where pruned)."""
    return _with_codes(layer, 0x11) - _with_codes(layer, 0)  # q = 1 everywhere, less q = 0


@pytest.mark.parametrize("group,shape", GROUP_CASES)
def test_quantize_int4_error_is_at_most_half_a_step(packed_case, group, shape):
    packed, dense = packed_case(group, shape, 0.5)
    layer = quantize_int4(packed)
    assert layer.values.dtype == torch.uint8 and layer.scales.dtype == torch.float16
    assert layer.values.numel() < packed.values.numel() / 2 + layer.row_idx.numel()
    assert torch.equal(layer.bias, packed.bias)
    step = _int4_steps(layer)
    kept = dense != 0
    error = (layer.unpack() - dense).abs()
    # half a step, plus the fp16 rounding of the offset (the codes are taken against the stored d and m)
    assert (error[kept] <= step[kept] * 0.5 + dense.abs().max() * 2 ** -10).all(), (error - step / 2).max()
    assert not layer.unpack()[~kept].any()  # pruned weights stay pruned
    assert quantize_int4(layer) is layer


def test_int4_round_trip_is_exact_on_its_grid(packed_case):
    """Weights already of the form q * d + m per 32 k rows (fp16 d and m) come back exactly:
    what a model dequantized from llama.cpp's Q4_1 is made of."""
    packed, _ = packed_case("1x64", (128, 320), 0.5)
    once = quantize_int4(packed)
    again = quantize_int4(_repacked(packed, once.unpack()))
    torch.testing.assert_close(again.unpack(), once.unpack(), atol=0, rtol=0)
    assert torch.equal(again.values, once.values)


def _repacked(layer: PackedLinear, dense: torch.Tensor) -> PackedLinear:
    """``layer``'s kept groups, their values read from ``dense`` [d_out, d_in]."""
    from gmc.kernels.packed import pack

    spec = layer.spec
    G_out, G_in = spec.grid(layer.shape)
    selectors = torch.zeros(G_out, G_in, dtype=torch.bool)
    for v in range(G_in):
        selectors[layer.group_idx[int(layer.group_ptr[v]):int(layer.group_ptr[v + 1])].long(), v] = True
    return pack(dense, selectors, spec, layer.bias)


def test_int4_layer_is_validated_and_not_cast(packed_case):
    packed, _ = packed_case("1x64", (128, 320), 0.5)
    layer = quantize_int4(packed)
    parts = (layer.values, layer.group_idx, layer.group_ptr, layer.shape, layer.spec, layer.bias)
    with pytest.raises(GmcError, match="fp16 scales of shape"):
        PackedLinear(*parts)
    with pytest.raises(GmcError, match="fp16 scales of shape"):
        PackedLinear(*parts, layer.scales[:-1])
    with pytest.raises(GmcError, match="fp16 scales of shape"):
        PackedLinear(*parts, layer.scales.float())
    with pytest.raises(GmcError, match="packed values hold"):
        PackedLinear(layer.values[:-1], *parts[1:], layer.scales)
    with pytest.raises(GmcError, match="unpack"):
        layer.to(dtype=torch.float32)
    with pytest.raises(GmcError, match="float packed layer"):
        quantize_int4(quantize_int8(packed))
    odd, _ = packed_case("1x12", (16, 40), 0.5)
    with pytest.raises(GmcError, match="multiple of 8"):
        quantize_int4(odd)
    index_bytes = 4 * (layer.group_idx.numel() + layer.group_ptr.numel())
    assert layer.nbytes == layer.values.numel() + 2 * layer.scales.numel() + index_bytes
    # 4 bits a weight plus two fp16 numbers per 32: 5 bits, as llama.cpp's Q4_1
    assert layer.values.numel() * 2 == packed.values.numel() and layer.scales.numel() * 16 == packed.values.numel()


def test_int4_contract_errors(packed_case):
    packed, _ = packed_case("1x64", (128, 320), 0.5)
    layer = quantize_int4(packed)
    x = torch.randn(2, 320)
    with pytest.raises(GmcError, match="int4 .uint8. packed values need their scales"):
        group_sparse_linear(x, layer.values, layer.row_idx, layer.row_ptr, None, 128, 64)
    with pytest.raises(GmcError, match="int4 values need 1-D float16 scales"):
        group_sparse_linear(x, layer.values, layer.row_idx, layer.row_ptr, None, 128, 64, layer.scales.float())


@pytest.mark.parametrize("tokens", [1, 2, 11, 40])
def test_int4_subgroups_straddle_ragged_blocks(compiled_only, tokens):
    """A block narrower than INT4_GROUP, a last subgroup of odd width, empty blocks and one thread
    or three: every product against the dense reference."""
    from gmc.kernels.packed import pack

    torch.manual_seed(tokens)
    d_out, d_in, spec = 70, 2 * INT4_GROUP + 7 + 48, "1x48"  # blocks 48, 48, 23 wide
    weight = torch.randn(d_out, d_in)
    selectors = torch.rand(d_out, 3) < 0.6
    selectors[:, 1] = False  # an empty block
    layer = quantize_int4(pack(weight, selectors, spec, torch.randn(d_out)))
    x = torch.randn(tokens, d_in)
    threads = torch.get_num_threads()
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            for path, number in {**PATHS, "float stream": STREAM_FLOAT}.items():
                out = cpu_group_sparse.kernel().forward(x, layer.values, layer.row_idx, layer.row_ptr, layer.bias,
                                                        d_out, 48, number, layer.scales)
                _check(out, x, layer, layer.bias, path)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("tokens", [1, 2, 3, 4, 9, 37])
@pytest.mark.parametrize("threads", [1, 2])
def test_int4_integer_stream_against_its_float_stream(kernel, packed_case, tokens, threads):
    """The product with x quantized to int8 (integer dot products: decode, and prefill in runs of
    tokens with a shorter last one) is within the bound of that quantization of the fp32 product
    over the same codes, which equals the reference."""
    layer = quantize_int4(packed_case("1x256", (1536, 576), 0.5)[0])
    x = torch.randn(tokens, 576)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        args = (x, layer.values, layer.row_idx, layer.row_ptr, layer.bias, 1536, 256)
        exact, integer = (kernel.forward(*args, path, layer.scales) for path in (STREAM_FLOAT, PATHS["stream"]))
    finally:
        torch.set_num_threads(saved)
    _check(exact, x, layer, layer.bias, "float stream")
    _check(integer, x, layer, layer.bias, "stream")
    bound = _x_quantization_bound(x, _code_part(layer), 256)
    assert ((integer - exact).abs() <= bound + 1e-5 * exact.abs().max()).all()


@pytest.mark.parametrize("kind", ["int4", "int8"])
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_integer_products_are_the_same_from_call_to_call(kernel, packed_case, kind, tokens):
    """Each output's summation order is fixed by the layout and the thread count: repeated calls,
    on one thread and on two, give the same numbers to the bit."""
    layer, dtype = _layer(packed_case, kind, "1x256", (1536, 576), 0.5)
    x = torch.randn(tokens, 576).to(dtype)
    saved = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs = [kernel.forward(x, layer.values, layer.row_idx, layer.row_ptr, layer.bias, 1536, 256, 0,
                                   layer.scales) for _ in range(3)]
            assert all(torch.equal(outs[0], out) for out in outs[1:])
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("where", ["descending block", "repeated row", "row past d_out"])
def test_int4_decode_refuses_rows_that_do_not_rise(kernel, packed_case, threads, where):
    """Rows of a block that fall, repeat or pass d_out, on one thread and on two: the strict entry
    refuses the layer (the op then takes its torch implementation)."""
    layer = quantize_int4(packed_case("1x256", (1536, 576), 0.5)[0])
    ptr, rows = layer.row_ptr.tolist(), layer.row_idx.clone()
    if where == "descending block":
        rows[ptr[0]: ptr[1]] = rows[ptr[0]: ptr[1]].flip(0)
    elif where == "repeated row":
        middle = (ptr[1] + ptr[2]) // 2
        rows[middle + 1] = rows[middle]
    else:
        rows[ptr[2] - 1] = 1536 + 5
    x = torch.randn(1, 576)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        with pytest.raises(RuntimeError, match="packed layer"):
            kernel.forward(x, layer.values, rows, layer.row_ptr, layer.bias, 1536, 256, PATHS["stream"], layer.scales)
    finally:
        torch.set_num_threads(saved)
