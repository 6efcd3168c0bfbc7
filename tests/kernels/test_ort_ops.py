"""gmc's ONNX Runtime custom op (``libgmc_ort_ops.so``: ``gmc/kernels/ort_group_sparse.cpp`` on the torch op's
C++ core) in onnxruntime: one-node models against the dense reference ``F.linear(x, packed.unpack(), bias)``
and the torch op, one and two intra-op threads, layouts it must refuse with an error rather than
misread, and the checks ``gmc.kernels.ort_ops`` runs before it lets ONNX Runtime load a library.

The library is built once (cached under ``$GMC_CACHE``); without ONNX Runtime's headers or a compiler every
test skips with ``ort_ops.why_not()``. The packed tensors are the model's inputs, not initializers, so
one session runs every layout a test feeds it.
"""
import json
import shutil
import subprocess

import pytest
import torch
import torch.nn.functional as F

from gmc.errors import GmcError
from gmc.kernels import ort_ops
from gmc.kernels.group_sparse_linear import group_sparse_linear
from gmc.kernels.onnx_group_sparse import VERSION
from gmc.kernels.packed import INT4_GROUP, PackedLinear
from gmc.kernels.quantize import quantize_int4, quantize_int8

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper  # noqa: E402
from onnxruntime.capi.onnxruntime_pybind11_state import (  # noqa: E402
    Fail,
    InvalidArgument,
    RuntimeException,
)

ORT_ERRORS = (Fail, InvalidArgument, RuntimeException)
KINDS = {"fp32": lambda layer: layer, "int8": quantize_int8, "int4": quantize_int4}
ONNX_TYPES = {torch.float32: TensorProto.FLOAT, torch.int8: TensorProto.INT8, torch.uint8: TensorProto.UINT8,
              torch.float16: TensorProto.FLOAT16, torch.int32: TensorProto.INT32}
NAMES = ("values", "row_idx", "row_ptr", "bias", "scales")


@pytest.fixture(scope="session")
def library():
    path = ort_ops.library_path()
    if path is None:
        pytest.skip(f"ONNX Runtime op library not built: {ort_ops.why_not()}")
    return path


def _feeds(layer, x: torch.Tensor) -> dict:
    """The model's inputs for ``layer``: x and the packed tensors (row_idx as ONNX's int32)."""
    tensors = {"values": layer.values, "row_idx": layer.row_idx.int(), "row_ptr": layer.row_ptr,
               "bias": layer.bias, "scales": layer.scales}
    return {"x": x.numpy(), **{name: t.contiguous().numpy() for name, t in tensors.items() if t is not None}}


def _model(layer, rank: int = 2, version: int = VERSION, **attributes) -> bytes:
    """One GroupSparseLinear node whose inputs are all graph inputs (bias and scales when ``layer`` has them)."""
    d_out = layer.shape[0]
    inputs = ["x", "values", "row_idx", "row_ptr", "bias" if layer.bias is not None else "",
              "scales" if layer.scales is not None else ""]
    while inputs[-1] == "":
        inputs.pop()
    node = helper.make_node("GroupSparseLinear", inputs, ["y"], domain="gmc",
                            **{"d_out": d_out, "g_in": layer.spec.g_in, **attributes})
    dtypes = {"values": layer.values.dtype, "row_idx": torch.int32, "row_ptr": torch.int32, "bias": torch.float32,
              "scales": None if layer.scales is None else layer.scales.dtype}
    graph_inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [f"n{i}" for i in range(rank)])]
    graph_inputs += [helper.make_tensor_value_info(name, ONNX_TYPES[dtypes[name]], None)
                     for name in NAMES if name in inputs]
    output = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    graph = helper.make_graph([node], "layer", graph_inputs, [output])
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("gmc", version)]
    return helper.make_model(graph, opset_imports=opsets).SerializeToString()


def test_a_version_1_node_is_not_run(library, packed_case):
    """Version 1 held int8 values row-major: its files would compute garbage with this library."""
    layer = _layer(packed_case, "int8")
    with pytest.raises(Exception, match="GroupSparseLinear"):
        _session(_model(layer, version=1))


def _session(model: bytes, threads: int = 1) -> "ort.InferenceSession":
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    ort_ops.register(options)
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def _run(session, layer, x: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(session.run(None, _feeds(layer, x))[0])


def _torch_op(layer, x: torch.Tensor) -> torch.Tensor:
    return group_sparse_linear(x, layer.values, layer.row_idx, layer.row_ptr, layer.bias, layer.shape[0],
                               layer.spec.g_in, layer.scales)


def _layer(packed_case, kind: str, group="1x256", shape=(96, 576), sparsity=0.5, bias=True):
    packed, _ = packed_case(group, shape, sparsity)
    if not bias:
        packed.bias = None
    return KINDS[kind](packed)


def _x_quantization_bound(layer, x: torch.Tensor) -> torch.Tensor:
    """``[T, d_out]``: the most that quantizing x to int8 per 32 numbers of a block (``max|x| / 127`` a
    step) moves an output of the integer products: half a step times ``|w|`` summed over k, where w
    is what multiplies the quantized x (int4: ``q * d``, the weight less its offset ``m``, which
    multiplies x's exact sum)."""
    weight = layer.unpack().float()
    if layer.quantized == "int4":
        weight = weight - PackedLinear(torch.zeros_like(layer.values), layer.group_idx, layer.group_ptr, layer.shape,
                                       layer.spec, scales=layer.scales).unpack().float()
    g_in, columns = layer.spec.g_in, torch.arange(x.shape[1])
    subgroup = columns // g_in * -(-g_in // INT4_GROUP) + columns % g_in // INT4_GROUP  # [d_in]
    peak = torch.zeros(x.shape[0], int(subgroup.max()) + 1).scatter_reduce(1, subgroup.expand_as(x), x.abs(), "amax")
    return (peak[:, subgroup] / 127 / 2) @ weight.abs().t() * 1.001 + 1e-5


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("bias", [True, False])
def test_matches_the_dense_reference_and_the_torch_op(library, packed_case, kind, bias):
    """d_in 576 in blocks of 256: a ragged 64-wide last block. The stream (1, 3, 4 tokens), then
    tiles (float) or the integer products (int8 and int4 at every T), whose x is quantized to
    int8: those agree with the reference to x's quantization, and with the torch op's same product."""
    layer = _layer(packed_case, kind, bias=bias)
    session = _session(_model(layer))
    reference = layer.unpack().float()
    for tokens in (1, 3, 4, 8, 40):
        x = torch.randn(tokens, 576)
        out = _run(session, layer, x)
        expected = F.linear(x, reference, layer.bias)
        scale = expected.abs().max().item()
        if kind in ("int4", "int8"):
            assert ((out - expected).abs() <= _x_quantization_bound(layer, x) + 1e-5 * scale).all()
        else:
            torch.testing.assert_close(out, expected, atol=1e-5 * scale, rtol=0)
        torch.testing.assert_close(out, _torch_op(layer, x), atol=1e-5 * scale, rtol=1e-5)


@pytest.mark.parametrize("group,shape", [("1x64", (128, 320)), ("32x32", (100, 70)), ("16x16", (80, 96))])
def test_group_shapes_and_a_3d_input(library, packed_case, group, shape):
    """Ragged last blocks and output groups, empty blocks (conftest's cases); x [2, 5, d_in]."""
    layer = _layer(packed_case, "fp32", group, shape)
    session = _session(_model(layer, rank=3))
    for tokens in (1, 7):
        x = torch.randn(2, tokens, shape[1])
        out = _run(session, layer, x)
        assert out.shape == (2, tokens, shape[0])
        torch.testing.assert_close(out, F.linear(x, layer.unpack().float(), layer.bias), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_one_and_two_threads_and_repeated_runs_give_identical_output(library, packed_case, kind):
    """A layer above the parallel threshold: the split products cut it into the same pieces at any
    intra_op_num_threads, so y is bit for bit the same, run after run."""
    layer = _layer(packed_case, kind, shape=(1536, 576))
    model = _model(layer)
    one, two = _session(model, threads=1), _session(model, threads=2)
    for tokens in (1, 3, 40):
        x = torch.randn(tokens, 576)
        first = _run(two, layer, x)
        assert torch.equal(first, _run(one, layer, x))
        assert torch.equal(first, _run(two, layer, x))


def _corrupt(layer, **changes):
    """``layer``'s tensors with ``changes`` (name -> function of the tensor) applied, for _feeds."""
    class Corrupted:
        shape, spec = layer.shape, layer.spec
    for name in NAMES:
        tensor = getattr(layer, name)
        setattr(Corrupted, name, changes[name](tensor.clone()) if name in changes else tensor)
    return Corrupted


def _swap_in_first_block(rows):
    rows[[0, 1]] = rows[[1, 0]]
    return rows


def _set(index, value):
    def change(t):
        t[index] = value
        return t
    return change


BAD_LAYOUTS = {  # name: (kind, changes, what the error says)
    "row_idx unsorted": ("fp32", {"row_idx": _swap_in_first_block}, r"input 2 \(row_idx\) must rise strictly"),
    "row_idx past d_out": ("int8", {"row_idx": _set(-1, 96)}, r"input 2 \(row_idx\) .* \[0, d_out = 96\)"),
    "row_ptr end": ("fp32", {"row_ptr": _set(-1, 5)}, r"input 3 \(row_ptr\) must end at len\(row_idx\)"),
    "row_ptr start": ("int4", {"row_ptr": _set(0, 1)}, r"input 3 \(row_ptr\) must start at 0"),
    "values short": ("fp32", {"values": lambda t: t[:-1]}, r"input 1 \(values\) holds \d+ numbers, .* need \d+"),
    "int8 scales short": ("int8", {"scales": lambda t: t[:-1]}, r"input 5 \(scales\) .* int8 values need float32 "
                                                                r"scales \[\d+\]"),
    "int4 scales short": ("int4", {"scales": lambda t: t[:-2]}, r"input 5 \(scales\) holds \d+ float16 numbers"),
}


@pytest.mark.parametrize("case", sorted(BAD_LAYOUTS))
@pytest.mark.parametrize("tokens", [1, 8])  # checked by the stream as it goes, by the other products first
def test_bad_layouts_are_one_line_errors(library, packed_case, case, tokens):
    kind, changes, message = BAD_LAYOUTS[case]
    layer = _layer(packed_case, kind)
    session = _session(_model(layer))
    x = torch.randn(tokens, 576)
    with pytest.raises(ORT_ERRORS, match=message) as error:
        _run(session, _corrupt(layer, **changes), x)
    assert "gmc GroupSparseLinear: " in str(error.value) and "\n" not in str(error.value).strip()
    torch.testing.assert_close(_run(session, layer, x), _torch_op(layer, x))  # the session still runs


@pytest.mark.parametrize("kind,changes,message", [
    ("fp32", {"values": lambda t: t.half()}, r"input 1 \(values\) float16 \[\d+\]: float32, int8 or uint8"),
    ("int8", {"scales": lambda t: t.half()}, r"input 5 \(scales\) float16 \[\d+\]: int8 values need float32"),
    ("int4", {"scales": lambda t: t.float()}, r"input 5 \(scales\) float32 \[\d+\]: int4 \(uint8\) values need "
                                              r"float16"),
])
def test_wrong_dtypes_are_one_line_errors(library, packed_case, kind, changes, message):
    layer = _corrupt(_layer(packed_case, kind), **changes)
    with pytest.raises(ORT_ERRORS, match=message):
        _run(_session(_model(layer)), layer, torch.randn(1, 576))


def test_a_layer_that_keeps_nothing_is_its_bias(library, packed_case):
    layer = _layer(packed_case, "int8", "1x64", (32, 128), sparsity=1.0)
    assert layer.values.numel() == 0
    out = _run(_session(_model(layer)), layer, torch.randn(3, 128))
    torch.testing.assert_close(out, layer.bias.expand(3, 32))


def test_x_of_another_width_than_row_ptr_is_an_error(library, packed_case):
    layer = _layer(packed_case, "fp32")  # d_in 576: row_ptr holds G_in + 1 = 4 offsets
    session = _session(_model(layer))
    with pytest.raises(ORT_ERRORS, match=r"input 3 \(row_ptr\) int32 \[4\]: int32 \[3\] expected .*d_in 512"):
        _run(session, layer, torch.randn(1, 512))


def test_missing_attribute_fails_the_session(library, packed_case):
    layer = _layer(packed_case, "fp32")
    model = onnx.load_from_string(_model(layer))
    del model.graph.node[0].attribute[:]  # neither d_out nor g_in
    with pytest.raises(ORT_ERRORS, match="attribute d_out"):
        _session(model.SerializeToString())


def test_the_library_links_no_onnxruntime(library):
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("no readelf")
    needed = subprocess.run([readelf, "-d", str(library)], capture_output=True, text=True).stdout
    assert "libonnxruntime" not in needed and "libgomp" not in needed


def _copy(library, tmp_path):
    for name in (ort_ops.LIBRARY, ort_ops.STAMP):
        shutil.copy(library.with_name(name), tmp_path / name)
    return tmp_path / ort_ops.LIBRARY


def _edit_stamp(path, **changes):
    stamp_path = path.with_name(ort_ops.STAMP)
    stamp_path.write_text(json.dumps({**json.loads(stamp_path.read_text()), **changes}))


def test_a_copy_of_gmcs_build_registers(library, packed_case, tmp_path):
    copy = _copy(library, tmp_path)
    assert ort_ops.check_library(copy)["sha256"] == ort_ops.check_library(library)["sha256"]
    options = ort.SessionOptions()
    assert ort_ops.register(options, copy) == copy


def test_check_library_refuses_a_tampered_library(library, tmp_path):
    copy = _copy(library, tmp_path)
    data = bytearray(copy.read_bytes())
    data[len(data) // 2] ^= 0xFF
    copy.write_bytes(bytes(data))
    with pytest.raises(GmcError, match="sha256 differs from its stamp's"):
        ort_ops.check_library(copy)
    options = ort.SessionOptions()
    with pytest.raises(GmcError, match="sha256 differs"):
        ort_ops.register(options, copy)


def test_check_library_refuses_a_library_without_its_stamp(library, tmp_path):
    shutil.copy(library, tmp_path / ort_ops.LIBRARY)
    with pytest.raises(GmcError, match=f"no {ort_ops.STAMP} beside it"):
        ort_ops.check_library(tmp_path / ort_ops.LIBRARY)


@pytest.mark.parametrize("changes,message", [
    ({"platform": "Linux-aarch64-glibc2.36"}, "built for Linux-aarch64-glibc2.36, this host is"),
    ({"cpu_flags_needed": ["avx512f", "no_such_isa"]}, "built for a CPU with no_such_isa, which this CPU lacks"),
])
def test_check_library_refuses_a_stamp_for_another_host(library, tmp_path, changes, message):
    copy = _copy(library, tmp_path)
    _edit_stamp(copy, **changes)
    with pytest.raises(GmcError, match=message):
        ort_ops.check_library(copy)


def test_check_library_refuses_a_library_gmc_did_not_build(library, tmp_path):
    """A stamp that matches its file proves nothing about who wrote both: the sha256 must be one of
    gmc's own builds in this cache."""
    copy = _copy(library, tmp_path)
    copy.write_bytes(copy.read_bytes() + b"\0")
    _edit_stamp(copy, sha256=ort_ops._sha256(copy))
    with pytest.raises(GmcError, match="not a library gmc built"):
        ort_ops.check_library(copy)
