"""The tiled layout: a packed layer as a CUDA kernel reads it (``triton_group_sparse.py``).

The packed (BSC) layout of ``gmc/kernels/packed.py`` is input-block major: block ``v`` is one
``[w_v, R_v]`` matrix, which a CPU core streams with its sums in vector registers. A GPU program
wants the transpose of that story: it owns a tile of *output rows*, keeps their sums in registers
for the whole reduction and writes each output once (no atomics), and it wants every kept row's
weights contiguous so that a warp reads them with 16-byte loads. Tiled, for a layer
``(d_out, d_in)`` with input blocks of width ``g_in``:

- output rows are cut into tiles of ``tile_r`` rows (``tile_rows``: 64 when kept rows come in
  aligned runs of 32 or more, as with 32x32 or 64x64 groups, else 128);
- an *entry* is one (tile, input block) pair with at least one kept row. ``tile_ptr``
  (``[n_tiles + 1]`` int32) lists each tile's entries, blocks ascending;
- an entry stores its kept rows, ascending, row-major: ``rs`` numbers a row, ``rs`` the block's
  width rounded up to ``row_pad`` values (8 of any float: 16 bytes of fp16/bf16; 16 int8, 32 int4)
  with zeros past the width, so every row starts 16-byte aligned and a float layer keeps its table
  when it changes precision;
- ``entries`` (``[E, ENTRY_HEAD + tile_r / 16]`` int32) is, per entry: its block, the offset of its
  values in units of ``row_pad`` values (so a kernel's address is aligned by construction, not by a
  hint, and int32 reaches 16 G values), the offset of its scales, then one word per 16 rows of the
  tile: bit ``i`` set when row ``16 j + i`` is kept, bits 16-31 the entry's kept rows before row
  ``16 j``. A kept row's rank among the entry's rows (where its values start) is that count plus the
  bits below it, so a program reads any 16-row slice of a tile without a table per row;
- values hold the full-width entries first, tile by tile, then those of a ragged last block, so
  each part is one uniform ``[rows, rs]`` matrix: ``tile`` is one row gather per part;
- int8: ``scales`` fp32, one per stored row (the packed layout's per-column scale); int4: values
  are codes two a byte (``k = 2 j`` in the low nibble of byte ``j``, ``2 j + 1`` in the high one) and
  ``scales`` fp16 ``[rows, rs / 32, 2]``: a scale ``d`` and offset ``m`` per 32 ``k`` of a row (the
  packed layout's own numbers, ``w = q d + m``).

Index bytes per entry are ``4 * (ENTRY_HEAD + tile_r / 16)``: 44 for a 128-row tile, under 1% of
the values at 50% of 1x64 (4 KB an entry) and 0.2% at 1x256. A layer moves between the layouts
without loss (``tile``, ``untile``): the packed one stays the format on disk and on the CPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from gmc.errors import GmcError
from gmc.kernels.packed import INT4_GROUP, block_values, int4_columns, int4_tiles, stored_values

ENTRY_HEAD = 3  # block, values offset, scales offset; then one word per 16 rows
ROW_WORD = 16  # tile rows a word describes
PAD_BYTES = 16  # every stored row starts (and is padded to) a multiple of this many bytes
WIDE_RUN = 32  # kept rows in aligned runs at least this long: 64-row tiles (2-D groups), else 128


def row_pad(dtype: torch.dtype) -> int:
    """Values a stored row is padded to a multiple of: 16 bytes of int8 (16) or int4 codes (32, a scale
    group), and 8 of any float (16 bytes of fp16/bf16, 32 of fp32), so a float layer changes precision
    (``.to(dtype)``) without a new table."""
    return {torch.uint8: 2 * PAD_BYTES, torch.int8: PAD_BYTES}.get(dtype, 8)


def is_tiled(row_idx: torch.Tensor) -> bool:
    """The op's ``row_idx`` argument is a tiled layer's ``entries`` (2-D) rather than packed row indices (1-D)."""
    return row_idx.dim() == 2


@dataclass
class TiledInputs:
    """What the CUDA kernels read of one layer; the op takes them in the packed layer's places:
    ``(x, values, entries, tile_ptr, bias, d_out, g_in, scales)``."""

    values: torch.Tensor  # [n] float, int8, or int4 codes (uint8)
    entries: torch.Tensor  # [E, ENTRY_HEAD + tile_r / 16] int32
    tile_ptr: torch.Tensor  # [ceil(d_out / tile_r) + 1] int32
    scales: Optional[torch.Tensor] = None  # int8: [rows] fp32; int4: [rows * rs / 32 * 2] fp16

    @property
    def tile_r(self) -> int:
        return entry_tile_rows(self.entries)


def entry_tile_rows(entries: torch.Tensor) -> int:
    """Rows of a tile, from the width of the entries table."""
    return (entries.shape[1] - ENTRY_HEAD) * ROW_WORD


def tile_rows(row_idx: torch.Tensor, row_ptr: torch.Tensor) -> int:
    """64 when every block's kept rows come in aligned runs of ``WIDE_RUN`` and some run is pruned
    (2-D groups of 32 rows or more): a 64-row tile then skips half of a 50% layer's products, where a
    128-row one would skip 6%; else 128, which reads an input tile once for twice the rows."""
    if row_idx.numel() == 0:
        return 128
    rows = row_idx.long()
    counts = (row_ptr[1:] - row_ptr[:-1]).long()
    block = torch.repeat_interleave(torch.arange(counts.numel(), device=rows.device), counts)
    runs = torch.zeros((counts.numel(), int(rows.max()) // WIDE_RUN + 1), dtype=torch.long, device=rows.device)
    runs.index_put_((block, rows // WIDE_RUN), torch.ones_like(rows), accumulate=True)
    # a run is complete when it holds all WIDE_RUN rows, or all rows up to the layer's last kept one
    complete = runs == WIDE_RUN
    complete[:, -1] |= runs[:, -1] == (int(rows.max()) % WIDE_RUN + 1)
    return 64 if bool(((runs == 0) | complete).all()) and bool((runs == 0).any()) else 128


class _Plan(NamedTuple):
    """Where each stored row of a tiled layer comes from, shared by ``tile`` and ``untile``."""

    order: torch.Tensor  # [R] packed position of each stored row, stored order
    first: int  # stored rows in the full-width part
    widths: list  # [G_in] block widths
    strides: list  # [G_in] rs of each block
    row_sizes: tuple  # (full, ragged part): values a stored row holds (int4: bytes)
    scale_sizes: tuple  # (full, ragged part): scales a stored row holds (int8: 1, int4: 2 a scale group)
    entries: torch.Tensor  # [E, ENTRY_HEAD + tile_r / 16] int32, ordered tile by tile
    tile_ptr: torch.Tensor  # [n_tiles + 1] int32

    @property
    def ragged(self) -> bool:
        """The last block's rows are narrower than the others: they are stored in a part of their own."""
        return self.strides[-1] != self.strides[0]

    def part(self, block: int) -> int:
        """0 for a full-width block, 1 for a ragged last one."""
        return int(self.ragged and block == len(self.widths) - 1)


def _plan(row_idx, row_ptr, d_out: int, d_in: int, g_in: int, tile_r: int, pad: int, int4: bool) -> _Plan:
    device = row_idx.device
    G_in = row_ptr.numel() - 1
    widths = [min(g_in, d_in - v * g_in) for v in range(G_in)]
    strides = [-(-w // pad) * pad for w in widths]
    n_tiles, words = -(-d_out // tile_r), tile_r // ROW_WORD
    counts = (row_ptr[1:] - row_ptr[:-1]).long()
    block = torch.repeat_interleave(torch.arange(G_in, device=device), counts)  # [R] block of each packed row
    rows = row_idx.long()
    narrow = (block == G_in - 1) & (strides[-1] != strides[0])  # rows of a ragged last block: second part
    key = (narrow.long() * n_tiles + rows // tile_r) * G_in + block  # part, tile, block; rows stay ascending
    key, order = torch.sort(key, stable=True)
    first = int((~narrow).sum())
    keys, entry, sizes = torch.unique_consecutive(key, return_inverse=True, return_counts=True)
    start = torch.cumsum(sizes, 0) - sizes  # [E] first stored row of each entry
    row_sizes = tuple(s // 2 if int4 else s for s in (strides[0], strides[-1]))
    per_row = [s // pad for s in (strides[0], strides[-1])]  # offset units (row_pad values) a stored row
    per_scale = tuple(2 * s // INT4_GROUP if int4 else 1 for s in (strides[0], strides[-1]))
    offset = torch.where(start < first, start * per_row[0], first * per_row[0] + (start - first) * per_row[1])
    scale_offset = torch.where(start < first, start * per_scale[0],
                               first * per_scale[0] + (start - first) * per_scale[1])
    local = rows[order] % tile_r  # [R] row inside its tile, stored order
    slot = entry * words + local // ROW_WORD
    bits = torch.zeros(keys.numel() * words, dtype=torch.long, device=device)
    bits.index_add_(0, slot, torch.ones_like(local) << (local % ROW_WORD))
    kept = torch.zeros_like(bits).index_add_(0, slot, torch.ones_like(local)).view(-1, words)
    before = torch.cumsum(kept, 1) - kept  # [E, words] entry rows before each word's first row
    tile, blk = (keys // G_in) % n_tiles, keys % G_in
    table = torch.cat([torch.stack([blk, offset, scale_offset], 1), bits.view(-1, words) | (before << 16)], 1)
    by_tile = torch.argsort(tile * G_in + blk)
    tile_ptr = torch.cat([tile.new_zeros(1), torch.cumsum(torch.bincount(tile, minlength=n_tiles), 0)])
    return _Plan(order, first, widths, strides, row_sizes, per_scale, table[by_tile].to(torch.int32),
                 tile_ptr.to(torch.int32))


def quantized_kind(values: torch.Tensor, scales: Optional[torch.Tensor]) -> str:
    """``"none"``, ``"int8"`` or ``"int4"``: what a layer's values are, from the op's own arguments."""
    if scales is None:
        return "none"
    return "int4" if values.dtype == torch.uint8 else "int8"


def tile(values: torch.Tensor, row_idx: torch.Tensor, row_ptr: torch.Tensor, scales: Optional[torch.Tensor],
         d_out: int, d_in: int, g_in: int, tile_r: Optional[int] = None) -> TiledInputs:
    """A packed layer's kernel inputs (``values``, ``row_idx``, ``row_ptr``, ``scales``) in the tiled
    layout, on their device. ``tile_r``: rows a tile (a multiple of 16; ``tile_rows`` by default)."""
    tile_r = tile_r or tile_rows(row_idx, row_ptr)
    if tile_r % ROW_WORD or tile_r > 2 ** 15:
        raise GmcError(f"bad tile_r {tile_r}: expected a multiple of {ROW_WORD} up to {2 ** 15}")
    quantized = quantized_kind(values, scales)
    plan = _plan(row_idx, row_ptr, d_out, d_in, g_in, tile_r, row_pad(values.dtype), quantized == "int4")
    rows, row_scales = _packed_rows(values, scales, row_ptr, plan, g_in, quantized)
    stored = [part[index] for part, index in zip(rows, _part_orders(plan))]  # [rows_p, per_row_p] each
    tiled_scales = None
    if quantized == "int8":
        tiled_scales = scales[plan.order]
    elif quantized == "int4":
        tiled_scales = torch.cat([part[index].flatten() for part, index in zip(row_scales, _part_orders(plan))])
    return TiledInputs(torch.cat([part.flatten() for part in stored]), plan.entries, plan.tile_ptr, tiled_scales)


def untile(tiled: TiledInputs, row_idx: torch.Tensor, row_ptr: torch.Tensor, d_out: int, d_in: int,
           g_in: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The packed ``(values, scales)`` of a tiled layer whose packed indices are ``row_idx``, ``row_ptr``."""
    quantized = quantized_kind(tiled.values, tiled.scales)
    plan = _plan(row_idx, row_ptr, d_out, d_in, g_in, tiled.tile_r, row_pad(tiled.values.dtype), quantized == "int4")
    packed = _packed_order(tiled.values, plan.row_sizes, plan)
    if quantized == "int4":
        return _int4_blocks(packed, _packed_order(tiled.scales, plan.scale_sizes, plan), row_ptr, plan)
    scales = None
    if quantized == "int8":
        scales = torch.empty_like(tiled.scales)
        scales[plan.order] = tiled.scales
    blocks = []
    ptr = row_ptr.tolist()
    for v, width in enumerate(plan.widths):
        rows = packed[plan.part(v)].narrow(0, ptr[v] - plan.first * plan.part(v), ptr[v + 1] - ptr[v])
        blocks.append(stored_values(rows[:, :width].t()))  # [w_v, R_v]
    values = torch.cat(blocks) if blocks else tiled.values[:0]
    return values, scales


def _packed_order(flat: torch.Tensor, sizes: tuple, plan: _Plan) -> list[torch.Tensor]:
    """A tiled buffer's two parts as ``[rows, size]`` matrices, their rows back in packed order."""
    rows = plan.order.numel()
    parts = (flat[: plan.first * sizes[0]].view(plan.first, sizes[0]),
             flat[plan.first * sizes[0]:].view(rows - plan.first, sizes[1]))
    packed = [torch.empty_like(part) for part in parts]
    for target, part, index in zip(packed, parts, _part_orders(plan)):
        target[index] = part
    return packed


def _part_orders(plan: _Plan) -> tuple[torch.Tensor, torch.Tensor]:
    """Each part's stored rows as indices into that part's packed rows."""
    return plan.order[: plan.first], plan.order[plan.first:] - plan.first


def _packed_rows(values, scales, row_ptr, plan: _Plan, g_in: int, quantized: str):
    """Each part's packed rows as one matrix ``[rows, per_row]`` (and, for int4, one of their scales)."""
    ptr = row_ptr.tolist()
    parts, scale_parts = ([[], []], [[], []])
    for v, (width, stride) in enumerate(zip(plan.widths, plan.strides)):
        start, n_rows = ptr[v], ptr[v + 1] - ptr[v]
        part = plan.part(v)
        if quantized == "int4":
            codes, dm = int4_columns(values, scales, g_in, start, n_rows, width)  # [O, R_v, 4], [S, 2, R_v]
            block = codes.permute(1, 0, 2).reshape(n_rows, 4 * codes.shape[0])  # [R_v, 4 O]: byte j: k = 2j, 2j + 1
            block = torch.nn.functional.pad(block, (0, stride // 2 - block.shape[1]))
            scale_parts[part].append(dm.permute(2, 0, 1).reshape(n_rows, 2 * dm.shape[0]))  # [R_v, 2 S]
        else:
            block = block_values(values, g_in, start, n_rows, width).t()  # [R_v, w_v]
            block = torch.nn.functional.pad(block, (0, stride - width))
        parts[part].append(block)
    rows = tuple(torch.cat(blocks) if blocks else values.new_zeros((0, 0)) for blocks in parts)
    if quantized != "int4":
        return rows, None
    return rows, tuple(torch.cat(blocks) if blocks else scales.new_zeros((0, 0)) for blocks in scale_parts)


def _int4_blocks(packed, packed_scales, row_ptr, plan: _Plan) -> tuple[torch.Tensor, torch.Tensor]:
    """int4 packed ``(values, scales)`` from each part's rows of codes and scales, packed order."""
    ptr = row_ptr.tolist()
    codes, scales = [], []
    for v, width in enumerate(plan.widths):
        n_rows = ptr[v + 1] - ptr[v]
        if n_rows == 0:
            continue
        part, base = plan.part(v), ptr[v] - plan.first * plan.part(v)
        octets, subgroups = -(-width // 8), -(-width // INT4_GROUP)
        block = packed[part][base : base + n_rows, : 4 * octets].reshape(n_rows, octets, 4).permute(1, 0, 2)
        # block: [O, R_v, 4]
        dm = packed_scales[part][base : base + n_rows].reshape(n_rows, subgroups, 2).permute(1, 2, 0)  # [S, 2, R_v]
        block_codes, block_scales = int4_tiles(block.contiguous(), dm.contiguous())
        codes.append(block_codes)
        scales.append(block_scales)
    empty = packed[0].new_zeros(0)
    return (torch.cat(codes) if codes else empty), (torch.cat(scales) if scales else packed_scales[0].new_zeros(0))


def dense_weight(tiled: TiledInputs, d_out: int, d_in: int, g_in: int) -> torch.Tensor:
    """The dense weight ``[d_out, d_in]`` a tiled layer multiplies by (dequantized fp32 for int8 and
    int4): the reference the kernels are tested against, and the op's CPU path for this layout."""
    entries, tile_r = tiled.entries.long(), tiled.tile_r
    quantized = quantized_kind(tiled.values, tiled.scales)
    dtype = torch.float32 if quantized != "none" else tiled.values.dtype
    dense = torch.zeros((d_out, d_in), dtype=dtype, device=tiled.values.device)
    if entries.shape[0] == 0:
        return dense
    n_tiles = tiled.tile_ptr.numel() - 1
    tile = torch.repeat_interleave(torch.arange(n_tiles, device=entries.device),
                                   (tiled.tile_ptr[1:] - tiled.tile_ptr[:-1]).long())  # [E]
    words = entries[:, ENTRY_HEAD:]  # [E, tile_r / 16]
    bits = ((words[:, :, None] >> torch.arange(ROW_WORD, device=words.device)) & 1).reshape(len(entries), tile_r)
    rank = torch.cumsum(bits, 1) - bits  # [E, tile_r]
    entry, local = bits.nonzero(as_tuple=True)  # stored rows, entry by entry, ascending rows
    block = entries[entry, 0]
    width = (d_in - block * g_in).clamp(max=g_in)  # [n]
    pad = row_pad(tiled.values.dtype)
    stride = (width + pad - 1) // pad * pad
    row = tile[entry] * tile_r + local
    r = rank[entry, local]
    k = torch.arange(g_in, device=entries.device)
    valid = k[None, :] < width[:, None]  # [n, g_in]
    start = entries[entry, 1][:, None] * (PAD_BYTES if quantized == "int4" else pad)  # first value (byte) of the entry
    if quantized == "int4":
        byte = start + r[:, None] * (stride[:, None] // 2) + k[None, :] // 2
        code = tiled.values[byte.clamp(max=tiled.values.numel() - 1)].long()
        q = ((code >> (4 * (k[None, :] % 2))) & 15).float()
        at = (entries[entry, 2][:, None] + r[:, None] * (2 * stride[:, None] // INT4_GROUP)
              + 2 * (k[None, :] // INT4_GROUP))
        at = at.clamp(max=tiled.scales.numel() - 2)
        weight = q * tiled.scales[at].float() + tiled.scales[at + 1].float()
    else:
        at = start + r[:, None] * stride[:, None] + k[None, :]
        weight = tiled.values[at.clamp(max=max(tiled.values.numel() - 1, 0))].to(dtype)
        if quantized == "int8":
            weight = weight * tiled.scales[entries[entry, 2] + r][:, None]
    columns = block[:, None] * g_in + k[None, :]
    dense[row[:, None].expand_as(columns)[valid], columns[valid]] = weight[valid]
    return dense
