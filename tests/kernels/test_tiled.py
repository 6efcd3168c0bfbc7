"""The tiled (CUDA) layout: a lossless re-arrangement of a packed layer, aligned, with small indices."""
import pytest
import torch
from conftest import GROUP_CASES

from gmc.groups import GroupSpec
from gmc.kernels.packed import pack
from gmc.kernels.quantize import quantize
from gmc.kernels.tiled import ENTRY_HEAD, PAD_BYTES, dense_weight, row_pad, tile, tile_rows, untile


def _tile(layer):
    return tile(layer.values, layer.row_idx, layer.row_ptr, layer.scales, *layer.shape, layer.spec.g_in)


@pytest.mark.parametrize("group,shape", GROUP_CASES + [("1x256", (300, 600))])
@pytest.mark.parametrize("how", ["none", "int8", "int4"])
@pytest.mark.parametrize("sparsity", [0.0, 0.5, 1.0])
def test_tile_and_untile_keep_every_weight(packed_case, group, shape, how, sparsity):
    packed, _ = packed_case(group, shape, sparsity)
    if how == "int4" and packed.spec.g_in % 8:
        pytest.skip("int4 packing needs g_in a multiple of 8")
    layer = quantize(packed, how)
    tiled = _tile(layer)
    assert torch.equal(dense_weight(tiled, *layer.shape, layer.spec.g_in).float(), layer.unpack().float())
    values, scales = untile(tiled, layer.row_idx, layer.row_ptr, *layer.shape, layer.spec.g_in)
    assert torch.equal(values, layer.values)
    assert (scales is None) == (layer.scales is None) and (scales is None or torch.equal(scales, layer.scales))


@pytest.mark.parametrize("how", ["none", "int8", "int4"])
def test_rows_start_16_byte_aligned_and_entries_follow_their_tiles(packed_case, how):
    """Every entry's values start at a multiple of 16 bytes (its offset counts units of ``row_pad``
    values), a tile's entries are its non-empty blocks in order, and each word counts the rows before it."""
    packed, _ = packed_case("1x256", (300, 600), 0.5)
    layer = quantize(packed, how)
    tiled = _tile(layer)
    entries, ptr = tiled.entries.long(), tiled.tile_ptr.long()
    first = entries[:, 1] * (PAD_BYTES if how == "int4" else row_pad(tiled.values.dtype))  # element (int4: byte)
    assert int(first.max()) < tiled.values.numel() and (entries[:, 1] >= 0).all()
    for t in range(ptr.numel() - 1):
        blocks = entries[ptr[t] : ptr[t + 1], 0]
        assert torch.equal(blocks, blocks.sort().values)
        rows = torch.arange(t * tiled.tile_r, min((t + 1) * tiled.tile_r, 300))
        kept = {b for b in range(3)
                if bool(torch.isin(rows, layer.row_idx[layer.row_ptr[b] : layer.row_ptr[b + 1]]).any())}
        assert set(blocks.tolist()) == kept
    words = entries[:, ENTRY_HEAD:]
    counts = torch.stack([((words & 0xFFFF) >> i) & 1 for i in range(16)], -1).sum(-1)  # [E, words] kept rows
    assert torch.equal(words >> 16, torch.cumsum(counts, 1) - counts)


def test_index_bytes_stay_under_one_percent_at_half_of_1x64():
    gen = torch.Generator().manual_seed(0)
    spec = GroupSpec(1, 64)
    keep = torch.rand(spec.grid((1024, 1024)), generator=gen) >= 0.5
    layer = pack(torch.randn(1024, 1024, generator=gen), keep, spec)
    tiled = _tile(layer.to(dtype=torch.bfloat16))
    index = tiled.entries.numel() * 4 + tiled.tile_ptr.numel() * 4
    assert index < 0.01 * tiled.values.numel() * 2


def test_tile_rows_follow_the_group_height(packed_case):
    for group, expected in (("1x64", 128), ("16x16", 128), ("32x32", 64), ("64x64", 64)):
        packed, _ = packed_case(group, (192, 256), 0.5)
        assert tile_rows(packed.row_idx, packed.row_ptr) == expected, group
    spec = GroupSpec(32, 32)  # every group kept, nothing to skip: the larger tile reads inputs once
    dense = pack(torch.randn(192, 256), torch.ones(spec.grid((192, 256))), spec)
    assert tile_rows(dense.row_idx, dense.row_ptr) == 128


def test_rows_pad_to_16_bytes_and_float_layouts_share_one_table(packed_case):
    dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8)
    assert [row_pad(d) for d in dtypes] == [8, 8, 8, 16, 32]
    packed, _ = packed_case("32x32", (100, 70), 0.5)  # a ragged 6-wide block: 8 values a row in every float
    fp32, bf16 = _tile(packed), _tile(packed.to(dtype=torch.bfloat16))
    assert torch.equal(fp32.entries, bf16.entries) and torch.equal(fp32.values.to(torch.bfloat16), bf16.values)
