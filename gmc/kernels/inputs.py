"""The input contract of ``gmc::group_sparse_linear``, shared by every implementation.

``x [..., d_in]`` and ``values`` have one dtype, or ``values`` is int8 with fp32 ``scales [R]``
(one per kept row) or int4 (uint8, two codes a byte) with fp16 ``scales`` and ``x`` is
floating point; ``values`` is the flat buffer; ``bias`` is None or ``[d_out]``. The indices are
those of one of two layouts:
- packed (``gmc/kernels/packed.py``): ``row_idx`` 1-D int64 or int32, ``row_ptr`` int32 with
  ``G_in + 1 = ceil(d_in / g_in) + 1`` entries;
- tiled (``gmc/kernels/tiled.py``, what the CUDA kernel reads): ``row_idx`` is the 2-D int32
  ``entries`` table and ``row_ptr`` the int32 ``tile_ptr`` with ``ceil(d_out / tile_r) + 1`` entries.

The checks are cheap: shapes and dtypes, and for a packed layer on the host its ``G_in + 1`` row
pointers (``_check_blocks``: they rise from 0 to ``len(row_idx)`` and the blocks fill ``values``
and int4 ``scales`` exactly, what the C++ kernel's ``blocks_ok`` checks); nothing that needs a
device sync or the data of a traced tensor. The row indices themselves are O(kept rows): the
C++ kernel checks them, and loaders check the group indices they come from
(``gmc.kernels.packed.check_indices``). The compiled CPU kernel hands what it cannot run to the
torch implementation, which raises these errors.
"""
from __future__ import annotations

import torch

from gmc.errors import GmcError
from gmc.kernels.packed import INT4_GROUP, pointer_problem
from gmc.kernels.tiled import ENTRY_HEAD, entry_tile_rows


def check_inputs(x, values, row_idx, row_ptr, bias, d_out: int, g_in: int, scales=None) -> None:
    """Raise a GmcError naming the first input that breaks the contract."""
    if scales is None and values.dtype in (torch.int8, torch.uint8):
        kind = "int8" if values.dtype == torch.int8 else "int4 (uint8)"
        raise GmcError(f"group_sparse_linear: {kind} packed values need their scales (the op's scales argument)")
    if scales is None and x.dtype != values.dtype:
        raise GmcError(f"group_sparse_linear: x is {x.dtype} but the packed values are {values.dtype}")
    if scales is not None:
        if values.dtype not in (torch.int8, torch.uint8) or not x.is_floating_point():
            raise GmcError(f"group_sparse_linear: scales go with int8 or int4 (uint8) values and floating x, got "
                           f"values {values.dtype} and x {x.dtype}")
        if values.dtype == torch.int8 and (scales.dtype != torch.float32 or scales.dim() != 1
                                           or (row_idx.dim() == 1 and scales.numel() != row_idx.numel())):
            raise GmcError(f"group_sparse_linear: int8 scales must be float32 of shape ({row_idx.numel()},) "
                           f"(one per kept row), got {scales.dtype} {tuple(scales.shape)}")
        if values.dtype == torch.uint8 and (scales.dtype != torch.float16 or scales.dim() != 1 or g_in % 8):
            raise GmcError(f"group_sparse_linear: int4 values need 1-D float16 scales and g_in a multiple of 8, got "
                           f"{scales.dtype} {tuple(scales.shape)} and g_in={g_in}")
    if values.dim() != 1 or not values.is_contiguous():
        raise GmcError("group_sparse_linear: values must be a contiguous 1-D tensor (the packed buffer)")
    if row_idx.dim() == 2:
        _check_tiled(row_idx, row_ptr, d_out)
    elif row_idx.dim() != 1 or row_idx.dtype not in (torch.int32, torch.int64) or row_ptr.dtype != torch.int32:
        raise GmcError(f"group_sparse_linear: row_idx must be int64 or int32 and row_ptr int32, "
                       f"got {row_idx.dtype} and {row_ptr.dtype}")
    G_in = -(-x.shape[-1] // g_in)
    if row_idx.dim() == 1 and row_ptr.numel() != G_in + 1:
        raise GmcError(f"group_sparse_linear: row_ptr has {row_ptr.numel()} entries, expected {G_in + 1} "
                       f"for d_in={x.shape[-1]} and g_in={g_in}")
    if row_idx.dim() == 1 and _readable(row_ptr):
        _check_blocks(values, row_idx, row_ptr, x.shape[-1], g_in, scales)
    if bias is not None and bias.shape != (d_out,):
        raise GmcError(f"group_sparse_linear: bias has shape {tuple(bias.shape)}, expected ({d_out},)")


def _readable(tensor: torch.Tensor) -> bool:
    """A plain host tensor outside a trace: reading it costs no device sync and breaks no
    ``torch.export`` / ``torch.compile`` (fake and functional tensors are subclasses)."""
    return type(tensor) is torch.Tensor and tensor.device.type == "cpu" and not torch.compiler.is_compiling()


def _check_blocks(values, row_idx, row_ptr, d_in: int, g_in: int, scales) -> None:
    """A packed layer's row pointers rise from 0 to ``len(row_idx)`` and its blocks fill ``values``
    (and int4 ``scales``) exactly: a bad one would read past the buffers or skip a block in silence."""
    ptr = row_ptr.tolist()  # [G_in + 1]
    problem = pointer_problem(ptr, row_idx.numel(), "row_idx")
    if problem:
        raise GmcError(f"group_sparse_linear: row_ptr {problem}")
    int4 = values.dtype == torch.uint8
    rows = [ptr[-2], ptr[-1] - ptr[-2]]  # kept rows of the full-width blocks, of the last block
    widths = [g_in, d_in - (len(ptr) - 2) * g_in]
    expected = sum(n * ((w + 7) // 8 * 4 if int4 else w) for n, w in zip(rows, widths))
    if values.numel() != expected:
        raise GmcError(f"group_sparse_linear: values hold {values.numel()} numbers, row_ptr's blocks need {expected}")
    expected = sum(n * 2 * -(-w // INT4_GROUP) for n, w in zip(rows, widths))  # fp16 d and m per 32 k rows
    if int4 and scales.numel() != expected:
        raise GmcError(f"group_sparse_linear: int4 scales hold {scales.numel()} numbers, row_ptr's blocks "
                       f"need {expected}")


def _check_tiled(entries, tile_ptr, d_out: int) -> None:
    if entries.dtype != torch.int32 or entries.shape[1] <= ENTRY_HEAD or tile_ptr.dtype != torch.int32:
        raise GmcError(f"group_sparse_linear: a tiled layer's entries must be int32 [E, >{ENTRY_HEAD}] and its "
                       f"tile_ptr int32, got {entries.dtype} {tuple(entries.shape)} and {tile_ptr.dtype}")
    tiles = -(-d_out // entry_tile_rows(entries))
    if tile_ptr.dim() != 1 or tile_ptr.numel() != tiles + 1:
        raise GmcError(f"group_sparse_linear: tile_ptr has {tile_ptr.numel()} entries, expected {tiles + 1} "
                       f"for d_out={d_out} in tiles of {entry_tile_rows(entries)} rows")
