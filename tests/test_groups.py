import pytest
import torch

from gmc.errors import GmcError
from gmc.groups import (
    GroupSpec,
    NMSpec,
    global_sparsity,
    kept_params,
    layer_sparsity,
    parse_pattern,
)


@pytest.mark.parametrize("text, expected", [("1x256", GroupSpec(1, 256)), ("32X32", GroupSpec(32, 32)),
                                            (" 16 x 8 ", GroupSpec(16, 8)), ("2:4", NMSpec(2, 4))])
def test_parse(text, expected):
    assert parse_pattern(text) == expected


@pytest.mark.parametrize("text", ["0x256", "1x0", "-1x4", "abc", "1x", "256", "1x2x3", "4:2", "0:4", ""])
def test_parse_rejects_garbage_with_one_line(text):
    with pytest.raises(GmcError) as info:
        parse_pattern(text)
    message = str(info.value)
    assert "\n" not in message and repr(text) in message or "N:M" in message


def test_expand_is_kron_cropped_on_a_hand_case():
    spec = GroupSpec(2, 3)
    selectors = torch.tensor([[1, 0], [0, 1]])
    mask = spec.expand(selectors, (3, 5))  # ragged: 3 = 2 + 1 rows, 5 = 3 + 2 columns
    expected = torch.tensor([[1, 1, 1, 0, 0],
                             [1, 1, 1, 0, 0],
                             [0, 0, 0, 1, 1]])
    assert torch.equal(mask, expected)


def test_group_sizes_weigh_ragged_groups_by_real_parameters():
    spec = GroupSpec(1, 256)
    sizes = spec.group_sizes((2, 576))  # SmolLM2 hidden 576 = 256 + 256 + 64
    assert sizes.tolist() == [[256, 256, 64], [256, 256, 64]]
    assert int(sizes.sum()) == 2 * 576


def test_group_sum_matches_a_loop():
    spec = GroupSpec(2, 3)
    values = torch.arange(15.0).view(3, 5)
    expected = torch.tensor([[values[0:2, 0:3].sum(), values[0:2, 3:5].sum()],
                             [values[2:3, 0:3].sum(), values[2:3, 3:5].sum()]])
    assert torch.equal(spec.group_sum(values), expected)


def test_sparsity_counts_real_parameters():
    spec = GroupSpec(1, 256)
    shape = (1, 576)
    keep_ragged_only = torch.tensor([[0, 0, 1]])
    assert kept_params(spec, keep_ragged_only, shape) == 64
    assert layer_sparsity(spec, keep_ragged_only, shape) == pytest.approx(1 - 64 / 576)
    masks = {"a": keep_ragged_only, "b": torch.ones(1, 1)}
    shapes = {"a": shape, "b": (4, 100)}
    assert global_sparsity(spec, masks, shapes) == pytest.approx(1 - (64 + 400) / (576 + 400))


def test_nm_spec():
    spec = parse_pattern("2:4")
    assert spec.sparsity == 0.5 and spec.grid((3, 8)) == (3, 8)
    with pytest.raises(GmcError):
        NMSpec(4, 4)
