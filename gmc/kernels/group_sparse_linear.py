"""``gmc::group_sparse_linear``: ``y = x @ W_hat.T + b`` with ``W_hat`` in the packed BSC format.

Algorithm (``gmc/kernels/packed.py`` has the layout)::

    y = bias (or 0)                                   # [T, d_out]
    for each input block v:                           # G_in iterations, e.g. 16 for 4096 / 256
        y[:, rows_v] += x[:, cols_v] @ values_v       # [T, w_v] @ [w_v, R_v] -> [T, R_v]

Weight-only int8 (``gmc.kernels.quantize.quantize_int8``): ``values`` int8 and ``scales [R]`` fp32, one per
packed column; the block product becomes ``(x[:, cols_v] @ values_v) * scales_v``, accumulated in
fp32, output in ``x``'s dtype (float32 or bfloat16). Weight-only int4 (``quantize_int4``): ``values``
uint8 (two codes a byte) and fp16 ``scales`` (a scale and an offset per 32 k rows of a column).

Every kept weight is read once and no pruned weight is read. The op is the one entry point:
``GroupSparseLinear``, the lowered graph (``gmc.graph.passes.lower_group_sparse``) and ``torch.export``
all see ``torch.ops.gmc.group_sparse_linear`` (ONNX Runtime runs the same C++ core through
``gmc.kernels.ort_ops``).
Its schema is defined here, with ``torch.library`` rather than ``custom_op`` (whose Python
autograd layer costs ~10 us a call, visible on SmolLM2's 210 decode linears per token); its
implementations, by dispatch key:

- CPU: the fused C++ kernel of ``cpu_group_sparse.cpp``, which registers itself when its library
  is loaded (at the first float32 or bfloat16 CPU call): the dispatcher calls it without Python
  in between. It runs float32 and bfloat16 ``x`` with values of ``x``'s dtype, int8 or int4 (with
  scales), and hands everything else back to the torch implementation;
- CompositeExplicitAutograd (CPU before the C++ kernel is loaded or when it cannot be built,
  ``GMC_CPU_KERNEL=torch``, other dtypes, other devices, a tiled layer off CUDA): ``group_sparse_linear_torch``;
- CUDA: the Triton kernel of ``triton_group_sparse.py`` on the tiled layout (``gmc/kernels/tiled.py``;
  ``row_idx`` is then the 2-D entries table, ``row_ptr`` the tile pointers: ``GroupSparseLinear``
  and the lowering pass ``tile_for_cuda`` convert a packed layer when it moves to CUDA), float,
  int8 or int4 values, one launch a call; launched directly in eager code and traced into
  Inductor's graph when it compiles a CUDA program (``inline_on_cuda``: a compiled program then
  holds the kernel, no call back into Python);
- fake (``torch.export``, ``torch.compile``): the output shape.

Inference only: no autograd formula. ``cpu_backend()`` says which CPU implementation runs. The
reference every test compares against is ``F.linear(x, packed.unpack(), bias)``.
"""
from __future__ import annotations

from functools import partial

import torch

import gmc.kernels.cpu_group_sparse as cpu_group_sparse
from gmc.kernels.inline_on_cuda import inline_on_cuda
from gmc.kernels.inputs import check_inputs
from gmc.kernels.packed import block_values, int4_block
from gmc.kernels.tiled import TiledInputs, dense_weight, is_tiled

SCHEMA = ("group_sparse_linear(Tensor x, Tensor values, Tensor row_idx, Tensor row_ptr, Tensor? bias, "
          "int d_out, int g_in, Tensor? scales=None) -> Tensor")

# Above this many tokens the block products run transposed ([R_v, w_v] @ [w_v, T]) and are
# scattered along rows: measured faster for prefill on this CPU, slower for decode.
TRANSPOSED_MIN_TOKENS = 64

_lib = torch.library.Library("gmc", "DEF")
_lib.define(SCHEMA, tags=(torch.Tag.pt2_compliant_tag,))

group_sparse_linear = torch.ops.gmc.group_sparse_linear.default
"""``x [..., d_in]`` -> ``[..., d_out]``; ``values``/``row_idx``/``row_ptr``/``scales`` as in ``PackedLinear``."""


def group_sparse_linear_torch(x, values, row_idx, row_ptr, bias, d_out: int, g_in: int, scales=None) -> torch.Tensor:
    """Vectorised torch implementation: one GEMM/GEMV and one ``index_add_`` per input block.

    Views use ``as_strided``/``narrow`` rather than slicing: each op costs microseconds and a
    576-wide SmolLM2 projection has only three blocks, so per-block overhead is visible.
    int8 values are multiplied in fp32 and each block's product scaled per column; int4 blocks
    are dequantized to fp32 first.
    """
    check_inputs(x, values, row_idx, row_ptr, bias, d_out, g_in, scales)
    if is_tiled(row_idx):  # a CUDA layout off its device: multiply by its dense weight
        weight = dense_weight(TiledInputs(values, row_idx, row_ptr, scales), d_out, x.shape[-1], g_in)
        out = torch.nn.functional.linear(x.to(weight.dtype), weight, None if bias is None else bias.to(weight.dtype))
        return out.to(x.dtype)
    if scales is not None:
        return _quantized_torch(x, values, row_idx, row_ptr, bias, d_out, g_in, scales)
    d_in = x.shape[-1]
    x2 = x.reshape(-1, d_in)  # [T, d_in]
    T = x2.shape[0]
    ptr = row_ptr.tolist()
    base = values.storage_offset()  # as_strided offsets count from the storage start
    rows = row_idx.long()  # a no-op for PackedLinear's int64 rows; int32 index_add_ is ~5x slower
    if T >= TRANSPOSED_MIN_TOKENS:
        xT = x2.t().contiguous()  # [d_in, T]
        outT = x2.new_zeros(d_out, T)  # [d_out, T]
        for v in range(len(ptr) - 1):
            start, n_rows = ptr[v], ptr[v + 1] - ptr[v]
            if n_rows == 0:
                continue
            width = min(g_in, d_in - v * g_in)
            block = values.as_strided((n_rows, width), (1, n_rows), base + start * g_in)  # [R_v, w_v] view
            outT.index_add_(0, rows.narrow(0, start, n_rows), torch.mm(block, xT.narrow(0, v * g_in, width)))
        out = outT.t()
    else:
        out = x2.new_zeros(T, d_out)  # [T, d_out]
        for v in range(len(ptr) - 1):
            start, n_rows = ptr[v], ptr[v + 1] - ptr[v]
            if n_rows == 0:
                continue
            width = min(g_in, d_in - v * g_in)
            block = values.as_strided((width, n_rows), (n_rows, 1), base + start * g_in)  # [w_v, R_v] view
            out.index_add_(1, rows.narrow(0, start, n_rows), torch.mm(x2.narrow(1, v * g_in, width), block))
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], d_out).contiguous()


def _quantized_torch(x, values, row_idx, row_ptr, bias, d_out: int, g_in: int, scales) -> torch.Tensor:
    """``group_sparse_linear_torch`` for int8 values (``y[:, rows_v] += (x_v @ q_v) * scales_v`` in
    fp32) and int4 values (``y[:, rows_v] += x_v @ dequantized_v``)."""
    d_in = x.shape[-1]
    x2 = x.reshape(-1, d_in).float()  # [T, d_in]
    out = x2.new_zeros(x2.shape[0], d_out)  # [T, d_out] fp32
    ptr, rows = row_ptr.tolist(), row_idx.long()
    for v in range(len(ptr) - 1):
        start, n_rows = ptr[v], ptr[v + 1] - ptr[v]
        if n_rows == 0:
            continue
        width = min(g_in, d_in - v * g_in)
        if values.dtype == torch.uint8:
            block = int4_block(values, scales, g_in, start, n_rows, width)  # [w_v, R_v] fp32
            part = torch.mm(x2.narrow(1, v * g_in, width), block)  # [T, R_v]
        else:
            block = block_values(values, g_in, start, n_rows, width).float()  # [w_v, R_v]
            part = torch.mm(x2.narrow(1, v * g_in, width), block) * scales.narrow(0, start, n_rows)  # [T, R_v]
        out.index_add_(1, rows.narrow(0, start, n_rows), part)
    if bias is not None:
        out += bias
    return out.to(x.dtype).reshape(*x.shape[:-1], d_out)


def _composite(x, values, row_idx, row_ptr, bias, d_out, g_in, scales=None):
    # The first float32/bfloat16 CPU call loads the C++ kernel, which registers itself for CPU;
    # this call then goes to it too. Later calls reach this function only for what C++ hands back.
    if (x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
            and cpu_group_sparse.load_at_first_call()):
        return group_sparse_linear(x, values, row_idx, row_ptr, bias, d_out, g_in, scales)
    return group_sparse_linear_torch(x, values, row_idx, row_ptr, bias, d_out, g_in, scales)


def _cuda(x, values, row_idx, row_ptr, bias, d_out, g_in, scales=None, traced: bool = False):
    from gmc.kernels.triton_group_sparse import (
        triton_group_sparse_linear,  # imports triton: only on CUDA
    )

    return triton_group_sparse_linear(x, values, row_idx, row_ptr, bias, d_out, g_in, scales, traced=traced)


def _fake(x, values, row_idx, row_ptr, bias, d_out, g_in, scales=None):
    return x.new_empty((*x.shape[:-1], d_out))


_lib.impl("group_sparse_linear", _composite, "CompositeExplicitAutograd")
_lib.impl("group_sparse_linear", _cuda, "CUDA")
torch.library.register_fake("gmc::group_sparse_linear", _fake, lib=_lib)
inline_on_cuda("gmc::group_sparse_linear", _lib, partial(_cuda, traced=True))


def cpu_backend() -> str:
    """Which CPU implementation runs for float32 and bfloat16: ``compiled C++ (...)`` or ``torch (<why>)``."""
    return cpu_group_sparse.backend()
