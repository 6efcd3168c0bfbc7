"""Weight-only int8 and int4 quantization of packed layers: a float layer in, the layer of the same
kept groups with its values stored as int8 or int4 out (``gmc lower --quantize``).

``gmc.kernels.packed`` has how int8 and int4 values and their scales are stored and read back (the
layout, int4 tiles and scale counts included, which every kernel, loader, check and ``unpack``
reads); this module only makes them from float values, so it imports the layout and the layout
never imports it.

- int8 (``quantize_int8``): symmetric, one fp32 scale per packed column (``max|column| / 127``): the
  decode product multiplies a column's accumulator by its scale once, when it is added into ``y``;
- int4 (``quantize_int4``): asymmetric, an fp16 scale and offset per ``INT4_GROUP`` (32) k rows of a
  packed column, llama.cpp's Q4_1 rule (5 bits a weight with the scales).
"""
from __future__ import annotations

import torch

from gmc.errors import GmcError
from gmc.kernels.packed import INT4_GROUP, PackedLinear, block_widths, int4_tiles, int8_stored

QUANTIZE = ("none", "int8", "int4")  # what the kept values can be stored as


def quantize_int8(layer: PackedLinear) -> PackedLinear:
    """Weight-only symmetric int8 of a float packed layer: per packed column ``c`` (``[w_v]``),
    ``scale = max|column| / 127`` (1 for an all-zero column) and ``q = round(w / scale)`` in
    ``[-127, 127]``, so every weight is off by at most ``scale / 2``. Bias and indices are kept;
    an int8 layer is returned as it is."""
    if layer.scales is not None:
        return layer
    values = layer.values.float()  # [nnz]
    q, scales = torch.empty_like(values, dtype=torch.int8), values.new_ones(layer.row_idx.numel())  # [nnz], [R]
    g_in, ptr = layer.spec.g_in, layer.row_ptr.tolist()
    for v, width in enumerate(block_widths(layer.spec, layer.shape).tolist()):
        start, n_rows = ptr[v], ptr[v + 1] - ptr[v]
        if n_rows == 0:
            continue
        span = slice(start * g_in, start * g_in + width * n_rows)
        block = values[span].view(width, n_rows)  # [w_v, R_v]: column c is one kept row of block v
        peak = block.abs().amax(dim=0) / 127  # [R_v]
        scale = torch.where(peak > 0, peak, torch.ones_like(peak))
        q[span] = int8_stored(torch.round(block / scale).clamp(-127, 127).to(torch.int8))
        scales[start : start + n_rows] = scale
    return PackedLinear(q, layer.group_idx, layer.group_ptr, layer.shape, layer.spec, layer.bias, scales, layer.name)


def quantize_int4(layer: PackedLinear) -> PackedLinear:
    """Weight-only asymmetric int4 of a float packed layer: for each ``INT4_GROUP`` k rows of a
    packed column, ``d = (max - min) / 15`` and ``m = min`` stored as fp16, and the codes
    ``q = round((w - m) / d)`` in ``0..15`` taken against the stored (fp16) ``d`` and ``m``, so every
    weight is off by at most about ``d / 2`` (llama.cpp's Q4_1 rule on 32 weights). Bias and indices
    are kept; an int4 layer is returned as it is."""
    if layer.quantized == "int4":
        return layer
    if layer.quantized != "none":
        raise GmcError(f"quantize_int4 takes a float packed layer, got {layer.quantized} values")
    if layer.spec.g_in % 8:
        raise GmcError(f"int4 packing needs a group width that is a multiple of 8 (a column's codes of 8 k rows "
                       f"share a 32-bit word), got {layer.spec}")
    values = layer.values.float()  # [nnz]
    codes, scales = [], []
    g_in, ptr = layer.spec.g_in, layer.row_ptr.tolist()
    for v, width in enumerate(block_widths(layer.spec, layer.shape).tolist()):
        start, n_rows = ptr[v], ptr[v + 1] - ptr[v]
        if n_rows == 0:
            continue
        block = values[start * g_in : start * g_in + width * n_rows].view(width, n_rows)  # [w_v, R_v]
        subgroups = -(-width // INT4_GROUP)
        padded = torch.cat([block, block[-1:].expand(subgroups * INT4_GROUP - width, n_rows)])  # no new extremes
        groups = padded.view(subgroups, INT4_GROUP, n_rows)
        low, high = groups.amin(dim=1), groups.amax(dim=1)  # [S, R_v]
        d = ((high - low) / 15).half()
        m = low.half()
        d_safe = torch.where(d.float() > 0, d.float(), torch.ones_like(low))
        q = torch.round((groups - m.float()[:, None]) / d_safe[:, None]).clamp(0, 15).to(torch.uint8)
        q = q.view(-1, n_rows)[:width]  # [w_v, R_v]
        octets = -(-width // 8)
        q = torch.cat([q, q.new_zeros(8 * octets - width, n_rows)]).view(octets, 4, 2, n_rows)  # k = 8o + 2j + h
        pairs = q[:, :, 0] | (q[:, :, 1] << 4)  # [octets, 4, R_v]: byte j of each column's word
        block_codes, block_scales = int4_tiles(pairs.permute(0, 2, 1), torch.stack([d, m], dim=1))
        codes.append(block_codes)
        scales.append(block_scales)
    codes_t = torch.cat(codes) if codes else values.new_zeros(0, dtype=torch.uint8)
    scales_t = torch.cat(scales) if scales else values.new_zeros(0, dtype=torch.float16)
    return PackedLinear(codes_t, layer.group_idx, layer.group_ptr, layer.shape, layer.spec, layer.bias, scales_t,
                        layer.name)


def quantize(layer: PackedLinear, how: str) -> PackedLinear:
    """``layer`` with its kept values stored as ``how`` (one of ``QUANTIZE``)."""
    if how not in QUANTIZE:
        raise GmcError(f"bad quantization {how!r}: expected one of {', '.join(QUANTIZE)}")
    return {"none": lambda layer: layer, "int8": quantize_int8, "int4": quantize_int4}[how](layer)
