"""The input contract of ``gmc::group_sparse_linear``, shared by every implementation.

``x [..., d_in]`` and ``values`` have one dtype; ``values`` is the flat packed buffer; ``row_idx``
is int64 or int32 and ``row_ptr`` int32 with ``G_in + 1 = ceil(d_in / g_in) + 1`` entries; ``bias``
is None or ``[d_out]`` (``gmc/packed.py`` has the layout). The checks are cheap: shapes and dtypes
only, no device sync. The compiled CPU kernel checks the same contract in C++ (plus the indices
themselves) and hands what it cannot run to the torch implementation, which raises these errors.
"""
from __future__ import annotations

import torch

from gmc.errors import GmcError


def check_inputs(x, values, row_idx, row_ptr, bias, d_out: int, g_in: int) -> None:
    """Raise a GmcError naming the first input that breaks the contract."""
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
