"""Heuristic masks meet their budgets on every pattern and allocation, ragged shapes included."""
import re

import pytest
import torch
from conftest import tiny_model

from gmc.graph.targets import DEFAULT_TARGETS
from gmc.groups import global_sparsity, layer_sparsity, parse_pattern
from gmc.masks.heuristics import heuristic_masks, nm_mask, owl_keep_ratios
from gmc.masks.sources.magnitude import magnitude_scores
from gmc.masks.sources.wanda import wanda_scores


def _targets(model):
    pattern = re.compile(DEFAULT_TARGETS)
    return {n: m.weight for n, m in model.named_modules() if pattern.search(n)}


@pytest.fixture(scope="module")
def weights():
    # hidden 128, intermediate 320: 1x256 and 32x32 groups are ragged on the MLP (320 = 256 + 64)
    return _targets(tiny_model("llama", hidden_size=128, intermediate_size=320, num_hidden_layers=3))


@pytest.mark.parametrize("group", ["1x256", "1x64", "32x32", "3x40"])
@pytest.mark.parametrize("method", ["magnitude", "wanda"])
@pytest.mark.parametrize("allocation", ["uniform", "global", "owl"])
def test_budget_met(weights, group, method, allocation):
    pattern = parse_pattern(group)
    generator = torch.Generator().manual_seed(0)
    norms = {n: torch.rand(w.shape[1], generator=generator) + 0.1 for n, w in weights.items()}
    scores = magnitude_scores(weights) if method == "magnitude" else wanda_scores(weights, norms)
    masks = heuristic_masks(scores, pattern, 0.5, allocation)
    shapes = {n: tuple(w.shape) for n, w in weights.items()}
    for name, mask in masks.items():
        assert mask.dtype == torch.bool and tuple(mask.shape) == pattern.grid(shapes[name])
        assert mask.any(), "no structure may be emptied"
    assert abs(global_sparsity(pattern, masks, shapes) - 0.5) <= 0.005
    if allocation == "uniform":
        for name in masks:
            tolerance = 0.01 + _granularity(pattern, shapes[name])
            assert abs(layer_sparsity(pattern, masks[name], shapes[name]) - 0.5) <= tolerance


def _granularity(pattern, shape):
    """Half the largest group's share of the layer: the best a per-layer budget can do."""
    return 0.5 * float(pattern.group_sizes(shape).max()) / (shape[0] * shape[1])


def test_global_allocation_differs_across_layers(weights):
    pattern = parse_pattern("1x64")
    masks = heuristic_masks(magnitude_scores(weights), pattern, 0.5, "global")
    rates = {round(layer_sparsity(pattern, m, tuple(weights[n].shape)), 3) for n, m in masks.items()}
    assert len(rates) > 1


def test_magnitude_keeps_the_largest_group():
    weight = torch.tensor([[1.0, 1.0, 5.0, 5.0], [0.1, 0.1, 0.2, 0.2]])
    masks = heuristic_masks(magnitude_scores({"w": weight}), parse_pattern("1x2"), 0.5, "uniform")
    assert masks["w"].tolist() == [[True, True], [False, False]]  # per layer, not per row


def test_wanda_weighs_by_activation_norm():
    weight = torch.ones(1, 4)
    norms = {"w": torch.tensor([10.0, 10.0, 1.0, 1.0])}
    masks = heuristic_masks(wanda_scores({"w": weight}, norms), parse_pattern("1x2"), 0.5, "uniform")
    assert masks["w"].tolist() == [[True, False]]


@pytest.mark.parametrize("n, m", [(2, 4), (4, 8)])
def test_nm_is_exact(n, m):
    scores = torch.rand(6, 16)
    mask = nm_mask(scores, parse_pattern(f"{n}:{m}"))
    assert (mask.view(6, -1, m).sum(-1) == n).all()
    torch.testing.assert_close(scores.view(6, -1, m).topk(n, -1).values.sum(-1),
                               (scores * mask).view(6, -1, m).sum(-1))


def test_owl_ratios_stay_in_band_and_keep_the_mean():
    generator = torch.Generator().manual_seed(0)
    scores = {}
    for layer in range(4):
        s = torch.rand(8, 8, generator=generator)
        s[0, : layer + 1] = 100.0  # more outliers in deeper layers
        scores[f"model.layers.{layer}.mlp.up_proj"] = s
    ratios = owl_keep_ratios(scores, 0.5)
    values = [ratios[f"model.layers.{i}.mlp.up_proj"] for i in range(4)]
    assert values == sorted(values)  # more outliers -> keep more
    assert max(values) - min(values) == pytest.approx(0.16)
    assert sum(values) / 4 == pytest.approx(0.5)

