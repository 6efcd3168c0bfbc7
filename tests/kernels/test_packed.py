"""Packing a group-masked weight: the packed layer is the masked weight, its bytes, save/load."""
import pytest
import torch
from conftest import GROUP_CASES, random_selectors

from gmc.errors import GmcError
from gmc.groups import GroupSpec, NMSpec, kept_params
from gmc.kernels.packed import pack


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


def test_nm_pattern_is_rejected_with_supported_patterns():
    with pytest.raises(GmcError, match="1x256"):
        pack(torch.randn(8, 8), torch.ones(8, 8), NMSpec(2, 4))


def test_selector_shape_mismatch_is_a_gmc_error():
    with pytest.raises(GmcError, match="expected"):
        pack(torch.randn(8, 8), torch.ones(3, 3), GroupSpec(1, 4))
