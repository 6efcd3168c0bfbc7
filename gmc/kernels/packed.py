"""The packed group-sparse weight format: only kept groups are stored, plus compact indices.

Layout ("BSC": compressed over input-column blocks). For a group ``g_out x g_in`` on a weight
``W [d_out, d_in]`` with selectors ``B [G_out, G_in]``:

- input block ``v`` covers columns ``v*g_in : v*g_in + w_v`` with ``w_v = min(g_in, d_in - v*g_in)``
  (only the last block can be narrower: ragged ``d_in``);
- its kept rows are the rows of every output group ``u`` with ``B[u, v] = 1``, in ascending order,
  ``R_v`` of them (a ragged last output group contributes only its real rows);
- ``values`` is one flat buffer; block ``v`` is the ``[w_v, R_v]`` row-major matrix
  ``W[kept rows, block columns].T`` starting at offset ``row_ptr[v] * g_in`` (every block before
  the last has width ``g_in``, so this offset is exact and no padding is stored).

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
memory.

Weight-only int8 (``quantize_int8``): ``values`` int8 plus ``scales`` fp32 ``[R]``, one per packed
column (one kept row of one input block, aligned with ``row_idx``; for ``1xG`` groups one per
group): ``W_hat[row_idx[c], cols_v] = values_v[:, c] * scales[c]``. A column scale is what the
decode product needs: it multiplies one accumulator when that is added into ``y``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from gmc.errors import GmcError
from gmc.groups import GroupSpec, NMSpec, Pattern, parse_pattern


@dataclass
class PackedLinear:
    """One target linear in the packed BSC format (see the module docstring)."""

    values: torch.Tensor  # [nnz] flat, block v is [w_v, R_v] row-major
    group_idx: torch.Tensor  # [n_kept_groups] int32, output-group index, block by block
    group_ptr: torch.Tensor  # [G_in + 1] int32, CSR offsets of each block's groups
    shape: tuple[int, int]  # (d_out, d_in)
    spec: GroupSpec
    bias: Optional[torch.Tensor] = None  # [d_out]
    scales: Optional[torch.Tensor] = None  # [R] fp32, int8 values only: one scale per packed column
    row_idx: torch.Tensor = field(init=False, repr=False)  # [R] int64, output row per kept row
    row_ptr: torch.Tensor = field(init=False, repr=False)  # [G_in + 1] int32, offsets in rows

    def __post_init__(self):
        if not isinstance(self.spec, GroupSpec):
            raise GmcError(f"packed lowering needs a group pattern like 1x256 or 32x32, got {self.spec}")
        self.shape = (int(self.shape[0]), int(self.shape[1]))
        G_out, G_in = self.spec.grid(self.shape)
        if self.group_ptr.numel() != G_in + 1:
            raise GmcError(f"group_ptr has {self.group_ptr.numel()} entries, expected {G_in + 1} for {self.shape}")
        self.row_idx, self.row_ptr = _rows_from_groups(self.group_idx, self.group_ptr, self.spec, self.shape)
        widths = block_widths(self.spec, self.shape)
        rows_per_block = (self.row_ptr[1:] - self.row_ptr[:-1]).long()
        expected = int((rows_per_block * widths).sum())
        if self.values.numel() != expected:
            raise GmcError(f"packed values hold {self.values.numel()} numbers, the indices need {expected}")
        self._check_scales()

    def _check_scales(self) -> None:
        """int8 values need fp32 scales ``[R]``; float values have none."""
        if self.values.dtype == torch.int8:
            if self.scales is None:
                raise GmcError("int8 packed values need their scales (one fp32 per packed column): "
                               "build them with gmc.kernels.packed.quantize_int8")
            if self.scales.dtype != torch.float32 or tuple(self.scales.shape) != tuple(self.row_idx.shape):
                raise GmcError(f"int8 packed values need fp32 scales of shape ({self.row_idx.numel()},), got "
                               f"{self.scales.dtype} {tuple(self.scales.shape)}")
        elif not self.values.is_floating_point():
            raise GmcError(f"packed values must be floating point or int8 (quantize_int8), got {self.values.dtype}")
        elif self.scales is not None:
            raise GmcError(f"{self.values.dtype} packed values take no scales (only int8 values are scaled)")

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of the stored weight: values, indices and int8 scales (what the disk file holds)."""
        stored = (self.values, self.group_idx, self.group_ptr, *(() if self.scales is None else (self.scales,)))
        return sum(t.numel() * t.element_size() for t in stored)

    @property
    def dense_nbytes(self) -> int:
        return self.shape[0] * self.shape[1] * self.values.element_size()

    def to(self, device=None, dtype=None) -> "PackedLinear":
        """Copy to ``device``; ``dtype`` converts the floating tensors (values, bias).

        Quantization is not a cast: an int8 layer moves between devices only (its values mean
        nothing without their scales; ``unpack()`` dequantizes), and int8 comes from ``quantize_int8``.
        """
        if dtype is not None and (self.values.dtype == torch.int8 or not dtype.is_floating_point):
            raise GmcError(f"cannot convert a {self.values.dtype} packed layer to {dtype}: quantize a float layer "
                           "with gmc.kernels.packed.quantize_int8, and unpack() an int8 layer for its dense weight")
        bias = None if self.bias is None else self.bias.to(device=device, dtype=dtype)
        return PackedLinear(
            self.values.to(device=device, dtype=dtype),
            self.group_idx.to(device),
            self.group_ptr.to(device),
            self.shape,
            self.spec,
            bias,
            None if self.scales is None else self.scales.to(device),
        )

    def unpack(self) -> torch.Tensor:
        """The dense masked weight ``W * M`` ``[d_out, d_in]`` (zeros where groups are pruned).

        The reference of every kernel test: ``F.linear(x, packed.unpack(), bias)``. An int8 layer
        gives its dequantized fp32 weight ``values * scales``.
        """
        dtype = torch.float32 if self.scales is not None else self.values.dtype
        dense = self.values.new_zeros(self.shape, dtype=dtype)  # [d_out, d_in]
        g_in, ptr = self.spec.g_in, self.row_ptr.tolist()
        for v, width in enumerate(block_widths(self.spec, self.shape).tolist()):
            start, n_rows = ptr[v], ptr[v + 1] - ptr[v]
            block = self.values[start * g_in : start * g_in + width * n_rows].view(width, n_rows)  # [w_v, R_v]
            if self.scales is not None:
                block = block.float() * self.scales[start : start + n_rows]  # [w_v, R_v] * [R_v]
            dense[self.row_idx[start : start + n_rows], v * g_in : v * g_in + width] = block.t()
        return dense


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
        q[span] = torch.round(block / scale).clamp(-127, 127).to(torch.int8).flatten()
        scales[start : start + n_rows] = scale
    return PackedLinear(q, layer.group_idx, layer.group_ptr, layer.shape, layer.spec, layer.bias, scales)


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

    values: torch.Tensor  # [nnz], block v is [w_v, R_v] row-major
    row_idx: torch.Tensor  # [R] int64
    row_ptr: torch.Tensor  # [G_in + 1] int32
    d_out: int
    scales: Optional[torch.Tensor] = None  # [R] fp32, int8 values
    bias: Optional[torch.Tensor] = None  # [d_out]


def concat_outputs(layers: Sequence[KernelInputs], d_in: int, g_in: int) -> KernelInputs:
    """Layers that read the same input as one layer whose outputs are theirs one after another.

    Block ``v`` of the result is the layers' blocks ``v`` side by side (``[w_v, R_1v + R_2v + ...]``),
    each layer's rows offset by the outputs before it, so ``row_idx`` stays ascending per block and
    ``y[..., a_i : a_i + d_out_i]`` is layer ``i``'s output. A bias missing beside others is zeros.
    The layers share ``d_in``, ``g_in`` and the values dtype, and are all int8 or all float."""
    if len({layer.values.dtype for layer in layers}) != 1 or len({layer.scales is None for layer in layers}) != 1:
        raise GmcError("concat_outputs: the layers must share one values dtype (all int8 or all float)")
    n_blocks = -(-d_in // g_in)
    blocks, rows, scales, counts = [], [], [], [0]
    for v in range(n_blocks):
        width, offset, parts = min(g_in, d_in - v * g_in), 0, []
        for layer in layers:
            start, end = int(layer.row_ptr[v]), int(layer.row_ptr[v + 1])
            parts.append(layer.values[start * g_in : start * g_in + width * (end - start)].view(width, end - start))
            rows.append(layer.row_idx[start:end] + offset)
            if layer.scales is not None:
                scales.append(layer.scales[start:end])
            offset += layer.d_out
        blocks.append(torch.cat(parts, dim=1).flatten())  # [w_v, sum R_v] row-major
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


def _rows_from_groups(
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
    if isinstance(spec, NMSpec):
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


