"""Triton kernels for ``gmc::group_sparse_linear`` on the packed BSC format (``gmc/kernels/packed.py``).

Pseudo-code of one program, which owns input block ``v``, a tile of ``BLOCK_R`` of that block's
kept rows and a tile of ``BLOCK_T`` tokens::

    rows  = row_idx[row_ptr[v] + r_tile]                     # [BLOCK_R] output rows
    acc   = 0                                                # [BLOCK_T, BLOCK_R] fp32
    for k in range(0, w_v, BLOCK_K):                         # w_v = width of block v (<= g_in)
        a = x[t_tile, v*g_in + k : ...]                      # [BLOCK_T, BLOCK_K]
        b = values_v[k : k + BLOCK_K, r_tile]                # [BLOCK_K, BLOCK_R], contiguous in r
        acc += a @ b
    atomic_add(out[t_tile, rows], acc)                       # blocks sharing a row add up

Two kernels tell that story for the two regimes:
- decode (``T <= DECODE_MAX_TOKENS``; 8 in fp32): memory bound. One token tile covers all tokens, so every
  kept weight is loaded exactly once; the product is a broadcast multiply-and-sum on CUDA cores.
- prefill: compute bound. ``tl.dot`` on ``[BLOCK_T, BLOCK_K] x [BLOCK_K, BLOCK_R]`` tiles (tensor
  cores for fp16/bf16; fp32 uses IEEE precision so it matches the reference to 1e-4; under the interpreter bf16 tiles are upcast because
  its bf16 ``tl.dot`` is wrong).
Both accumulate into an fp32 output with atomics (a row receives one add per kept input block,
so contention is at most ``G_in``-way); the wrapper adds the bias and casts to the input dtype.
The grid is ``(G_in, cdiv(d_out, BLOCK_R), token tiles)``: it is sized without reading
``row_ptr`` on the host, and programs past a block's ``R_v`` rows return at once.

Set ``TRITON_INTERPRET=1`` before importing triton to run these kernels on CPU (tests); the
autotuner then uses a single config.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from gmc.errors import GmcError
from gmc.kernels.inputs import check_inputs

DECODE_MAX_TOKENS = 16
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

if _INTERPRET:
    _DECODE_CONFIGS = [triton.Config({"BLOCK_R": 64, "BLOCK_K": 64}, num_warps=4)]
    _PREFILL_CONFIGS = [triton.Config({"BLOCK_T": 32, "BLOCK_R": 64, "BLOCK_K": 32}, num_warps=4)]
else:
    _DECODE_CONFIGS = [
        triton.Config({"BLOCK_R": r, "BLOCK_K": k}, num_warps=w)
        for r, k, w in [(64, 64, 4), (128, 32, 4), (128, 64, 4), (256, 32, 8), (32, 128, 4), (64, 128, 4)]
    ]
    _PREFILL_CONFIGS = [
        triton.Config({"BLOCK_T": t, "BLOCK_R": r, "BLOCK_K": k}, num_warps=w, num_stages=s)
        for t, r, k, w, s in [
            (64, 64, 32, 4, 3),
            (64, 128, 32, 4, 3),
            (128, 64, 32, 4, 3),
            (128, 128, 32, 8, 3),
            (64, 128, 64, 4, 4),
            (128, 128, 64, 8, 3),
            (32, 64, 64, 4, 4),
        ]
    ]


@triton.autotune(configs=_DECODE_CONFIGS, key=["d_out", "d_in", "g_in", "BLOCK_T"], reset_to_zero=["out_ptr"])
@triton.jit
def _decode_kernel(
    x_ptr,  # [T, d_in] activations, any strides
    values_ptr,  # [nnz] packed values; block v is [w_v, R_v] row-major at row_ptr[v] * g_in
    row_idx_ptr,  # [R] int64 (or int32) output row of each kept row
    row_ptr_ptr,  # [G_in + 1] int32 offsets of each block's kept rows
    out_ptr,  # [T, d_out] fp32 accumulator, zero on entry
    T, d_in, d_out, g_in,
    stride_xt, stride_xk, stride_ot, stride_or,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    v = tl.program_id(0)
    r_tile = tl.program_id(1)
    row_start = tl.load(row_ptr_ptr + v)
    n_rows = tl.load(row_ptr_ptr + v + 1) - row_start
    if r_tile * BLOCK_R >= n_rows:
        return
    width = tl.minimum(g_in, d_in - v * g_in)
    offs_r = r_tile * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    mask_r = offs_r < n_rows
    rows = tl.load(row_idx_ptr + row_start + offs_r, mask=mask_r, other=0)
    offs_t = tl.arange(0, BLOCK_T)  # [BLOCK_T]
    mask_t = offs_t < T
    block_ptr = values_ptr + row_start.to(tl.int64) * g_in
    acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
    for k in range(0, width, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        mask_k = offs_k < width
        a = tl.load(
            x_ptr + offs_t[:, None] * stride_xt + (v * g_in + offs_k)[None, :] * stride_xk,
            mask=mask_t[:, None] & mask_k[None, :], other=0.0,
        ).to(tl.float32)  # [BLOCK_T, BLOCK_K]
        b = tl.load(
            block_ptr + offs_k[:, None] * n_rows + offs_r[None, :],
            mask=mask_k[:, None] & mask_r[None, :], other=0.0,
        ).to(tl.float32)  # [BLOCK_K, BLOCK_R]
        acc += tl.sum(a[:, :, None] * b[None, :, :], axis=1)
    out = out_ptr + offs_t[:, None] * stride_ot + rows[None, :] * stride_or
    tl.atomic_add(out, acc, mask=mask_t[:, None] & mask_r[None, :])


@triton.autotune(configs=_PREFILL_CONFIGS, key=["d_out", "d_in", "g_in", "t_bucket"], reset_to_zero=["out_ptr"])
@triton.jit
def _prefill_kernel(
    x_ptr,  # [T, d_in] activations, any strides
    values_ptr,  # [nnz] packed values; block v is [w_v, R_v] row-major at row_ptr[v] * g_in
    row_idx_ptr,  # [R] int64 (or int32) output row of each kept row
    row_ptr_ptr,  # [G_in + 1] int32 offsets of each block's kept rows
    out_ptr,  # [T, d_out] fp32 accumulator, zero on entry
    T, d_in, d_out, g_in, t_bucket,
    stride_xt, stride_xk, stride_ot, stride_or,
    INPUT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    v = tl.program_id(0)
    r_tile = tl.program_id(1)
    t_tile = tl.program_id(2)
    row_start = tl.load(row_ptr_ptr + v)
    n_rows = tl.load(row_ptr_ptr + v + 1) - row_start
    if r_tile * BLOCK_R >= n_rows:
        return
    width = tl.minimum(g_in, d_in - v * g_in)
    offs_r = r_tile * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    mask_r = offs_r < n_rows
    rows = tl.load(row_idx_ptr + row_start + offs_r, mask=mask_r, other=0)
    offs_t = t_tile * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    mask_t = offs_t < T
    block_ptr = values_ptr + row_start.to(tl.int64) * g_in
    acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
    for k in range(0, width, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        mask_k = offs_k < width
        a = tl.load(
            x_ptr + offs_t[:, None] * stride_xt + (v * g_in + offs_k)[None, :] * stride_xk,
            mask=mask_t[:, None] & mask_k[None, :], other=0.0,
        )  # [BLOCK_T, BLOCK_K]
        b = tl.load(
            block_ptr + offs_k[:, None] * n_rows + offs_r[None, :],
            mask=mask_k[:, None] & mask_r[None, :], other=0.0,
        )  # [BLOCK_K, BLOCK_R]
        if DOT_UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
    out = out_ptr + offs_t[:, None] * stride_ot + rows[None, :] * stride_or
    tl.atomic_add(out, acc, mask=mask_t[:, None] & mask_r[None, :])


def triton_group_sparse_linear(x, values, row_idx, row_ptr, bias, d_out: int, g_in: int, scales=None,
                               traced: bool = False) -> torch.Tensor:
    """``x [..., d_in]`` -> ``[..., d_out]`` with the Triton kernels (fp16, bf16 or fp32 values).

    ``traced``: launch through ``torch.library.wrap_triton``, so a trace records each launch as a
    node Inductor compiles (``gmc.kernels.inline_on_cuda``); eager calls launch directly."""
    check_inputs(x, values, row_idx, row_ptr, bias, d_out, g_in, scales)
    if scales is not None:
        raise GmcError(f"group_sparse_linear: {'int8' if values.dtype == torch.int8 else 'int4'} packed values are "
                       "CPU-only (the compiled C++ kernel); on CUDA use the float packed layer")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise GmcError(f"triton group_sparse_linear supports float16, bfloat16 and float32, got {x.dtype}")
    if not (x.is_cuda or _INTERPRET):
        raise GmcError("triton group_sparse_linear needs a CUDA tensor (or TRITON_INTERPRET=1); "
                       "use the CPU backend `--backend torch`")
    d_in = x.shape[-1]
    x2 = x.reshape(-1, d_in)  # [T, d_in]
    T = x2.shape[0]
    G_in = row_ptr.numel() - 1
    out = torch.zeros(T, d_out, device=x.device, dtype=torch.float32)  # [T, d_out]
    if T > 0 and values.numel() > 0:
        common = (x2, values, row_idx, row_ptr, out, T, d_in, d_out, g_in)
        strides = (x2.stride(0), x2.stride(1), out.stride(0), out.stride(1))
        launch = torch.library.wrap_triton if traced else (lambda kernel: kernel)
        # fp32 stops at 8 tokens: at a 16-token tile Triton turns the decode kernel's multiply-sum into a
        # TF32 dot (4e-4 relative error, measured on an H200); the prefill kernel's dot is IEEE fp32
        if T <= (DECODE_MAX_TOKENS // 2 if x.dtype == torch.float32 else DECODE_MAX_TOKENS):
            block_t = max(1, triton.next_power_of_2(T))
            grid = lambda meta: (G_in, triton.cdiv(d_out, meta["BLOCK_R"]))
            launch(_decode_kernel)[grid](*common, *strides, BLOCK_T=block_t)
        else:
            precision = "ieee" if x.dtype == torch.float32 else "tf32"
            # The interpreter's bf16 tl.dot returns garbage (triton 3.9); upcast there only.
            upcast = _INTERPRET and x.dtype == torch.bfloat16
            grid = lambda meta: (G_in, triton.cdiv(d_out, meta["BLOCK_R"]), triton.cdiv(T, meta["BLOCK_T"]))
            launch(_prefill_kernel)[grid](*common, triton.next_power_of_2(T), *strides, INPUT_PRECISION=precision,
                                          DOT_UPCAST=upcast)
    if bias is not None:
        out += bias
    return out.to(x.dtype).reshape(*x.shape[:-1], d_out)
