"""The table of mask sources: what every row must state, and every source's masks at the target sparsity
on a tiny model (a new source is covered by adding its row)."""
import dataclasses
import inspect

import pytest
import torch
from conftest import CharTokenizer, tiny_model

from gmc.graph.pipeline import prepare
from gmc.groups import layer_sparsity, parse_pattern
from gmc.inputs.calib import load_texts, token_blocks
from gmc.inputs.model import LoadedModel
from gmc.masks.budget import LEARNED_ALLOCATIONS
from gmc.masks.learn import LearnConfig
from gmc.masks.prune import PruneConfig, prune
from gmc.masks.sources import (
    ALLOCATION_CHOICES,
    INITS,
    LEARNED_METHODS,
    METHOD_HELP,
    METHODS,
    SOURCES,
    MaskSource,
)

GROUP = "1x16"
LEARN_FIELDS = {f.name for f in dataclasses.fields(LearnConfig)}


@pytest.mark.parametrize("name", METHODS)
def test_every_row_states_what_the_rest_of_gmc_reads(name):
    source = SOURCES[name]
    assert isinstance(source, MaskSource) and source.name == name
    assert source.allocations and all(isinstance(a, str) for a in source.allocations)
    assert source.help and "\n" not in source.help and f"{name}: {source.help}" in METHOD_HELP
    assert set(source.ignores) <= LEARN_FIELDS and (source.learns or not source.ignores)
    if source.learns:  # a learned run distils on calibration blocks and shares the learned budget
        assert source.needs_blocks and source.allocations == LEARNED_ALLOCATIONS
    assert source.choose.__module__ == f"gmc.masks.sources.{inspect.getmodulename(inspect.getfile(source.choose))}"
    assert len(inspect.signature(source.choose).parameters) == 7
    if source.prior is not None:
        assert len(inspect.signature(source.prior).parameters) == 6


def test_the_names_gmc_offers_come_from_the_table():
    assert METHODS == tuple(SOURCES)
    assert LEARNED_METHODS == tuple(n for n, s in SOURCES.items() if s.learns)
    assert INITS == ("none", *(n for n, s in SOURCES.items() if s.prior is not None))
    assert set(ALLOCATION_CHOICES) == {a for s in SOURCES.values() for a in s.allocations}


def test_a_learned_run_reaches_its_prior_through_the_config(tmp_path):
    """The learned sources are rows of the table they would read: the config resolves --init's source."""
    for init in INITS:
        config = PruneConfig(model="tiny", output=str(tmp_path / "out"), group=GROUP, learn=LearnConfig(init=init))
        assert config.init_source is (None if init == "none" else SOURCES[init])


def _config(tmp_path, name, **overrides):
    """The run of ``name`` on a tiny model: calibration options only where the source reads blocks."""
    source = SOURCES[name]
    data = dict(calib="bundled", nsamples=4, seq_len=32) if source.needs_blocks else {}
    learn = LearnConfig(steps=4, progress=False) if source.learns else LearnConfig(progress=False)
    return PruneConfig(model="tiny", output=str(tmp_path / name), method=name, group=GROUP, sparsity=0.5, seed=0,
                       learn=learn, **data, **overrides)


@pytest.mark.parametrize("name", METHODS)
def test_every_source_lands_on_the_target_sparsity(tmp_path, name):
    model = tiny_model("llama")
    artifact = prune(_config(tmp_path, name), LoadedModel(model, CharTokenizer(), "tiny"))
    manifest = artifact.manifest
    assert manifest["method"] == name and manifest["allocation"] == SOURCES[name].allocations[0]
    assert abs(manifest["global_sparsity"] - 0.5) <= 0.01
    assert len(artifact.masks) == 14 and all(mask.any() for mask in artifact.masks.values())


@pytest.mark.parametrize("name", [n for n, s in SOURCES.items() if s.prior is not None])
def test_every_prior_is_the_one_shot_mask_at_the_target_in_every_layer(tmp_path, name):
    model = tiny_model("llama")
    loaded = LoadedModel(model, CharTokenizer(), "tiny")
    config = _config(tmp_path, "groupmask")
    pattern = parse_pattern(GROUP)
    gm, targets, selectors = prepare(model, pattern, config.targets)
    blocks = token_blocks(CharTokenizer(), load_texts("bundled", "train")[0], 32, 4, 0)
    masks, scores = SOURCES[name].prior(config, loaded, gm, targets, selectors, blocks)
    for target in targets:
        assert masks[target.name].shape == pattern.grid(target.shape)
        assert abs(layer_sparsity(pattern, masks[target.name], target.shape) - 0.5) <= 16 / target.shape[1]
        if scores is not None:
            assert scores[target.name].shape == target.shape and scores[target.name].dtype == torch.float32
