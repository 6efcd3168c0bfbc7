"""Triton kernel for ``gmc::group_sparse_linear`` on CUDA: the tiled layout (``gmc/kernels/tiled.py``).

One program owns ``SUB_R`` output rows of a tile and ``BLOCK_T`` tokens, and walks the tile's
entries (its non-empty input blocks) in one pipelined loop::

    acc = 0                                                   # [BLOCK_T, SUB_R] fp32, registers
    for s in range(first_step, last_step):                    # its share of the tile's entries x chunks
        block, offset, word = entries[s // CH]                # word: this slice's kept rows and ranks
        rank  = base(word) + popcount(word & bits below row)  # where each kept row is stored
        w = values[offset + rank * rs + chunk : ...]          # [SUB_R, BLOCK_K], pruned rows not read
        a = x[t_tile, block*g_in + chunk : ...]               # [BLOCK_T, BLOCK_K]
        acc += a @ w.T                                        # tensor cores (fp32: IEEE or TF32)
    out[t_tile, rows] = (acc + bias).to(x.dtype)              # each output written once

Every kept weight is read once per token tile and no pruned one is read (masked rows issue no
loads); a stored row is 16-byte aligned and ``rs`` a multiple of 16 bytes, so the value loads are
128 bits wide. A step is one entry (``_one_entry``: float and int8 values, two-dimensional tiles)
or several entries side by side (``_entries``: int4 values, whose codes are dequantized as
``q * d + m`` per 32 columns in registers, and blocks narrower than a step; or, one token of int4
codes with ``KernelConfig.dot4``, ``_entries_dot4``: x quantized to int8 per 32 columns in the program
and the codes multiplied by integer dot products, no float weights). A program of
``BLOCK_T`` >= 16 token rows multiplies on tensor cores; a one-token decode program multiplies on
CUDA cores, summing per column in registers and over k once after the loop, with no 16-row x tile
in shared memory and its loads pipelined ``num_stages`` deep. With ``SPLIT`` > 1 the programs of
one output tile share its entries: each stores its partial sums in a workspace and takes one
acq_rel ticket, and the last to arrive adds the partial sums in split order (so every call gives
the same numbers), adds the bias, writes the output and resets its counter, so the workspace
needs no memset. Either way the op is one launch.

The block sizes are fixed per shape (``choose_config``), so an eager call, a CUDA graph and an
Inductor-compiled program launch the same kernel, without autotuning on zero-filled inputs:
- decode (``T <= DECODE_MAX_TOKENS``): memory bound. 16 token rows (the smallest ``tl.dot``), a
  tile's rows in slices, int4 tiles split between programs;
- prefill: compute bound. 64-128 tokens by a whole tile, so an input tile is read once per tile
  rows; a tile of a 2-D group layout skips the blocks it does not keep. From ``DENSE_PREFILL_TOKENS``
  tokens on a layer whose tiles keep most of their blocks (``dense_prefill``), the op instead writes
  the layer's dense weight into a workspace (``_dense_kernel``: each element once, the kept values read
  once, dequantized) and runs cuBLAS on it: two launches, near the dense GEMM's time, the weights
  still held packed.

Set ``TRITON_INTERPRET=1`` before importing triton to run the kernel on CPU (the tests).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from gmc.errors import GmcError
from gmc.kernels.inputs import check_inputs
from gmc.kernels.tiled import ENTRY_HEAD, ROW_WORD, entry_tile_rows, is_tiled, quantized_kind, row_pad

DECODE_MAX_TOKENS = 16


def int4_decode_stages(triton_version: str) -> int:
    """Pipeline depth of a one-token int4 launch under a Triton release: 3 where Triton keeps the
    dequantized tile in registers (3.6 on an H200: 1.00x cuBLAS against 0.94x with 4 stages in the
    sweep, and its decode rows 0.86-1.01x against 0.79-0.96x), 4 from 3.9, whose 3 stages spill 8 bytes."""
    major, minor = (int(part) for part in triton_version.split(".")[:2])
    return 3 if (major, minor) < (3, 9) else 4


INT4_DECODE_STAGES = int4_decode_stages(triton.__version__)
# one-token int4 launches by integer dot products (``dot4_config``): off until a GPU times them (docs/gpu.md,
# "int4 by integer dot products"); ``bench/gpu_check.py`` turns it on for one end-to-end row
INT4_ONE_TOKEN_DOT4 = False
DEFAULT_SMS, DEFAULT_MAJOR = 132, 9  # the GPU assumed where none is asked (interpreter, static checks): an H100/H200
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_QUANT = {"none": 0, "int8": 1, "int4": 2}
_HEAD = tl.constexpr(ENTRY_HEAD)  # the layout's constants, as a jit function may read them
_WORD = tl.constexpr(ROW_WORD)


@triton.jit
def _popcount16(v):
    """Set bits of the low 16 bits of ``v`` (int32), lane by lane."""
    v = v - ((v >> 1) & 0x5555)
    v = (v & 0x3333) + ((v >> 2) & 0x3333)
    v = (v + (v >> 4)) & 0x0F0F
    return (v + (v >> 8)) & 0x1F


@triton.jit
def _codes_as_float(codes):
    """int4 codes (0..15, any integer type) as float32, exactly: each code written into the low mantissa bits
    of 2^23, minus 2^23 (an OR and a subtraction, where an integer-to-float conversion runs at a fraction of
    the FMA rate on NVIDIA GPUs)."""
    return (codes.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _dp4a(a, b, c, SIGNED: tl.constexpr, EMULATE: tl.constexpr):
    """``c`` plus the dot product of ``a``'s four bytes (unsigned, or ``SIGNED``) with ``b``'s four signed bytes,
    lane by lane (int32): one ``dp4a`` instruction on the GPU; ``EMULATE`` (the interpreter, which runs no
    PTX) the same integer sum by shifts."""
    if EMULATE:
        if SIGNED:
            a0, a1, a2, a3 = (a << 24) >> 24, (a << 16) >> 24, (a << 8) >> 24, a >> 24
        else:
            a0, a1, a2, a3 = a & 255, (a >> 8) & 255, (a >> 16) & 255, (a >> 24) & 255
        return c + a0 * ((b << 24) >> 24) + a1 * ((b << 16) >> 24) + a2 * ((b << 8) >> 24) + a3 * (b >> 24)
    elif SIGNED:
        return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                         is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                         is_pure=True, pack=1)


@triton.jit
def _pack_bytes(b, G: tl.constexpr, W: tl.constexpr):
    """``b [G, W, 4]`` bytes (int32 lanes, 0..255) as ``[G, W]`` int32 words, byte i of a word from ``b[..., i]``."""
    b0, b1 = tl.split(b.reshape(G, W, 2, 2))  # i = 2c + j: j = 0 (i = 0, 2) and j = 1 (i = 1, 3)
    c0, c1 = tl.split(b0 | (b1 << 8))  # c = 0: bytes 0, 1; c = 1: bytes 2, 3
    return c0 | (c1 << 16)


@triton.jit
def _x_words(a, GROUPS: tl.constexpr, NIBBLES: tl.constexpr):
    """One token's ``a [1, 32 GROUPS]`` quantized per 32 numbers as the CPU's integer products do (``x8 =
    round(x 127 / max|x|)``, halves away from zero): ``(lo, hi, scale, total)``: ``scale [GROUPS]`` = max|x| /
    127, ``total`` the group's sum of x, and x8 in int32 words. ``NIBBLES`` (against int4 codes): ``lo``/``hi
    [GROUPS, 4]``, word o of a group holding k = 8o, 8o + 2, 8o + 4, 8o + 6 in ``lo`` and the odd k in ``hi``
    (the nibbles of a code word masked in place); else (against int8 values) ``lo [GROUPS, 8]``, word o
    holding k = 4o .. 4o + 3 (``hi`` the same)."""
    x = a.to(tl.float32).reshape(GROUPS, 32)
    peak = tl.max(tl.abs(x), axis=1)
    v = x * tl.where(peak > 0, 127.0 / tl.where(peak > 0, peak, 1.0), 0.0)[:, None]
    x8 = (v + tl.where(v < 0, -0.5, 0.5)).to(tl.int32) & 255  # [GROUPS, 32]
    if NIBBLES:
        even, odd = tl.split(x8.reshape(GROUPS, 4, 4, 2))  # k = 8o + 2i + j: [GROUPS, 4 (o), 4 (i)]
        lo = _pack_bytes(even, GROUPS, 4)
        hi = _pack_bytes(odd, GROUPS, 4)
    else:
        lo = _pack_bytes(x8.reshape(GROUPS, 8, 4), GROUPS, 8)
        hi = lo
    return lo, hi, peak * (1.0 / 127.0), tl.sum(x, axis=1)


@triton.jit
def _one_entry(x_ptr, values_ptr, scales_ptr, entry, k, offs_t, mask_t, bit, below, word_at, d_in, stride_xt,
               stride_xk, G_IN: tl.constexpr, G_PAD: tl.constexpr, PAD: tl.constexpr, QUANT: tl.constexpr):
    """A step of one entry (float or int8 values): ``a [BLOCK_T, BLOCK_K]``, ``w [SUB_R, BLOCK_K]``."""
    block = tl.load(entry)
    word = tl.load(entry + word_at)  # [SUB_R]: 16 kept bits, then the entry's rows before them
    kept = ((word >> bit) & 1) != 0
    rank = (word >> 16) + _popcount16(word & below)  # [SUB_R] stored row of each kept row
    width = tl.minimum(d_in - block * G_IN, G_IN)
    rs = tl.multiple_of(tl.minimum((width + PAD - 1) // PAD * PAD, G_PAD), PAD)
    a = tl.load(x_ptr + offs_t[:, None] * stride_xt + (block * G_IN + k)[None, :] * stride_xk,
                mask=mask_t[:, None] & (k < width)[None, :], other=0.0)  # [BLOCK_T, BLOCK_K]
    w = tl.load(values_ptr + tl.load(entry + 1) * PAD + rank[:, None] * rs + k[None, :],
                mask=kept[:, None] & (k < rs)[None, :], other=0.0)  # [SUB_R, BLOCK_K]
    if QUANT == 1:
        scale = tl.load(scales_ptr + tl.load(entry + 2) + rank, mask=kept, other=0.0)  # [SUB_R]
        w = (w.to(tl.float32) * scale[:, None]).to(a.dtype)
    return a, w


@triton.jit
def _entry_rows(entry, valid, bit, below, word_at, d_in, G_IN: tl.constexpr, G_PAD: tl.constexpr,
                PAD: tl.constexpr):
    """Of ``SPAN`` entries (``entry``, ``valid`` ``[SPAN]``) and a program's ``SUB_R`` rows: ``(block, kept, rank,
    width, rs)``: each entry's input block and width ``[SPAN]``, whether each row is kept and where it is
    stored ``[SUB_R, SPAN]``, and the stored row length ``rs`` (a multiple of ``PAD``) ``[SPAN]``."""
    block = tl.load(entry, mask=valid, other=0)  # [SPAN]
    word = tl.load(entry[None, :] + word_at[:, None], mask=valid[None, :], other=0)  # [SUB_R, SPAN]
    kept = ((word >> bit[:, None]) & 1) != 0
    rank = (word >> 16) + _popcount16(word & below[:, None])  # [SUB_R, SPAN]
    width = tl.minimum(d_in - block * G_IN, G_IN)  # [SPAN]
    return block, kept, rank, width, tl.multiple_of(tl.minimum((width + PAD - 1) // PAD * PAD, G_PAD), PAD)


@triton.jit
def _entries(x_ptr, values_ptr, scales_ptr, entry, valid, chunk, k, offs_t, mask_t, bit, below, word_at, d_in,
             stride_xt, stride_xk, G_IN: tl.constexpr, G_PAD: tl.constexpr, PAD: tl.constexpr, QUANT: tl.constexpr,
             SUB_R: tl.constexpr, SPAN: tl.constexpr, KE: tl.constexpr, BLOCK_T: tl.constexpr,
             MANTISSA: tl.constexpr):
    """A step of ``SPAN`` entries x ``KE`` columns (``entry``, ``valid`` ``[SPAN]``), and any step of int4
    codes: ``a [BLOCK_T, SPAN KE]``, ``w [SUB_R, SPAN KE]`` (``MANTISSA``: int4 codes made floats by
    ``_codes_as_float``, and ``w`` left fp32 for CUDA-core products)."""
    block, kept, rank, width, rs = _entry_rows(entry, valid, bit, below, word_at, d_in, G_IN, G_PAD, PAD)
    a = tl.load(x_ptr + offs_t[:, None, None] * stride_xt
                + (block[None, :, None] * G_IN + k[None, None, :]) * stride_xk,
                mask=mask_t[:, None, None] & valid[None, :, None] & (k[None, None, :] < width[None, :, None]),
                other=0.0).reshape(BLOCK_T, SPAN * KE)
    if QUANT == 2:
        kb = chunk * (KE // 2) + tl.arange(0, KE // 2)  # [KE / 2] bytes of codes
        row_bytes = tl.multiple_of(rs // 2, 16)  # [SPAN]
        codes = tl.load(values_ptr + tl.load(entry + 1, mask=valid, other=0)[None, :, None] * 16
                        + rank[:, :, None] * row_bytes[None, :, None] + kb[None, None, :],
                        mask=kept[:, :, None] & (kb[None, None, :] < row_bytes[None, :, None]),
                        other=0)  # [SUB_R, SPAN, KE / 2]
        nibbles = tl.join(codes & 15, codes >> 4)  # k = 2j, 2j + 1
        if MANTISSA:
            q = _codes_as_float(nibbles).reshape(SUB_R, SPAN, KE // 32, 32)
        else:
            q = nibbles.reshape(SUB_R, SPAN, KE // 32, 32).to(tl.float32)
        g = chunk * (KE // 32) + tl.arange(0, KE // 32)  # [KE / 32] scale groups of 32 k
        at = (tl.load(entry + 2, mask=valid, other=0)[None, :, None] + rank[:, :, None] * (rs // 16)[None, :, None]
              + 2 * g[None, None, :])  # [SUB_R, SPAN, KE / 32]
        scaled = kept[:, :, None] & (g[None, None, :] < (rs // 32)[None, :, None])
        d = tl.load(scales_ptr + at, mask=scaled, other=0.0).to(tl.float32)
        m = tl.load(scales_ptr + at + 1, mask=scaled, other=0.0).to(tl.float32)
        w = (q * d[:, :, :, None] + m[:, :, :, None]).reshape(SUB_R, SPAN * KE)  # past a width: m x 0
        if (not MANTISSA) | (BLOCK_T >= 16):  # tensor cores take x's dtype
            w = w.to(a.dtype)
    else:
        w = tl.load(values_ptr + tl.load(entry + 1, mask=valid, other=0)[None, :, None] * PAD
                    + rank[:, :, None] * rs[None, :, None] + k[None, None, :],
                    mask=kept[:, :, None] & (k[None, None, :] < rs[None, :, None]), other=0.0)  # [SUB_R, SPAN, KE]
        if QUANT == 1:
            scale = tl.load(scales_ptr + tl.load(entry + 2, mask=valid, other=0)[None, :] + rank, mask=kept,
                            other=0.0)  # [SUB_R, SPAN]
            w = (w.to(tl.float32) * scale[:, :, None]).to(a.dtype)
        w = w.reshape(SUB_R, SPAN * KE)
    return a, w


@triton.jit
def _entries_dot4(x_ptr, values_ptr, scales_ptr, entry, valid, chunk, k, bit, below, word_at, d_in, stride_xk,
                  G_IN: tl.constexpr, G_PAD: tl.constexpr, PAD: tl.constexpr, QUANT: tl.constexpr,
                  SUB_R: tl.constexpr, SPAN: tl.constexpr, KE: tl.constexpr, EMULATE: tl.constexpr):
    """A one-token step of ``SPAN`` entries x ``KE`` columns of int8 or int4 values by integer dot products: x
    quantized per 32 columns (``_x_words``), the values read as 32-bit words and multiplied with words of x8 by
    ``dp4a``. int4: each word of 8 codes masked into its even and odd k nibbles, two ``dp4a``; per row and 32
    columns ``d (x_scale sum(q x8)) + m sum(x)``. int8: a word is 4 consecutive k of a row, one ``dp4a``; per
    row ``scale sum over 32 columns of x_scale sum(w8 x8)``. ``[SUB_R, SPAN KE / 32]`` fp32."""
    GROUPS: tl.constexpr = SPAN * KE // 32
    block, kept, rank, width, rs = _entry_rows(entry, valid, bit, below, word_at, d_in, G_IN, G_PAD, PAD)
    a = tl.load(x_ptr + (block[:, None] * G_IN + k[None, :]) * stride_xk,
                mask=valid[:, None] & (k[None, :] < width[:, None]), other=0.0).reshape(1, SPAN * KE)
    x_lo, x_hi, x_scale, x_sum = _x_words(a, GROUPS, QUANT == 2)
    PER_WORD: tl.constexpr = 8 if QUANT == 2 else 4  # values a 32-bit word
    kw = chunk * (KE // PER_WORD) + tl.arange(0, KE // PER_WORD)  # [KE / PER_WORD] words of the step
    row_words = tl.multiple_of(rs // PER_WORD, 4)  # [SPAN]
    codes = tl.load(values_ptr.to(tl.pointer_type(tl.int32))
                    + tl.load(entry + 1, mask=valid, other=0)[None, :, None] * (PAD // PER_WORD)
                    + rank[:, :, None] * row_words[None, :, None] + kw[None, None, :],
                    mask=kept[:, :, None] & (kw[None, None, :] < row_words[None, :, None]),
                    other=0).reshape(SUB_R, GROUPS, 32 // PER_WORD)
    if QUANT == 2:
        even = codes & 0x0F0F0F0F
        odd = (codes >> 4) & 0x0F0F0F0F
        sums = tl.sum(_dp4a(odd, x_hi[None, :, :], _dp4a(even, x_lo[None, :, :], 0, False, EMULATE), False, EMULATE),
                      axis=2)
        g = chunk * (KE // 32) + tl.arange(0, KE // 32)  # [KE / 32] scale groups of 32 k
        at = (tl.load(entry + 2, mask=valid, other=0)[None, :, None] + rank[:, :, None] * (rs // 16)[None, :, None]
              + 2 * g[None, None, :])  # [SUB_R, SPAN, KE / 32]
        scaled = kept[:, :, None] & (g[None, None, :] < (rs // 32)[None, :, None])
        d = tl.load(scales_ptr + at, mask=scaled, other=0.0).to(tl.float32).reshape(SUB_R, GROUPS)
        m = tl.load(scales_ptr + at + 1, mask=scaled, other=0.0).to(tl.float32).reshape(SUB_R, GROUPS)
        return d * (sums.to(tl.float32) * x_scale[None, :]) + m * x_sum[None, :]
    else:
        sums = tl.sum(_dp4a(codes, x_lo[None, :, :], 0, True, EMULATE), axis=2)  # [SUB_R, GROUPS]
        scale = tl.load(scales_ptr + tl.load(entry + 2, mask=valid, other=0)[None, :] + rank, mask=kept,
                        other=0.0)  # [SUB_R, SPAN]
        scale = tl.broadcast_to(scale[:, :, None], (SUB_R, SPAN, KE // 32)).reshape(SUB_R, GROUPS)
        return scale * (sums.to(tl.float32) * x_scale[None, :])


@triton.jit
def _tiled_kernel(
    x_ptr,  # [T, d_in] activations, any strides
    values_ptr,  # tiled values: each entry's kept rows, rs numbers a row (int4: rs / 2 bytes), 16-byte aligned
    entries_ptr,  # [E, ENTRY_HEAD + TILE_R / 16] int32: block, values offset (row_pad units), scales offset, words
    tile_ptr_ptr,  # [n_tiles + 1] int32: the entries of each tile
    bias_ptr,  # [d_out] (read only when HAS_BIAS)
    scales_ptr,  # int8: fp32 a stored row; int4: fp16 (d, m) per 32 k of a stored row (read when QUANT)
    out_ptr,  # [T, d_out] contiguous, x's dtype: written once, every element
    sums_ptr,  # SPLIT > 1: [>= SPLIT * T * d_out] fp32: each split program's partial sums
    arrived_ptr,  # SPLIT > 1: [>= programs / SPLIT] int32 zeros, left zero (programs done per output tile)
    T, d_in, d_out, row_programs,
    stride_xt, stride_xk,
    G_IN: tl.constexpr,  # input block width
    G_PAD: tl.constexpr,  # rs of a full block: G_IN rounded up to PAD
    PAD: tl.constexpr,  # values in an offset unit (row_pad): 8 float, 16 int8, 32 int4 codes
    TILE_R: tl.constexpr, SUB_R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,  # programs that share one output tile's entries (their partial sums in sums_ptr)
    QUANT: tl.constexpr,  # 0 float values, 1 int8, 2 int4
    HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    STAGES: tl.constexpr,  # the launch's num_stages: the loop's depth on CUDA cores, whose loads the launch's
    # own num_stages would not pipeline (it pipelines only what feeds a tl.dot)
    MANTISSA: tl.constexpr,  # KernelConfig.mantissa
    DOT4: tl.constexpr,  # KernelConfig.dot4 (one token, int8 or int4 values)
    EMULATE: tl.constexpr,  # the interpreter: integer dot products by shifts, not PTX
):
    pid = tl.program_id(0)
    split = pid % SPLIT
    output_tile = pid // SPLIT  # (row slice, token tile)
    slices: tl.constexpr = TILE_R // SUB_R
    row_program = output_tile % row_programs
    tile = row_program // slices
    local = (row_program % slices) * SUB_R + tl.arange(0, SUB_R)  # [SUB_R] rows of the tile
    rows = tile * TILE_R + local  # [SUB_R] output rows
    entry_width: tl.constexpr = _HEAD + TILE_R // _WORD
    # a step reads SPAN entries (consecutive blocks) x KE columns each: a long step when blocks are narrow
    KE: tl.constexpr = BLOCK_K if BLOCK_K < G_PAD else G_PAD
    SPAN: tl.constexpr = BLOCK_K // KE
    chunks: tl.constexpr = (G_PAD + KE - 1) // KE
    first = tl.load(tile_ptr_ptr + tile)
    last = tl.load(tile_ptr_ptr + tile + 1)
    groups = (last - first + SPAN - 1) // SPAN  # steps of SPAN entries, split evenly between SPLIT programs
    per_split = (groups + SPLIT - 1) // SPLIT
    begin = tl.minimum(split * per_split, groups) * chunks
    end = tl.minimum(split * per_split + per_split, groups) * chunks
    word_at = _HEAD + local // _WORD  # [SUB_R] each row's word in an entry
    bit = local % _WORD
    below = (tl.full([SUB_R], 1, tl.int32) << bit) - 1
    offs_t = (output_tile // row_programs) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    mask_t = offs_t < T
    # BLOCK_T >= 16: tensor cores (the smallest tl.dot); below, CUDA-core products summed per column in
    # registers and reduced over k once, after the loop (a decode step of a few tokens, no 16-row x tile)
    DOT: tl.constexpr = BLOCK_T >= 16
    acc = tl.zeros((BLOCK_T, SUB_R), dtype=tl.float32)
    # per-column sums (DOT4: per 32 columns)
    columns = tl.zeros((BLOCK_T, SUB_R, 1 if DOT else BLOCK_K // 32 if DOT4 else BLOCK_K), dtype=tl.float32)
    for s in tl.range(begin, end, num_stages=None if DOT else STAGES):  # a tl.dot pipelines its operands
        k = (s % chunks) * KE + tl.arange(0, KE)  # [KE] columns of each entry's block
        if DOT4:  # one token of int8 or int4 values: integer dot products, no float weights
            index = first + (s // chunks) * SPAN + tl.arange(0, SPAN)
            columns += _entries_dot4(x_ptr + (output_tile // row_programs) * stride_xt, values_ptr, scales_ptr,
                                     entries_ptr + index * entry_width, index < last, s % chunks, k, bit, below,
                                     word_at, d_in, stride_xk, G_IN, G_PAD, PAD, QUANT, SUB_R, SPAN, KE,
                                     EMULATE)[None, :, :]
        else:
            if (SPAN == 1) & (QUANT != 2):  # one entry a step: two-dimensional tiles, the shortest code
                entry = entries_ptr + (first + s // chunks) * entry_width
                a, w = _one_entry(x_ptr, values_ptr, scales_ptr, entry, k, offs_t, mask_t, bit, below, word_at,
                                  d_in, stride_xt, stride_xk, G_IN, G_PAD, PAD, QUANT)
            else:
                index = first + (s // chunks) * SPAN + tl.arange(0, SPAN)  # [SPAN] entries of this step
                a, w = _entries(x_ptr, values_ptr, scales_ptr, entries_ptr + index * entry_width, index < last,
                                s % chunks, k, offs_t, mask_t, bit, below, word_at, d_in, stride_xt, stride_xk,
                                G_IN, G_PAD, PAD, QUANT, SUB_R, SPAN, KE, BLOCK_T, MANTISSA)
            if DOT:
                if UPCAST:
                    a = a.to(tl.float32)
                    w = w.to(tl.float32)
                acc = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
            else:
                columns += a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    if not DOT:
        acc = tl.sum(columns, 2)
    outputs = offs_t[:, None] * d_out + rows[None, :]  # [BLOCK_T, SUB_R]
    written = mask_t[:, None] & (rows < d_out)[None, :]
    if SPLIT > 1:  # each program stores its partial sums; the last of the tile to arrive adds them up
        tl.store(sums_ptr + split * T * d_out + outputs, acc, mask=written)
        # every thread's stores are issued before the program counts itself in (one thread takes the ticket,
        # and its release orders what the program did before it); one ordered atomic a program
        tl.debug_barrier()
        arrived = tl.atomic_add(arrived_ptr + output_tile, 1, sem="acq_rel")
        finish = arrived == SPLIT - 1
        written = written & (tl.zeros([BLOCK_T, SUB_R], dtype=tl.int32) + arrived == SPLIT - 1)
        acc = tl.zeros((BLOCK_T, SUB_R), dtype=tl.float32)
        for part in tl.static_range(SPLIT):  # in split order, whoever arrives last: the same sums every call
            acc += tl.load(sums_ptr + part * T * d_out + outputs, mask=written, other=0.0, cache_modifier=".cg")
        tl.store(arrived_ptr + output_tile, 0, mask=finish)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=rows < d_out, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + outputs, acc.to(out_ptr.dtype.element_ty), mask=written)


@triton.jit
def _dense_kernel(
    values_ptr, entries_ptr, tile_ptr_ptr, scales_ptr,  # a tiled layer, as _tiled_kernel reads it
    dense_ptr,  # [d_out, d_in] contiguous: W_hat, written once, every element
    d_in, d_out,
    G_IN: tl.constexpr, G_PAD: tl.constexpr, PAD: tl.constexpr, TILE_R: tl.constexpr, SUB_R: tl.constexpr,
    KE: tl.constexpr,  # columns a chunk (a power of two; a block is G_PAD / KE chunks, rounded up)
    QUANT: tl.constexpr,
    SEARCH: tl.constexpr,  # halvings that find an entry among a tile's (at least log2 of the blocks + 1)
):
    """The layer's dense weight: program (row slice, input block) writes ``SUB_R`` rows x the block's columns,
    each kept row's values (dequantized) and zeros elsewhere, so ``dense`` needs no clearing first."""
    row_program = tl.program_id(0)
    block = tl.program_id(1)
    slices: tl.constexpr = TILE_R // SUB_R
    tile = row_program // slices
    local = (row_program % slices) * SUB_R + tl.arange(0, SUB_R)  # [SUB_R] rows of the tile
    rows = tile * TILE_R + local
    entry_width: tl.constexpr = _HEAD + TILE_R // _WORD
    first = tl.load(tile_ptr_ptr + tile)
    last = tl.load(tile_ptr_ptr + tile + 1)
    lo = first
    hi = last
    for _ in tl.static_range(SEARCH):  # the tile's first entry whose block is not below this one (blocks ascend)
        mid = (lo + hi) // 2
        before = (mid < hi) & (tl.load(entries_ptr + mid * entry_width, mask=mid < hi, other=0) < block)
        lo = tl.where(before, mid + 1, lo)
        hi = tl.where(before, hi, mid)
    found = (lo < last) & (tl.load(entries_ptr + lo * entry_width, mask=lo < last, other=-1) == block)
    entry = entries_ptr + lo * entry_width
    bit = local % _WORD
    hit = (tl.zeros([SUB_R], tl.int32) + found.to(tl.int32)) != 0  # (the interpreter's broadcast of a bool is int)
    word = tl.load(entry + _HEAD + local // _WORD, mask=hit, other=0)  # [SUB_R]; 0 without an entry: none kept
    kept = ((word >> bit) & 1) != 0
    rank = (word >> 16) + _popcount16(word & ((tl.full([SUB_R], 1, tl.int32) << bit) - 1))  # stored row
    width = tl.minimum(d_in - block * G_IN, G_IN)
    rs = tl.multiple_of(tl.minimum((width + PAD - 1) // PAD * PAD, G_PAD), PAD)
    values_at = tl.load(entry + 1, mask=found, other=0)
    scales_at = tl.load(entry + 2, mask=found, other=0)
    stored = (rows < d_out)[:, None]
    for chunk in tl.static_range((G_PAD + KE - 1) // KE):
        k = chunk * KE + tl.arange(0, KE)  # [KE] columns of the block
        if QUANT == 2:
            kb = chunk * (KE // 2) + tl.arange(0, KE // 2)  # [KE / 2] bytes of codes
            row_bytes = tl.multiple_of(rs // 2, 16)
            codes = tl.load(values_ptr + values_at * 16 + rank[:, None] * row_bytes + kb[None, :],
                            mask=kept[:, None] & (kb < row_bytes)[None, :], other=0)  # [SUB_R, KE / 2]
            q = tl.join(codes & 15, codes >> 4).reshape(SUB_R, KE // 32, 32).to(tl.float32)  # k = 2j, 2j + 1
            g = chunk * (KE // 32) + tl.arange(0, KE // 32)  # [KE / 32] scale groups
            at = scales_at + rank[:, None] * (rs // 16) + 2 * g[None, :]  # [SUB_R, KE / 32]
            scaled = kept[:, None] & (g < rs // 32)[None, :]
            d = tl.load(scales_ptr + at, mask=scaled, other=0.0).to(tl.float32)
            m = tl.load(scales_ptr + at + 1, mask=scaled, other=0.0).to(tl.float32)
            w = (q * d[:, :, None] + m[:, :, None]).reshape(SUB_R, KE)  # a pruned row: d = m = 0
        else:
            w = tl.load(values_ptr + values_at * PAD + rank[:, None] * rs + k[None, :],
                        mask=kept[:, None] & (k < rs)[None, :], other=0.0).to(tl.float32)  # [SUB_R, KE]
            if QUANT == 1:
                w = w * tl.load(scales_ptr + scales_at + rank, mask=kept, other=0.0)[:, None]
        tl.store(dense_ptr + rows[:, None] * d_in + (block * G_IN + k)[None, :], w.to(dense_ptr.dtype.element_ty),
                 mask=stored & (k < width)[None, :])


@dataclass(frozen=True)
class KernelConfig:
    """Block sizes and launch options of one launch."""

    block_t: int  # tokens a program: 16 or more on tensor cores, fewer (a power of two) on CUDA cores; 0: the
    # dense-weight launch (``plan_dense``), which reads no tokens
    sub_r: int  # output rows a program (a slice of a tile)
    block_k: int  # input columns a step (more than a block's: several entries a step)
    num_warps: int
    num_stages: int
    split: int = 1  # programs sharing an output tile's entries, their partial sums meeting in a workspace
    # int4 codes made floats through 2^23's mantissa (no integer-to-float conversion) and, below 16 tokens, the
    # dequantized weights kept fp32 (no round trip through x's dtype): 721 -> 654 instructions a one-token
    # step of a 1x256 layer on sm_90, 204 registers against 167 (docs/gpu.md); float and int8 values ignore it
    mantissa: bool = False
    # one token of int8 or int4 values by integer dot products: x quantized to int8 per 32 columns in each program
    # (as the CPU's integer products quantize it), the values read as 32-bit words and multiplied with x8 by dp4a
    # (an int4 word of 8 codes masked into its even and odd nibbles, two dp4a), the scales applied per 32
    # columns (docs/gpu.md); float values ignore it
    dot4: bool = False

    def __post_init__(self):
        if self.dot4 and (self.block_t != 1 or self.mantissa or self.block_k % 32):
            raise GmcError(f"KernelConfig.dot4 runs one token (block_t 1, got {self.block_t}), block_k a multiple "
                           f"of 32 (got {self.block_k}) and not with mantissa")


def dot4_config(config: KernelConfig, tile_r: int, g_pad: int, quantized: str) -> KernelConfig:
    """``config`` (a layer of ``tile_r``-row tiles and ``g_pad`` stored columns a block, int8 or int4 values) as one
    token by integer dot products (``KernelConfig.dot4``): 64-row slices of 2 warps and 256 columns a step
    (several narrow blocks; 128 for int4 blocks narrower than 64, whose scales then fill the registers: 8 bytes
    spilled on sm_80 at 256), so a thread's step reads 256 weights and its fixed work (the entries, x's
    quantization) is spread over four times the weights of 32 rows of 4 warps (int4 on a 1x256 layer, sm_90:
    2.5 against 6.1 instructions a weight; the float launches spill at 64 rows)."""
    several = g_pad & (g_pad - 1) == 0 and 256 % g_pad == 0
    block_k = 256 if several else min(_pow2_at_most(g_pad), 256)
    if quantized == "int4" and g_pad < 64:
        block_k = 128
    return dataclasses.replace(config, dot4=True, block_t=1, sub_r=min(64, tile_r), block_k=block_k, num_warps=2)


def choose_config(tokens: Optional[int], d_out: int, g_in: int, tile_r: int, dtype: torch.dtype, quantized: str,
                  sms: int = DEFAULT_SMS, ieee: bool = False, major: int = DEFAULT_MAJOR,
                  d_in: Optional[int] = None) -> KernelConfig:
    """The launch for ``tokens`` (None: not known until run time, as in a compiled prefill program) on a
    GPU of ``sms`` multiprocessors and compute capability ``major``; ``ieee``: fp32 products on CUDA
    cores (no TF32), whose operand tiles live in registers; ``d_in`` (default ``g_in``) sizes a split.
    The 16-bit decode and prefill picks are the fastest of ``bench/gpu_check.py --sections sweep`` on an
    H200 (docs/gpu.md); the rest keep every launch free of spills and its loads 16 bytes wide."""
    pad = row_pad(torch.uint8 if quantized == "int4" else dtype)
    g_pad = -(-g_in // pad) * pad
    if tokens is not None and tokens <= DECODE_MAX_TOKENS:
        return _decode_config(d_out, d_in or g_in, g_pad, tile_r, dtype, quantized, sms, tokens)
    if ieee:  # CUDA-core products keep both operand tiles in registers: small tiles (8 warps: int4's too), no spills
        return KernelConfig(32, min(tile_r, 32), min(_pow2_at_most(g_pad), 32), 8 if quantized == "int4" else 4, 2)
    block_t = 128 if tokens is None or tokens >= 128 else 64
    sub_r = min(tile_r, 128)
    warps = 8 if block_t * sub_r >= 128 * 128 else 4
    if major < 9:  # mma.sync keeps B fragments in registers: a shorter k step avoids spills on sm_80
        return KernelConfig(block_t, sub_r, min(_pow2_at_most(g_pad), 32), warps, 4)
    return KernelConfig(block_t, sub_r, min(_pow2_at_most(g_pad), 32 if dtype == torch.float32 else 64), warps, 3)


def _decode_config(d_out: int, d_in: int, g_pad: int, tile_r: int, dtype: torch.dtype, quantized: str,
                   sms: int, tokens: int) -> KernelConfig:
    """Decode is bound by the bytes in flight on each multiprocessor, so the launch is the one the H200
    sweep measured fastest (docs/gpu.md), with enough programs to keep every multiprocessor busy:

    - one token (float or int4 values): CUDA-core products of one token row (no 16-row x tile in
      shared memory), 32-row slices, 256 columns a step (four 64-wide blocks a step; 128 of int4
      blocks narrower than 64), 3 stages; a tile's entries split until about two programs share a
      multiprocessor (int4: four, ``INT4_DECODE_STAGES``);
    - 2-16 tokens, and int8 values: tensor cores on 16 token rows, 32-row slices, one block a step,
      5 stages; split until about four programs share a multiprocessor (int4: three);
    - a float layer of 256-wide blocks too small to fill the GPU with its 32-row slices (its entries
      split, as q/k/v/o and down of a 7B model on an H200): at the same split, 16-row slices of 2 warps
      and 4 stages at one token (1.22x / 1.29x cuBLAS against 1.14x with 32 rows), 64-row slices at
      2-16 tokens (1.10-1.26x against 1.05-1.15x); the layers that fill it alone (gate/up) were as fast
      or faster with 32 rows."""
    wide = dtype != torch.float32
    bits = {"none": torch.finfo(dtype).bits, "int8": 8, "int4": 4}[quantized]
    several = g_pad & (g_pad - 1) == 0 and 256 % g_pad == 0  # narrow blocks, several a step
    sub_r = min(32, tile_r)
    if tokens == 1 and quantized != "int8":
        block_k = 256 if several else min(_pow2_at_most(g_pad), 256)
        if not wide or (quantized == "int4" and g_pad < 64):
            block_k = min(block_k, 128)  # fp32 weights and sums, or eight int4 blocks' scales a step: registers
        block_t, warps = 1, 4
        stages, per_sm = (INT4_DECODE_STAGES, 4) if quantized == "int4" else (3, 2)
    elif quantized == "int4":
        block_k = 256 if several else min(_pow2_at_most(g_pad), 256)
        if not wide:
            block_k = min(block_k, 32)  # fp32 x beside dequantized weights: registers
        block_t, warps, stages, per_sm = 16, 4, 5, 3
    else:
        block_k = min(_pow2_at_most(g_pad), 256 if wide else 64 if quantized == "none" else 32)
        # a warp's 16-byte loads take 512 bytes a step: warps for the x tile, rows for the weights to match
        warps = max(1, min(4, 16 * block_k * torch.finfo(dtype).bits // (8 * 512)))
        while sub_r < tile_r and sub_r * block_k * bits < 8 * 512 * warps:
            sub_r *= 2
        block_t, stages, per_sm = 16, 5, 4
    steps = -(-(-(-d_in // g_pad)) // max(1, block_k // g_pad))  # steps of a tile's full run of entries
    split = max(1, min(per_sm * sms // row_programs(d_out, tile_r, sub_r), steps // 2))
    if split > 1 and wide and quantized == "none" and g_pad >= 256:
        if block_t == 1 and tile_r >= 16:
            sub_r, warps, stages = 16, 2, 4
        elif block_t == 16 and tile_r >= 64:
            sub_r = 64
    return KernelConfig(block_t, sub_r, block_k, warps, stages, split)


INTERPRET_PREFILL_BLOCK_T = 128  # under the interpreter, token tiles of this height from this many tokens


def default_config(x2: torch.Tensor, values: torch.Tensor, entries: torch.Tensor, scales, d_out: int, g_in: int,
                   gpu: tuple[int, int]) -> KernelConfig:
    """The config the op launches ``x2 [T, d_in]`` with (small tiles under the interpreter)."""
    tokens = x2.shape[0] if isinstance(x2.shape[0], int) else None
    if _INTERPRET:  # the interpreter runs every lane in numpy: small tiles keep the tests fast, and a prefill's
        # tall token tiles keep its programs few (a program costs the interpreter the same whatever its size)
        pad = row_pad(values.dtype)
        block_t = INTERPRET_PREFILL_BLOCK_T if tokens is not None and tokens >= INTERPRET_PREFILL_BLOCK_T else 16
        config = KernelConfig(block_t, 16, min(_pow2_at_most(-(-g_in // pad) * pad), 64), 4, 1)
    else:
        config = choose_config(tokens, d_out, g_in, entry_tile_rows(entries), x2.dtype,
                               quantized_kind(values, scales), gpu[0], ieee=_precision(x2.dtype) == "ieee",
                               major=gpu[1], d_in=x2.shape[1])
    if tokens == 1 and quantized_kind(values, scales) == "int4" and INT4_ONE_TOKEN_DOT4:
        pad = row_pad(values.dtype)
        return dot4_config(config, entry_tile_rows(entries), -(-g_in // pad) * pad, "int4")
    return config


def _precision(dtype: torch.dtype) -> str:
    """The product's input precision: fp32 as cuBLAS runs it (TF32 when torch allows it), else tensor cores."""
    allowed = torch.backends.cuda.matmul.allow_tf32 and not _INTERPRET
    return "ieee" if dtype == torch.float32 and not allowed else "tf32"


def row_programs(d_out: int, tile_r: int, sub_r: int) -> int:
    """Programs along the rows: every tile in slices of ``sub_r`` rows."""
    return -(-d_out // tile_r) * (tile_r // sub_r)


def gpu_of(device: torch.device) -> tuple[int, int]:
    """``(multiprocessors, compute capability major)`` of ``device``'s GPU; the defaults (an H100) where
    none is asked or none is there (a trace, the static checks)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return DEFAULT_SMS, DEFAULT_MAJOR
    properties = torch.cuda.get_device_properties(device)
    return properties.multi_processor_count, properties.major


def _pow2_at_most(n: int) -> int:
    return 1 << (max(n, 16).bit_length() - 1)


@dataclass
class Launch:
    """One launch of ``_tiled_kernel`` (or ``_dense_kernel``): what ``triton_group_sparse_linear`` runs and
    ``gmc.kernels.triton_static`` compiles for a GPU it does not have."""

    grid: tuple
    args: tuple  # the kernel's run-time arguments, in order
    constexprs: dict  # its compile-time ones
    config: KernelConfig
    kernel: object = _tiled_kernel  # or _dense_kernel (plan_dense)


def plan_launch(x2, values, entries, tile_ptr, bias, out, d_out: int, g_in: int, scales=None,
                config: Optional[KernelConfig] = None, gpu: tuple[int, int] = (DEFAULT_SMS, DEFAULT_MAJOR),
                workspace: Optional[tuple] = None) -> Launch:
    """The launch that computes ``out [T, d_out] = x2 [T, d_in] @ W.T + bias`` for a tiled layer on ``gpu``
    (``gpu_of``); ``workspace``: ``(sums, arrived)`` tensors (counters zeroed) of at least ``workspace_sizes`` for a
    split launch (``_workspace``)."""
    T, d_in = x2.shape
    tile_r = entry_tile_rows(entries)
    config = config or default_config(x2, values, entries, scales, d_out, g_in, gpu)
    pad = row_pad(values.dtype)
    g_pad = -(-g_in // pad) * pad
    if config.block_k > g_pad and (g_pad & (g_pad - 1) or config.block_k % g_pad):
        raise GmcError(f"block_k {config.block_k} spans several blocks of {g_pad} columns only when {g_pad} is a "
                       f"power of two dividing it")
    dot4 = config.dot4 and quantized_kind(values, scales) != "none"  # float values ignore it
    if dot4 and g_pad % 32:
        raise GmcError(f"KernelConfig.dot4 quantizes x per 32 columns of a block: blocks of {g_pad} stored columns "
                       f"are not whole 32-column groups (int8 values need g_in a multiple of 32)")
    rows = row_programs(d_out, tile_r, config.sub_r)
    output_tiles = rows * ((T + config.block_t - 1) // config.block_t)
    sums, arrived = workspace if config.split > 1 else (x2, tile_ptr)  # unread when not split
    args = (x2, values, entries, tile_ptr, x2 if bias is None else bias, values if scales is None else scales, out,
            sums, arrived, T, d_in, d_out, rows, x2.stride(0), x2.stride(1))
    constexprs = dict(G_IN=g_in, G_PAD=g_pad, PAD=pad, TILE_R=tile_r, SUB_R=config.sub_r, BLOCK_T=config.block_t,
                      BLOCK_K=config.block_k, SPLIT=config.split, QUANT=_QUANT[quantized_kind(values, scales)],
                      HAS_BIAS=bias is not None, PRECISION=_precision(x2.dtype),
                      UPCAST=_INTERPRET and x2.dtype == torch.bfloat16,  # the interpreter's bf16 tl.dot is wrong
                      STAGES=config.num_stages, MANTISSA=config.mantissa,
                      DOT4=dot4, EMULATE=_INTERPRET)
    return Launch((output_tiles * config.split,), args, constexprs, config)


def workspace_sizes(tokens: int, d_out: int, tile_r: int, config: KernelConfig) -> tuple[int, int]:
    """``(sums, arrived)`` elements a split launch needs: one fp32 partial sum an output and split program,
    one counter an output tile."""
    return config.split * tokens * d_out, row_programs(d_out, tile_r, config.sub_r) * -(-tokens // config.block_t)


_WORKSPACES: dict = {}  # device -> (sums, arrived): the counters are zero between launches (the last program
# of a tile resets its own); the partial sums are written before they are read
_RETIRED: list = []  # outgrown workspaces: a recorded CUDA graph may still address them


def _workspace(device: torch.device, sizes: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The device's split workspace, grown to ``sizes``. Launches on one stream share it: each leaves it
    zero, and the next starts after it ends."""
    sums, arrived = _WORKSPACES.get(device, (None, None))
    if sums is None or sums.numel() < sizes[0] or arrived.numel() < sizes[1]:
        if sums is not None:
            _RETIRED.append((sums, arrived))
        have = (0, 0) if sums is None else (sums.numel(), arrived.numel())
        sums = torch.zeros(max(sizes[0], have[0]), dtype=torch.float32, device=device)
        arrived = torch.zeros(max(sizes[1], have[1]), dtype=torch.int32, device=device)
        _WORKSPACES[device] = (sums, arrived)
    return sums, arrived


# Prefill through the dense weight: from this many tokens, on layers whose tiles hold entries for at least
# this fraction of their (tile, input block) pairs. The tiled prefill multiplies every entry's rows densely
# at 0.40-0.45x cuBLAS (H200, docs/gpu.md), so once nearly every pair has an entry (1xG groups at any
# sparsity, 2-D groups at 50%) writing W_hat into a workspace (its bytes once, the kept ones read once) and
# running cuBLAS costs less: a 7B gate projection's 135 MB at the H200's measured 2.7 TB/s copy is ~49 us,
# beside its measured 241 us GEMM at 2,048 tokens (0.83x), ~60 us at 512 (0.55x). The modeled crossover
# with the tiled kernel lies near 320 tokens; sparse 2-D layers skip whole tiles.
DENSE_PREFILL_TOKENS = 512
DENSE_PREFILL_FILL = 0.5
DENSE_SUB_R = 32  # rows a dense-weight program writes, at least
DENSE_BYTES = 16 * 32 * 4  # bytes of values a dense-weight program reads a chunk: 16 a thread of 4 warps


def dense_prefill(tokens, entries: torch.Tensor, tile_ptr: torch.Tensor, d_in: int, g_in: int) -> bool:
    """Whether the op runs ``tokens`` through the dense weight and cuBLAS rather than the tiled kernel:
    a known count of at least ``DENSE_PREFILL_TOKENS`` on a layer with entries for at least
    ``DENSE_PREFILL_FILL`` of its (tile, block) pairs. A count known only at run time (a compiled prefill
    program) keeps the tiled kernel."""
    if not isinstance(tokens, int) or tokens < DENSE_PREFILL_TOKENS:
        return False
    pairs = (tile_ptr.shape[0] - 1) * -(-d_in // g_in)
    return entries.shape[0] >= DENSE_PREFILL_FILL * pairs


def plan_dense(values, entries, tile_ptr, dense, d_out: int, d_in: int, g_in: int, scales=None) -> Launch:
    """The launch that writes ``dense [d_out, d_in]`` (contiguous, a float dtype) = the tiled layer's weight."""
    tile_r = entry_tile_rows(entries)
    pad = row_pad(values.dtype)
    g_pad = -(-g_in // pad) * pad
    ke = min(128, triton.next_power_of_2(g_pad))
    blocks = -(-d_in // g_in)
    # a chunk's values, 16 bytes a thread: rows enough for 4 warps, or fewer warps where a tile has too few
    row_bytes = ke * values.element_size() // (2 if values.dtype == torch.uint8 else 1)
    sub_r = min(tile_r, max(DENSE_SUB_R, triton.next_power_of_2(-(-DENSE_BYTES // row_bytes))))
    warps = max(1, min(4, sub_r * row_bytes // (16 * 32)))
    config = KernelConfig(0, sub_r, ke, warps, 1)
    constexprs = dict(G_IN=g_in, G_PAD=g_pad, PAD=pad, TILE_R=tile_r, SUB_R=sub_r, KE=ke,
                      QUANT=_QUANT[quantized_kind(values, scales)], SEARCH=blocks.bit_length())
    args = (values, entries, tile_ptr, values if scales is None else scales, dense, d_in, d_out)
    return Launch((row_programs(d_out, tile_r, sub_r), blocks), args, constexprs, config, _dense_kernel)


_DENSE: dict = {}  # (device, dtype) -> the dense-weight workspace, grown to the largest layer prefilled


def _dense_workspace(device: torch.device, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """The workspace a prefill writes one layer's dense weight into: one layer's worth a device and dtype
    (a LLaMA-2-7B MLP projection in bf16: 86 MiB), written whole before each read."""
    have = _DENSE.get((device, dtype))
    if have is None or have.numel() < numel:
        if have is not None:
            _RETIRED.append(have)
        have = torch.empty(numel, dtype=dtype, device=device)
        _DENSE[(device, dtype)] = have
    return have[:numel]


def _launch(launch: Launch, traced: bool) -> None:
    kernel = torch.library.wrap_triton(launch.kernel) if traced else launch.kernel
    kernel[launch.grid](*launch.args, **launch.constexprs, num_warps=launch.config.num_warps,
                        num_stages=launch.config.num_stages)


def triton_group_sparse_linear(x, values, entries, tile_ptr, bias, d_out: int, g_in: int, scales=None,
                               traced: bool = False, config: Optional[KernelConfig] = None) -> torch.Tensor:
    """``x [..., d_in]`` -> ``[..., d_out]`` on a tiled layer (``gmc.kernels.tiled.tile``): fp16, bf16 or
    fp32 ``x``, with values of its dtype, int8 or int4.

    ``traced``: launch through ``torch.library.wrap_triton``, so a trace records the launch as one
    node Inductor compiles (``gmc.kernels.inline_on_cuda``), unsplit (a compiled program holds no
    workspace of gmc's); eager calls launch directly. ``config``: the block sizes (``choose_config``
    by default; benchmarks sweep them). Without one, a prefill that ``dense_prefill`` picks writes the
    layer's dense weight into a workspace (one launch of ``_dense_kernel``) and multiplies it with cuBLAS."""
    check_inputs(x, values, entries, tile_ptr, bias, d_out, g_in, scales)
    if not is_tiled(entries):
        raise GmcError("triton group_sparse_linear reads the tiled layout: convert a packed layer with "
                       "gmc.kernels.tiled.tile (GroupSparseLinear and the lowering passes do on CUDA)")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise GmcError(f"triton group_sparse_linear supports float16, bfloat16 and float32, got {x.dtype}")
    if not (x.is_cuda or _INTERPRET):
        raise GmcError("triton group_sparse_linear needs a CUDA tensor (or TRITON_INTERPRET=1); "
                       "use the CPU backend `--backend torch`")
    x2 = x.reshape(-1, x.shape[-1])  # [T, d_in]
    if config is None and dense_prefill(x2.shape[0], entries, tile_ptr, x2.shape[1], g_in):
        numel = d_out * x2.shape[1]
        dense = (torch.empty(numel, dtype=x.dtype, device=x.device) if traced  # a compiled program plans its buffers
                 else _dense_workspace(x.device, x.dtype, numel)).view(d_out, x2.shape[1])
        _launch(plan_dense(values, entries, tile_ptr, dense, d_out, x2.shape[1], g_in, scales), traced)
        return torch.nn.functional.linear(x2, dense, bias).reshape(*x.shape[:-1], d_out)
    out = torch.empty((x2.shape[0], d_out), device=x.device, dtype=x.dtype)  # [T, d_out]: the kernel writes all of it
    if isinstance(x2.shape[0], int) and x2.shape[0] == 0:
        return out.reshape(*x.shape[:-1], d_out)
    gpu = gpu_of(x.device)
    config = config or default_config(x2, values, entries, scales, d_out, g_in, gpu)
    if traced and config.split > 1:
        config = dataclasses.replace(config, split=1)
    workspace = None
    if config.split > 1:
        workspace = _workspace(x.device, workspace_sizes(x2.shape[0], d_out, entry_tile_rows(entries), config))
    _launch(plan_launch(x2, values, entries, tile_ptr, bias, out, d_out, g_in, scales, config, gpu, workspace), traced)
    return out.reshape(*x.shape[:-1], d_out)
