"""Packing a group-masked weight: the packed layer is the masked weight, its bytes, save/load."""
import pytest
import torch
from conftest import GROUP_CASES, random_selectors

from gmc.errors import GmcError
from gmc.groups import GroupSpec, NMSpec, kept_params
from gmc.kernels.packed import PackedLinear, check_indices, pack


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


def _broken(case: str, idx: torch.Tensor, ptr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, str]:
    """``(group_idx, group_ptr, the error's words)`` of a 1x16 layer on (64, 64) (G_out 64, G_in 4,
    32 groups a block) with its indices broken as ``case`` says."""
    idx, ptr = idx.clone(), ptr.clone()
    if case == "negative index":
        idx[5] = -3
        return idx, ptr, "group_idx holds -3 at position 5; indices must lie in [0, 64)"
    if case == "index past the groups":
        idx[5] = 64
        return idx, ptr, "group_idx holds 64 at position 5; indices must lie in [0, 64)"
    if case == "index not rising in a block":
        idx[2] = idx[1]
        return idx, ptr, f"group_idx holds {int(idx[1])} at position 2 after {int(idx[1])} in input block 0"
    if case == "decreasing pointers":
        ptr[2] = ptr[1] - 1
        return idx, ptr, f"group_ptr decreases at position 2 ({int(ptr[1])} then {int(ptr[2])})"
    if case == "pointers from 1":
        ptr[0] = 1
        return idx, ptr, "group_ptr starts at 1; pointers must start at 0"
    if case == "pointers past the indices":
        ptr[4] += 1
        return idx, ptr, f"group_ptr ends at {int(ptr[4])}; the last pointer must be {idx.numel()}"
    return idx.float(), ptr, "group_idx is torch.float32"


@pytest.mark.parametrize("case", ["negative index", "index past the groups", "index not rising in a block",
                                  "decreasing pointers", "pointers from 1", "pointers past the indices",
                                  "float indices"])
def test_indices_that_break_the_layout_are_refused_naming_layer_and_tensor(case):
    spec, shape = GroupSpec(1, 16), (64, 64)
    keep = torch.zeros(spec.grid(shape), dtype=torch.bool)
    keep[::2] = True
    layer = pack(torch.randn(shape), keep, spec)
    group_idx, group_ptr, words = _broken(case, layer.group_idx, layer.group_ptr)
    with pytest.raises(GmcError) as error:
        PackedLinear(layer.values, group_idx, group_ptr, shape, spec, name="model.layers.0.mlp.up_proj")
    message = str(error.value)
    assert message.startswith("packed layer model.layers.0.mlp.up_proj: ") and words in message, message
    assert len(message.splitlines()) == 1
    with pytest.raises(GmcError, match="^packed layer: "):  # unnamed, it is still called a packed layer
        check_indices(group_idx, group_ptr, spec, shape)
