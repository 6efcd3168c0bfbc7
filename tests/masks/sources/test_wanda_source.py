"""Wanda's activation norms: the observer's sum of squares, and the norms of a calibration pass."""
import torch
from conftest import tiny_model

from gmc.graph.pipeline import prepare
from gmc.groups import parse_pattern
from gmc.masks.sources.wanda import ActivationNorms, activation_norms


def test_activation_norms_observer():
    observer = ActivationNorms(3)
    observer(torch.tensor([[[1.0, 2.0, 0.0]], [[2.0, 0.0, 0.0]]]))
    assert observer.tokens == 2
    torch.testing.assert_close(observer.norm(), torch.tensor([5.0 ** 0.5, 2.0, 0.0]))


def test_a_calibration_pass_measures_every_target_input_and_detaches_the_observers():
    model = tiny_model("llama")
    gm, targets, selectors = prepare(model, parse_pattern("1x16"))
    norms = activation_norms(gm, selectors, torch.randint(0, 320, (2, 8)))
    assert set(norms) == {t.name for t in targets}
    assert all(norms[t.name].shape == (t.shape[1],) and bool((norms[t.name] > 0).all()) for t in targets)
    assert all(selector.observer is None for selector in selectors.values())
