"""``gmc::group_sparse_linear``: ``y = x @ W_hat.T + b`` with ``W_hat`` in the packed BSC format.

Algorithm (``gmc/packed.py`` has the layout)::

    y = bias (or 0)                                   # [T, d_out]
    for each input block v:                           # G_in iterations, e.g. 16 for 4096 / 256
        y[:, rows_v] += x[:, cols_v] @ values_v       # [T, w_v] @ [w_v, R_v] -> [T, R_v]

Every kept weight is read once and no pruned weight is read. One op is registered with
``torch.library`` so ``torch.export``, the lowering pass and the ONNX translation all see a single
node. CPU: ``group_sparse_linear_cpu`` runs the fused C++ kernel of ``cpu_group_sparse.cpp``
(compiled at first use, float32) and otherwise ``group_sparse_linear_torch``, vectorised torch
(no compiler, other dtypes, ``GMC_CPU_KERNEL=torch``); ``cpu_backend()`` says which runs. CUDA:
the Triton kernels of ``triton_group_sparse.py``. Inference only: no autograd.

``group_sparse_linear_reference`` is the torch reference twin: unpack to the dense masked weight
and call ``F.linear``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from gmc.errors import GmcError
from gmc.kernels import cpu_group_sparse

# Above this many tokens the block products run transposed ([R_v, w_v] @ [w_v, T]) and are
# scattered along rows: measured faster for prefill on this CPU, slower for decode.
TRANSPOSED_MIN_TOKENS = 64


@torch.library.custom_op("gmc::group_sparse_linear", mutates_args=())
def group_sparse_linear(
    x: torch.Tensor,
    values: torch.Tensor,
    row_idx: torch.Tensor,
    row_ptr: torch.Tensor,
    bias: Optional[torch.Tensor],
    d_out: int,
    g_in: int,
) -> torch.Tensor:
    """``x [..., d_in]`` -> ``[..., d_out]``; ``values``/``row_idx``/``row_ptr`` as in PackedLinear."""
    return group_sparse_linear_cpu(x, values, row_idx, row_ptr, bias, d_out, g_in)


@group_sparse_linear.register_fake
def _(x, values, row_idx, row_ptr, bias, d_out, g_in):
    return x.new_empty((*x.shape[:-1], d_out))


@group_sparse_linear.register_kernel("cuda")
def _(x, values, row_idx, row_ptr, bias, d_out, g_in):
    from gmc.kernels.triton_group_sparse import triton_group_sparse_linear

    return triton_group_sparse_linear(x, values, row_idx, row_ptr, bias, d_out, g_in)


def check_inputs(x, values, row_idx, row_ptr, bias, d_out: int, g_in: int) -> None:
    """Shape/dtype checks shared by every implementation (cheap: no device sync)."""
    if x.dtype != values.dtype:
        raise GmcError(f"group_sparse_linear: x is {x.dtype} but the packed values are {values.dtype}")
    if values.dim() != 1 or not values.is_contiguous():
        raise GmcError("group_sparse_linear: values must be a contiguous 1-D tensor (the packed buffer)")
    if row_idx.dtype not in (torch.int32, torch.int64) or row_ptr.dtype != torch.int32:
        raise GmcError(f"group_sparse_linear: row_idx must be int64 or int32 and row_ptr int32, "
                       f"got {row_idx.dtype} and {row_ptr.dtype}")
    G_in = -(-x.shape[-1] // g_in)
    if row_ptr.numel() != G_in + 1:
        raise GmcError(f"group_sparse_linear: row_ptr has {row_ptr.numel()} entries, expected {G_in + 1} "
                       f"for d_in={x.shape[-1]} and g_in={g_in}")
    if bias is not None and bias.shape != (d_out,):
        raise GmcError(f"group_sparse_linear: bias has shape {tuple(bias.shape)}, expected ({d_out},)")


def cpu_backend() -> str:
    """Which CPU implementation runs for float32: ``compiled C++ (...)`` or ``torch (<why>)``."""
    return cpu_group_sparse.backend()


def group_sparse_linear_cpu(
    x, values, row_idx, row_ptr, bias, d_out: int, g_in: int, rows_checked: bool = False
) -> torch.Tensor:
    """CPU implementation: the compiled kernel for float32 when it is built, else the torch path.

    The kernel needs ``row_idx`` ascending inside each block (``pack`` guarantees it); it is
    checked here (one pass over the indices) unless the caller already did (``rows_checked``,
    ``GroupSparseLinear`` checks once at construction). Unsorted indices take the torch path.
    """
    kernel = cpu_group_sparse.kernel() if x.dtype == torch.float32 else None
    if kernel is None:
        return group_sparse_linear_torch(x, values, row_idx, row_ptr, bias, d_out, g_in)
    check_inputs(x, values, row_idx, row_ptr, bias, d_out, g_in)
    rows = row_idx if row_idx.dtype == torch.int64 else row_idx.long()
    if not rows_checked and not kernel.rows_ascending(rows, row_ptr, d_out):
        return group_sparse_linear_torch(x, values, row_idx, row_ptr, bias, d_out, g_in)
    d_in = x.shape[-1]
    out = kernel.forward(x.reshape(-1, d_in).contiguous(), values, rows, row_ptr,
                         None if bias is None else bias.contiguous(), d_out, g_in, 0)  # [T, d_out]
    return out.view(*x.shape[:-1], d_out)


def rows_ascending(row_idx: torch.Tensor, row_ptr: torch.Tensor) -> bool:
    """True when ``row_idx`` is strictly ascending inside every block (the C++ kernel's precondition)."""
    R = row_idx.numel()
    ok = row_idx[1:] > row_idx[:-1]  # [R - 1]; entry i compares kept rows i and i + 1
    starts = row_ptr[1:-1].long()  # first kept row of blocks 1..G_in-1: no comparison across blocks
    ok[starts[(starts > 0) & (starts < R)] - 1] = True
    return bool(ok.all())


def group_sparse_linear_torch(x, values, row_idx, row_ptr, bias, d_out: int, g_in: int) -> torch.Tensor:
    """Vectorised torch fallback: one GEMM/GEMV and one ``index_add_`` per input block.

    Views use ``as_strided``/``narrow`` rather than slicing: each op costs microseconds and a
    576-wide SmolLM2 projection has only three blocks, so per-block overhead is visible.
    """
    check_inputs(x, values, row_idx, row_ptr, bias, d_out, g_in)
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


def group_sparse_linear_reference(x, values, row_idx, row_ptr, bias, d_out: int, g_in: int) -> torch.Tensor:
    """Reference twin: scatter the packed values into a dense masked weight, then ``F.linear``."""
    check_inputs(x, values, row_idx, row_ptr, bias, d_out, g_in)
    d_in = x.shape[-1]
    dense = values.new_zeros(d_out, d_in)  # [d_out, d_in]
    ptr = row_ptr.tolist()
    for v in range(len(ptr) - 1):
        start, n_rows = ptr[v], ptr[v + 1] - ptr[v]
        width = min(g_in, d_in - v * g_in)
        block = values[start * g_in : start * g_in + width * n_rows].view(width, n_rows)
        dense[row_idx[start : start + n_rows].long(), v * g_in : v * g_in + width] = block.t()
    return F.linear(x, dense, bias)
