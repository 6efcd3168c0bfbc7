"""The packed group-sparse weight format: only kept groups are stored, plus compact indices.

Layout ("BSC": compressed over input-column blocks). For a group ``g_out x g_in`` on a weight
``W [d_out, d_in]`` with selectors ``B [G_out, G_in]``:

- input block ``v`` covers columns ``v*g_in : v*g_in + w_v`` with ``w_v = min(g_in, d_in - v*g_in)``
  (only the last block can be narrower: ragged ``d_in``);
- its kept rows are the rows of every output group ``u`` with ``B[u, v] = 1``, in ascending order,
  ``R_v`` of them (a ragged last output group contributes only its real rows);
- ``values`` is one flat buffer; block ``v`` is the ``[w_v, R_v]`` row-major matrix
  ``W[kept rows, block columns].T`` starting at offset ``row_ptr[v] * g_in`` (every block before
  the last has width ``g_in``, so this offset is exact and no padding is stored); int8 and int4
  blocks order their numbers in words (below).

Why this layout:
- ``y[:, rows_v] += x[:, block v] @ values_v`` is one dense GEMM/GEMV per input block, so a kernel
  reads every kept weight exactly once and never reads a pruned one (decode is memory bound, so
  the bytes read are the time);
- the input-major ``[w_v, R_v]`` block makes the decode product a vector-matrix product that
  streams contiguous memory (measured on this CPU: about 1.7x faster than a matrix-vector
  product over ``[R_v, w_v]`` rows), and gives Triton coalesced ``[BLOCK_K, BLOCK_R]`` tiles
  that feed ``tl.dot`` directly;
- within one block every output row appears at most once, so the scatter of a block's partial
  output needs no reduction; blocks are combined with an add (``index_add_`` / atomics);
- ragged shapes cost nothing: widths and heights are derived from ``(d_out, d_in, g_out, g_in)``.

On disk a layer is ``values`` plus ``group_idx`` (int32, the output-group index of each kept
group, block by block) and ``group_ptr`` (int32 ``[G_in + 1]``, CSR offsets into ``group_idx``):
4 bytes per kept *group*, so at 50% with 1x256 the weight bytes are about 0.502x dense.
The per-row ``row_idx`` (int64) / ``row_ptr`` (int32) the kernels use are rebuilt from them in
memory. ``check_indices`` holds every layer to the layout before that (``PackedLinear`` runs it, so
every loader does): ``group_ptr`` starts at 0, never decreases and ends at ``len(group_idx)``, and
each block's ``group_idx`` rises strictly within ``[0, G_out)``.

Weight-only int8 (made by ``gmc.kernels.quantize``): ``values`` int8 plus ``scales`` fp32 ``[R]``, one per
packed column (one kept row of one input block, aligned with ``row_idx``; for ``1xG`` groups one per
group): ``W_hat[row_idx[c], cols_v] = q_v[:, c] * scales[c]``. A column scale is what the
decode product needs: it multiplies one accumulator when that is added into ``y``. An int8 block's
codes ``q_v [w_v, R_v]`` are stored in words of 4 (``int8_block`` reads them, ``int8_stored`` writes
them): for each octet ``o`` of k rows, ``[2, R_v, 4]`` bytes, word ``(0, c)`` holding column ``c``'s k rows
``8o, 8o + 2, 8o + 4, 8o + 6`` and word ``(1, c)`` its k rows ``8o + 1, 8o + 3, 8o + 5, 8o + 7`` (the k rows
of the low and high nibbles of int4's bytes); the last ``w_v mod 8`` k rows follow row-major. A block
holds ``w_v * R_v`` bytes and k row ``8o`` starts at byte ``8o * R_v``, as in the float layout.
Why: a word is the operand of an integer dot product (4 int8 codes times 4 int8 activations per
32-bit lane: ``vpmaddubsw`` + ``vpmaddwd``, ``vpdpbusd``, ``dp4a``), so the CPU's decode and prefill
read a block's words as they are stored, one word a lane, where a row-major block had to be
converted to fp32 a weight at a time (decode) or repacked per call (prefill).

Weight-only int4 (made by ``gmc.kernels.quantize``): two 4-bit codes a byte and, for every ``INT4_GROUP``
(32) k rows of a packed column, an fp16 scale ``d`` and offset ``m``: ``w_hat = q * d + m``, ``q`` in
``0..15`` (asymmetric, as llama.cpp's Q4_1: 5 bits a weight with the scales). A block's columns
go in tiles of ``INT4_TILE`` (16; the last one narrower), one after another. Tile ``j`` of width
``tw`` holds codes ``[ceil(w_v / 8), tw, 4]`` bytes (for each octet ``o`` of k rows, column ``c``'s 8
codes in one 32-bit word, byte ``i`` holding k rows ``8o + 2i`` (low nibble) and ``8o + 2i + 1``
(high nibble), 0 past ``w_v``) and scales ``[ceil(w_v / 32), 2, tw]`` fp16 (``d`` then ``m``). Block
``v``'s codes start at byte ``row_ptr[v] * g_in / 2`` (``g_in`` a multiple of 8), its scales at
``row_ptr[v] * 2 * ceil(g_in / 32)``.
Why: a column's word is the operand of an integer dot product (``vpdpbusd``: 4 unsigned codes
times 4 signed int8 activations per 32-bit lane), so decode multiplies 8 weights a lane with two
instructions and no conversion to fp32; a tile is one contiguous run of codes and one of scales,
which decode reads front to back in one pass with its sums in registers (16 columns: one AVX-512
vector, two AVX2 ones); the scales are per column and subgroup because a column's integer sum
takes them once per 32 k rows.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from gmc.errors import GmcError
from gmc.groups import GroupSpec, Pattern, parse_pattern


@dataclass
class PackedLinear:
    """One target linear in the packed BSC format (see the module docstring)."""

    values: torch.Tensor  # [nnz] flat, block v is [w_v, R_v] row-major (int8: in words, int4: tiles)
    group_idx: torch.Tensor  # [n_kept_groups] int32, output-group index, block by block
    group_ptr: torch.Tensor  # [G_in + 1] int32, CSR offsets of each block's groups
    shape: tuple[int, int]  # (d_out, d_in)
    spec: GroupSpec
    bias: Optional[torch.Tensor] = None  # [d_out]
    scales: Optional[torch.Tensor] = None  # int8: [R] fp32, one per packed column; int4: fp16 (d, m) per 32 k rows
    name: str = ""  # the module's name in its model ("model.layers.0.mlp.up_proj"), which its errors give
    row_idx: torch.Tensor = field(init=False, repr=False)  # [R] int64, output row per kept row
    row_ptr: torch.Tensor = field(init=False, repr=False)  # [G_in + 1] int32, offsets in rows

    def __post_init__(self):
        if not isinstance(self.spec, GroupSpec):
            raise GmcError(f"packed lowering needs a group pattern like 1x256 or 32x32, got {self.spec}")
        self.shape = (int(self.shape[0]), int(self.shape[1]))
        check_indices(self.group_idx, self.group_ptr, self.spec, self.shape, self.label)
        self.row_idx, self.row_ptr = rows_from_groups(self.group_idx, self.group_ptr, self.spec, self.shape)
        widths = block_widths(self.spec, self.shape)
        rows_per_block = (self.row_ptr[1:] - self.row_ptr[:-1]).long().cpu()  # beside the widths, on the host
        if self.values.dtype == torch.uint8:
            if self.spec.g_in % 8:
                raise GmcError(f"{self.label}: int4 packed values need a group width that is a multiple of 8, got "
                               f"{self.spec} (a column's 8 codes of an octet of k rows share a 32-bit word)")
            widths = (widths + 7) // 8 * 4  # bytes per kept row of a block
        expected = int((rows_per_block * widths).sum())
        if self.values.numel() != expected:
            raise GmcError(f"{self.label}: packed values hold {self.values.numel()} numbers, group_idx and group_ptr "
                           f"need {expected}")
        self._check_scales()

    @property
    def label(self) -> str:
        """How errors name the layer: ``packed layer NAME``."""
        return f"packed layer {self.name}" if self.name else "packed layer"

    def _check_scales(self) -> None:
        """int8 values need fp32 scales ``[R]``, int4 fp16 scales ``int4_scale_count``; float values none."""
        if self.values.dtype == torch.uint8:
            expected = int4_scale_count(self.spec, self.shape, self.row_ptr)
            if self.scales is None or self.scales.dtype != torch.float16 or tuple(self.scales.shape) != (expected,):
                got = "none" if self.scales is None else f"{self.scales.dtype} {tuple(self.scales.shape)}"
                raise GmcError(f"{self.label}: int4 packed values need fp16 scales of shape ({expected},) "
                               f"(gmc.kernels.quantize.quantize_int4), got {got}")
        elif self.values.dtype == torch.int8:
            if self.scales is None:
                raise GmcError(f"{self.label}: int8 packed values need their scales (one fp32 per packed column): "
                               "build them with gmc.kernels.quantize.quantize_int8")
            if self.scales.dtype != torch.float32 or tuple(self.scales.shape) != tuple(self.row_idx.shape):
                raise GmcError(f"{self.label}: int8 packed values need fp32 scales of shape "
                               f"({self.row_idx.numel()},), got {self.scales.dtype} {tuple(self.scales.shape)}")
        elif not self.values.is_floating_point():
            raise GmcError(f"{self.label}: packed values must be floating point, int8 (quantize_int8) or int4 as "
                           f"uint8 (quantize_int4), got {self.values.dtype}")
        elif self.scales is not None:
            raise GmcError(f"{self.label}: {self.values.dtype} packed values take no scales (only int8 and int4 values "
                           "are scaled)")

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    @property
    def quantized(self) -> str:
        """``"int8"``, ``"int4"`` or ``"none"`` (float values)."""
        return {torch.int8: "int8", torch.uint8: "int4"}.get(self.values.dtype, "none")

    @property
    def nbytes(self) -> int:
        """Bytes of the stored weight: values, indices and int8 scales (what the disk file holds)."""
        stored = (self.values, self.group_idx, self.group_ptr, *(() if self.scales is None else (self.scales,)))
        return sum(t.numel() * t.element_size() for t in stored)

    @property
    def dense_nbytes(self) -> int:
        """Bytes of the dense weight at the values' precision (half a byte a weight for int4)."""
        return self.shape[0] * self.shape[1] * self.values.element_size() // (2 if self.quantized == "int4" else 1)

    def to(self, device=None, dtype=None) -> "PackedLinear":
        """Copy to ``device``; ``dtype`` converts the floating tensors (values, bias).

        Quantization is not a cast: an int8 layer moves between devices only (its values mean
        nothing without their scales; ``unpack()`` dequantizes), and int8 comes from ``quantize_int8``.
        """
        if dtype is not None and (self.quantized != "none" or not dtype.is_floating_point):
            raise GmcError(f"cannot convert a {self.values.dtype} packed layer to {dtype}: quantize a float layer "
                           "with gmc.kernels.quantize.quantize_int8 or quantize_int4, and unpack() a quantized "
                           "layer for its dense weight")
        bias = None if self.bias is None else self.bias.to(device=device, dtype=dtype)
        return PackedLinear(
            self.values.to(device=device, dtype=dtype),
            self.group_idx.to(device),
            self.group_ptr.to(device),
            self.shape,
            self.spec,
            bias,
            None if self.scales is None else self.scales.to(device),
            self.name,
        )

    def unpack(self) -> torch.Tensor:
        """The dense masked weight ``W * M`` ``[d_out, d_in]`` (zeros where groups are pruned).

        The reference of every kernel test: ``F.linear(x, packed.unpack(), bias)``. An int8 or int4
        layer gives its dequantized fp32 weight.
        """
        dtype = torch.float32 if self.scales is not None else self.values.dtype
        dense = self.values.new_zeros(self.shape, dtype=dtype)  # [d_out, d_in]
        g_in, ptr = self.spec.g_in, self.row_ptr.tolist()
        for v, width in enumerate(block_widths(self.spec, self.shape).tolist()):
            start, n_rows = ptr[v], ptr[v + 1] - ptr[v]
            if self.quantized == "int4":
                block = int4_block(self.values, self.scales, g_in, start, n_rows, width)  # [w_v, R_v]
                dense[self.row_idx[start : start + n_rows], v * g_in : v * g_in + width] = block.t()
                continue
            block = block_values(self.values, g_in, start, n_rows, width)  # [w_v, R_v]
            if self.scales is not None:
                block = block.float() * self.scales[start : start + n_rows]  # [w_v, R_v] * [R_v]
            dense[self.row_idx[start : start + n_rows], v * g_in : v * g_in + width] = block.t()
        return dense


INT4_GROUP = 32  # k rows of a packed column that share one int4 scale and offset
INT8_OCTET = 8  # k rows of an int8 block's pair of words


def block_values(values: torch.Tensor, g_in: int, start: int, n_rows: int, width: int) -> torch.Tensor:
    """Block ``[width, n_rows]`` of a float or int8 layer whose block starts at kept row ``start``, as
    stored numbers (int8: codes, unscaled)."""
    flat = values[start * g_in : start * g_in + width * n_rows]
    return int8_block(flat, n_rows, width) if values.dtype == torch.int8 else flat.view(width, n_rows)


def stored_values(block: torch.Tensor) -> torch.Tensor:
    """A float or int8 block ``[w, R]`` as the layout stores it (flat; ``block_values`` backwards)."""
    return int8_stored(block) if block.dtype == torch.int8 else block.flatten()


def int8_block(flat: torch.Tensor, n_rows: int, width: int) -> torch.Tensor:
    """An int8 block's codes ``[width, n_rows]`` from its ``width * n_rows`` stored bytes (``int8_stored``
    backwards)."""
    octets = width // INT8_OCTET
    main = flat[: octets * INT8_OCTET * n_rows].view(octets, 2, n_rows, 4)  # [o, p, c, j]: k = 8o + 2j + p
    main = main.permute(0, 3, 1, 2).reshape(octets * INT8_OCTET, n_rows)
    return torch.cat([main, flat[octets * INT8_OCTET * n_rows :].view(width - octets * INT8_OCTET, n_rows)])


def int8_stored(block: torch.Tensor) -> torch.Tensor:
    """Codes ``[w, R]`` of an int8 block as the layout stores them (flat, ``w * R`` bytes)."""
    width, n_rows = block.shape
    octets = width // INT8_OCTET
    main = block[: octets * INT8_OCTET].reshape(octets, 4, 2, n_rows).permute(0, 2, 3, 1)  # [o, p, c, j]
    return torch.cat([main.flatten(), block[octets * INT8_OCTET :].flatten()])

INT4_TILE = 16  # columns of an int4 tile


def int8_activations(x: torch.Tensor, g_in: int) -> torch.Tensor:
    """``x [T, d_in]`` as the integer products multiply it (the CPU kernel's ``quantize_x``, the CUDA kernel's
    ``dot4`` launches), fp32: per ``INT4_GROUP`` columns of each input block of ``g_in``, ``x8 =
    round(x 127 / max|x|)`` (halves away from zero) times ``max|x| / 127``."""
    x = x.float()
    out = torch.zeros_like(x)
    d_in = x.shape[1]
    for start in range(0, d_in, g_in):
        for first in range(start, min(start + g_in, d_in), INT4_GROUP):
            group = x[:, first : min(first + INT4_GROUP, start + g_in, d_in)]
            peak = group.abs().amax(dim=1, keepdim=True)
            v = group * torch.where(peak > 0, 127.0 / peak.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
            out[:, first : first + group.shape[1]] = torch.trunc(v + torch.where(v < 0, -0.5, 0.5)) * (peak / 127.0)
    return out


def integer_product(layer: PackedLinear, x: torch.Tensor) -> torch.Tensor:
    """What the integer products compute for ``x [T, d_in]`` on an int8 or int4 layer, float64: the stored
    values against x quantized per 32 k rows of a block (``int8_activations``: ``x_q``), times their scales,
    and an int4 layer's offsets ``m`` against x itself (``sum(x)`` a subgroup): ``W_hat x_q + bias`` (int8),
    ``W_hat x_q + M (x - x_q) + bias`` (int4, ``M`` the offsets). The reference of those products (the CPU's
    int4 products and int8 prefill, the CUDA kernel's ``dot4`` launches), which differ from ``F.linear(x,
    unpack())`` by x's quantization."""
    if layer.quantized == "none":
        raise GmcError("integer_product takes an int8 or int4 layer, got float values")
    quantized = int8_activations(x, layer.spec.g_in).double()
    out = torch.nn.functional.linear(quantized, layer.unpack().double())
    if layer.quantized == "int4":
        codes_zero = PackedLinear(torch.zeros_like(layer.values), layer.group_idx, layer.group_ptr, layer.shape,
                                  layer.spec, None, layer.scales)  # q = 0: each kept weight its offset m
        out = out + torch.nn.functional.linear(x.double() - quantized, codes_zero.unpack().double())
    return out if layer.bias is None else out + layer.bias.double()


def int4_scale_count(spec: GroupSpec, shape: tuple[int, int], row_ptr: torch.Tensor) -> int:
    """fp16 numbers an int4 layer's scales hold: ``2 * ceil(w_v / INT4_GROUP) * R_v`` summed over blocks."""
    subgroups = -(-block_widths(spec, shape) // INT4_GROUP)  # [G_in]
    return int((2 * subgroups * (row_ptr[1:] - row_ptr[:-1]).long().cpu()).sum())


def int4_block(values: torch.Tensor, scales: torch.Tensor, g_in: int, start: int, n_rows: int,
               width: int) -> torch.Tensor:
    """Block ``[width, n_rows]`` (fp32, dequantized) of an int4 layer whose block starts at kept row ``start``."""
    codes, dm = int4_columns(values, scales, g_in, start, n_rows, width)  # [octets, R_v, 4], [S, 2, R_v]
    q = torch.stack([codes & 15, codes >> 4], dim=-1)  # [octets, R_v, 4, 2]: k = 8o + 2j + nibble
    q = q.permute(0, 2, 3, 1).reshape(8 * codes.shape[0], n_rows)[:width].float()  # [w, R_v]
    dm = dm.float()
    d = dm[:, 0].repeat_interleave(INT4_GROUP, dim=0)[:width]  # [w, R_v]
    m = dm[:, 1].repeat_interleave(INT4_GROUP, dim=0)[:width]
    return q * d + m


def int4_columns(values: torch.Tensor, scales: torch.Tensor, g_in: int, start: int, n_rows: int, width: int,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The codes ``[ceil(w / 8), R_v, 4]`` and scales ``[S, 2, R_v]`` of an int4 layer's block that
    starts at kept row ``start``, its tiles side by side (``int4_tiles`` backwards)."""
    octets, subgroups = -(-width // 8), -(-width // INT4_GROUP)
    first, first_scale = start * (g_in // 2), start * 2 * -(-g_in // INT4_GROUP)
    codes = values[first : first + octets * n_rows * 4]
    dm = scales[first_scale : first_scale + subgroups * 2 * n_rows]
    full = n_rows // INT4_TILE * INT4_TILE
    tiles = full // INT4_TILE
    codes = torch.cat([codes[: octets * full * 4].view(tiles, octets, INT4_TILE, 4).transpose(0, 1)
                       .reshape(octets, full, 4), codes[octets * full * 4 :].view(octets, n_rows - full, 4)], dim=1)
    dm = torch.cat([dm[: subgroups * 2 * full].view(tiles, subgroups, 2, INT4_TILE).permute(1, 2, 0, 3)
                    .reshape(subgroups, 2, full), dm[subgroups * 2 * full :].view(subgroups, 2, n_rows - full)], dim=2)
    return codes, dm


def int4_tiles(codes: torch.Tensor, dm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A block's codes ``[O, R_v, 4]`` and scales ``[S, 2, R_v]`` as the flat tiled buffers of the layout."""
    octets, n_rows, _ = codes.shape
    subgroups = dm.shape[0]
    full = n_rows // INT4_TILE * INT4_TILE
    tiles = full // INT4_TILE
    tiled = codes[:, :full].reshape(octets, tiles, INT4_TILE, 4).transpose(0, 1).flatten()  # [tiles, O, 16, 4]
    tiled_dm = dm[:, :, :full].reshape(subgroups, 2, tiles, INT4_TILE).permute(2, 0, 1, 3).flatten()  # [tiles,S,2,16]
    return (torch.cat([tiled, codes[:, full:].flatten()]), torch.cat([tiled_dm, dm[:, :, full:].flatten()]))


def pack_dense(weight: torch.Tensor, spec: Pattern, bias: Optional[torch.Tensor] = None) -> PackedLinear:
    """``weight [d_out, d_in]`` with every group kept: a dense layer in the packed layout, so it
    runs on gmc's kernel (a GEMV that streams faster than MKL's on the CPUs measured,
    docs/lowering.md) and ``quantize_int8`` of it is dense int8 with the lowered layers' scale
    granularity. Every block keeps all rows in order, so ``values.view(d_in, d_out)`` is
    ``weight.T``: a tied embedding can read it (``is_whole``)."""
    spec = parse_pattern(spec)
    return pack(weight, torch.ones(spec.grid(tuple(weight.shape)), dtype=torch.bool), spec, bias)


def is_whole(layer: PackedLinear) -> bool:
    """Every group of the float ``layer`` is kept (``pack_dense``): its values are ``weight.T``."""
    return layer.scales is None and layer.values.numel() == layer.shape[0] * layer.shape[1]


@dataclass
class KernelInputs:
    """What the op reads of one packed layer (``PackedLinear`` without its on-disk indices)."""

    values: torch.Tensor  # [nnz], block v is [w_v, R_v] row-major (int8: in words, int4: tiles)
    row_idx: torch.Tensor  # [R] int64
    row_ptr: torch.Tensor  # [G_in + 1] int32
    d_out: int
    scales: Optional[torch.Tensor] = None  # int8: [R] fp32; int4: fp16 (d, m) per 32 k rows
    bias: Optional[torch.Tensor] = None  # [d_out]


def concat_outputs(layers: Sequence[KernelInputs], d_in: int, g_in: int) -> KernelInputs:
    """Layers that read the same input as one layer whose outputs are theirs one after another.

    Block ``v`` of the result is the layers' blocks ``v`` side by side (``[w_v, R_1v + R_2v + ...]``),
    each layer's rows offset by the outputs before it, so ``row_idx`` stays ascending per block and
    ``y[..., a_i : a_i + d_out_i]`` is layer ``i``'s output. A bias missing beside others is zeros.
    The layers share ``d_in``, ``g_in`` and the values dtype (all float, all int8 or all int4)."""
    if len({layer.values.dtype for layer in layers}) != 1 or len({layer.scales is None for layer in layers}) != 1:
        raise GmcError("concat_outputs: the layers must share one values dtype (all float, all int8 or all int4)")
    int4 = layers[0].values.dtype == torch.uint8
    n_blocks = -(-d_in // g_in)
    blocks, rows, scales, counts = [], [], [], [0]
    for v in range(n_blocks):
        width, offset, parts, scale_parts = min(g_in, d_in - v * g_in), 0, [], []
        for layer in layers:
            start, end = int(layer.row_ptr[v]), int(layer.row_ptr[v + 1])
            if int4:  # codes [ceil(w/8), R_v, 4] and scales [S, 2, R_v] side by side along R_v, then tiled
                block_codes, block_scales = int4_columns(layer.values, layer.scales, g_in, start, end - start, width)
                parts.append(block_codes)
                scale_parts.append(block_scales)
            else:
                parts.append(block_values(layer.values, g_in, start, end - start, width))
                if layer.scales is not None:
                    scales.append(layer.scales[start:end])
            rows.append(layer.row_idx[start:end] + offset)
            offset += layer.d_out
        if int4:
            block_codes, block_scales = int4_tiles(torch.cat(parts, dim=1), torch.cat(scale_parts, dim=-1))
            blocks.append(block_codes)
            scales.append(block_scales)
        else:
            blocks.append(stored_values(torch.cat(parts, dim=1)))  # [w_v, sum R_v]
        counts.append(sum(part.shape[1] for part in parts))
    row_ptr = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)
    bias = None
    biased = [layer.bias for layer in layers if layer.bias is not None]
    if biased:
        bias = torch.cat([biased[0].new_zeros(layer.d_out) if layer.bias is None else layer.bias for layer in layers])
    return KernelInputs(torch.cat(blocks), torch.cat(rows), row_ptr.to(layers[0].row_ptr.device),
                        sum(layer.d_out for layer in layers), torch.cat(scales) if scales else None, bias)


def block_widths(spec: GroupSpec, shape: tuple[int, int]) -> torch.Tensor:
    """Width ``w_v`` of each input block ``[G_in]`` (int64; only the last can be ragged)."""
    _, G_in = spec.grid(shape)
    widths = torch.full((G_in,), spec.g_in, dtype=torch.int64)
    widths[-1] = shape[1] - (G_in - 1) * spec.g_in
    return widths


def check_indices(group_idx: torch.Tensor, group_ptr: torch.Tensor, spec: GroupSpec, shape: tuple[int, int],
                  layer: str = "packed layer") -> None:
    """Refuse group indices that break the layout, in one line naming ``layer``, the tensor and the value.

    Indices read from a file reach ``rows_from_groups`` and the kernels unchecked otherwise: an index
    out of range fails inside the op in the middle of a generation, and decreasing pointers make
    negative block heights that the torch implementation skips (wrong output, no error). Rules:
    ``group_ptr [G_in + 1]`` starts at 0, never decreases and ends at ``len(group_idx)``; each block's
    ``group_idx`` lies in ``[0, G_out)`` and rises strictly (a kernel scatters a block's rows with no
    reduction, so a row appears once a block). O(kept groups), one host read of ``group_ptr``."""
    G_out, G_in = spec.grid(shape)
    for what, tensor in (("group_idx", group_idx), ("group_ptr", group_ptr)):
        if tensor.dim() != 1 or tensor.dtype not in (torch.int32, torch.int64):
            raise GmcError(f"{layer}: {what} is {tensor.dtype} of shape {tuple(tensor.shape)}; it must be a 1-D "
                           "int32 (or int64) tensor")
    if group_ptr.numel() != G_in + 1:
        raise GmcError(f"{layer}: group_ptr has {group_ptr.numel()} entries, expected {G_in + 1} for {shape} "
                       f"in {spec} groups")
    ptr = group_ptr.tolist()  # [G_in + 1]
    problem = pointer_problem(ptr, group_idx.numel(), "group_idx")
    if problem:
        raise GmcError(f"{layer}: group_ptr {problem}")
    idx = group_idx.long()  # [n_kept]
    outside = ((idx < 0) | (idx >= G_out)).nonzero()
    if outside.numel():
        at = int(outside[0])
        raise GmcError(f"{layer}: group_idx holds {int(idx[at])} at position {at}; indices must lie in [0, {G_out})")
    block_start = torch.zeros(idx.numel() + 1, dtype=torch.bool, device=idx.device)
    block_start[group_ptr.long()] = True  # [n_kept + 1]: a block's first index may be below the one before it
    falls = ((idx[1:] <= idx[:-1]) & ~block_start[1:-1]).nonzero()  # [n_kept - 1] -> positions - 1
    if falls.numel():
        at = int(falls[0]) + 1
        block = max(v for v in range(G_in) if ptr[v] <= at)
        raise GmcError(f"{layer}: group_idx holds {int(idx[at])} at position {at} after {int(idx[at - 1])} in "
                       f"input block {block}; a block's indices must rise")


def pointer_problem(ptr: list[int], length: int, items: str) -> str:
    """What breaks CSR offsets ``ptr`` into ``length`` ``items`` ("" when nothing): they start at 0,
    never decrease and end at ``length``. Plain Python over ``G_in + 1`` numbers: the op checks its
    ``row_ptr`` with it on every call to the torch implementation."""
    if ptr[0] != 0:
        return f"starts at {ptr[0]}; pointers must start at 0"
    down = next((v for v in range(1, len(ptr)) if ptr[v] < ptr[v - 1]), None)
    if down is not None:
        return f"decreases at position {down} ({ptr[down - 1]} then {ptr[down]}); pointers must never decrease"
    if ptr[-1] != length:
        return f"ends at {ptr[-1]}; the last pointer must be {length}, the length of {items}"
    return ""


def rows_from_groups(
    group_idx: torch.Tensor, group_ptr: torch.Tensor, spec: GroupSpec, shape: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expand kept output groups to kept rows: ``row_idx [R]`` and ``row_ptr [G_in + 1]``."""
    device = group_idx.device
    starts = group_idx.long() * spec.g_out  # [n_kept]
    heights = (shape[0] - starts).clamp(max=spec.g_out)  # [n_kept], ragged last group
    ends = torch.cumsum(heights, 0)  # [n_kept]
    total = int(ends[-1]) if ends.numel() else 0
    first_row = torch.repeat_interleave(starts, heights)  # [R]
    offset_in_group = torch.arange(total, device=device) - torch.repeat_interleave(ends - heights, heights)
    row_idx = first_row + offset_in_group  # int64: torch's index_add_ is ~5x slower with int32
    row_ptr = torch.cat([ends.new_zeros(1), ends])[group_ptr.long()].to(torch.int32)
    return row_idx, row_ptr


def pack(
    weight: torch.Tensor, selectors: torch.Tensor, spec: Pattern, bias: Optional[torch.Tensor] = None
) -> PackedLinear:
    """Pack ``weight [d_out, d_in]`` keeping the groups where ``selectors [G_out, G_in]`` is set."""
    spec = parse_pattern(spec)
    if not spec.packable:
        raise GmcError(
            f"cannot pack N:M pattern {spec}: packed lowering supports group patterns "
            "(GOUTxGIN such as 1x256, 1x64, 32x32); fold N:M masks into a dense checkpoint instead"
        )
    shape = tuple(weight.shape)
    if tuple(selectors.shape) != spec.grid(shape):
        raise GmcError(f"selectors of shape {tuple(selectors.shape)} do not match {spec} on weight {shape}; "
                       f"expected {spec.grid(shape)}")
    keep = selectors.detach().bool().cpu()
    weight = weight.detach()
    widths = block_widths(spec, shape).tolist()
    values, group_idx, counts = [], [], []
    for v, width in enumerate(widths):
        groups = keep[:, v].nonzero().squeeze(1)  # [n_v] kept output groups of block v
        group_idx.append(groups)
        counts.append(groups.numel())
        rows = (groups[:, None] * spec.g_out + torch.arange(spec.g_out)).flatten()
        rows = rows[rows < shape[0]].to(weight.device)  # [R_v], crop the ragged last group
        block = weight[rows, v * spec.g_in : v * spec.g_in + width]  # [R_v, w_v]
        values.append(block.t().contiguous().flatten())
    group_ptr = torch.cumsum(torch.tensor([0] + counts), 0)
    return PackedLinear(
        values=torch.cat(values) if values else weight.new_zeros(0),
        group_idx=torch.cat(group_idx).to(device=weight.device, dtype=torch.int32),
        group_ptr=group_ptr.to(device=weight.device, dtype=torch.int32),
        shape=shape,
        spec=spec,
        bias=None if bias is None else bias.detach(),
    )


