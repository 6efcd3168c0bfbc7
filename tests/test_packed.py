"""Packing a group-masked weight: the packed layer is the masked weight, its bytes, save/load."""
import pytest
import torch

from conftest import GROUP_CASES, random_selectors
from gmc.errors import GmcError
from gmc.groups import GroupSpec, NMSpec, kept_params
from gmc.packed import load_packed, pack, quantize_int8, save_packed


@pytest.mark.parametrize("group,shape", GROUP_CASES)
def test_pack_unpack_is_the_masked_weight(group, shape):
    spec = GroupSpec(*map(int, group.split("x")))
    weight = torch.randn(shape)
    keep = random_selectors(spec, shape, 0.5, seed=3)
    packed = pack(weight, keep, spec)
    assert torch.equal(packed.unpack(), weight * spec.expand(keep, shape))
    assert packed.values.numel() == kept_params(spec, keep, shape)


@pytest.mark.parametrize(
    "group,shape,limit",
    [("1x256", (4096, 4096), 0.52), ("1x64", (4096, 4096), 0.55), ("32x32", (4096, 4096), 0.55)],
)
def test_packed_bytes_ratio_at_half_sparsity(group, shape, limit):
    spec = GroupSpec(*map(int, group.split("x")))
    weight = torch.randn(shape, dtype=torch.bfloat16)
    keep = (torch.rand(spec.grid(shape)) < 0.5).float()
    packed = pack(weight, keep, spec)
    ratio = packed.nbytes / packed.dense_nbytes
    assert ratio <= limit, f"{group}: {ratio:.4f}"


def test_save_load_roundtrip(tmp_path):
    spec = GroupSpec(32, 32)
    weight, bias = torch.randn(100, 70), torch.randn(100)
    packed = {"layer.q_proj": pack(weight, random_selectors(spec, (100, 70), 0.5, 1), spec, bias)}
    save_packed(tmp_path, packed, {"embed.weight": torch.ones(3, 4)}, {"model": "tiny"})
    loaded, dense, manifest = load_packed(tmp_path)
    assert manifest["model"] == "tiny" and manifest["layers"]["layer.q_proj"]["group"] == "32x32"
    assert torch.equal(loaded["layer.q_proj"].unpack(), packed["layer.q_proj"].unpack())
    assert torch.equal(loaded["layer.q_proj"].bias, bias)
    assert torch.equal(dense["embed.weight"], torch.ones(3, 4))
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_nm_pattern_is_rejected_with_supported_patterns():
    with pytest.raises(GmcError, match="1x256"):
        pack(torch.randn(8, 8), torch.ones(8, 8), NMSpec(2, 4))


def test_selector_shape_mismatch_is_a_gmc_error():
    with pytest.raises(GmcError, match="expected"):
        pack(torch.randn(8, 8), torch.ones(3, 3), GroupSpec(1, 4))


def test_load_packed_without_manifest(tmp_path):
    with pytest.raises(GmcError, match="gmc lower"):
        load_packed(tmp_path)


def test_int8_save_load_roundtrip(tmp_path):
    spec = GroupSpec(1, 32)
    weight, bias = torch.randn(100, 70), torch.randn(100)
    layer = quantize_int8(pack(weight, random_selectors(spec, (100, 70), 0.5, 2), spec, bias))
    save_packed(tmp_path, {"layer.up_proj": layer}, {}, {"model": "tiny"})
    loaded, _, manifest = load_packed(tmp_path)
    assert manifest["layers"]["layer.up_proj"]["dtype"] == "int8"
    got = loaded["layer.up_proj"]
    assert got.values.dtype == torch.int8 and torch.equal(got.values, layer.values)
    assert torch.equal(got.scales, layer.scales) and torch.equal(got.bias, bias)
    assert torch.equal(got.unpack(), layer.unpack()) and got.nbytes == layer.nbytes
