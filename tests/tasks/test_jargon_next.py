"""The bundled jargon_next task: deterministic, well-formed items that lm-eval runs by name."""
import pytest
from conftest import smol_tokenizer, tiny_smol_model

from gmc.runtime.evaluate import zero_shot


def test_jargon_next_items_are_deterministic_and_well_formed():
    from gmc.tasks.jargon_next import CHOICES, build_items

    items = build_items()
    assert items == build_items() and len(items) > 50
    for item in items:
        assert len(item["choices"]) == len(set(item["choices"])) == CHOICES
        assert 0 <= item["label"] < CHOICES and "\xa0" not in item["context"]
    assert {item["label"] for item in items} == set(range(CHOICES))


@pytest.mark.slow
def test_jargon_next_runs_through_lm_eval_without_include_path():
    scores = zero_shot(tiny_smol_model(), smol_tokenizer(), ["jargon_next"], limit=4)
    assert scores["tasks"]["jargon_next"]["metric"] == "acc_norm"
    assert scores["tasks"]["jargon_next"]["samples"] == 4
