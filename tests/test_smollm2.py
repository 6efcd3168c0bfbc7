"""The bundled real model end to end (slow: loads SmolLM2-135M)."""
import copy
import json
import math

import pytest
import torch

from gmc.formats.artifact import load_artifact
from gmc.masks.learn import LearnConfig
from gmc.masks.prune import PruneConfig, prune

pytestmark = pytest.mark.slow


def _nll(model, ids):
    with torch.no_grad():
        return float(model(ids, labels=ids).loss)


def test_wanda_1x256_groups_on_ragged_smollm2(smollm2, tmp_path):
    # hidden 576 = 2 x 256 + 64: every q/k/v/gate/up row has a ragged last group
    artifact = prune(PruneConfig(model="smollm2-135m", output=str(tmp_path / "wanda"), method="wanda",
                                 group="1x256", calib="bundled", nsamples=4, seq_len=64), smollm2)
    manifest = json.loads((tmp_path / "wanda" / "manifest.json").read_text())
    assert len(manifest["layer_sparsity"]) == 30 * 7
    assert abs(manifest["global_sparsity"] - 0.5) <= 0.005
    q = artifact.masks["model.layers.0.self_attn.q_proj"]
    assert tuple(q.shape) == (576, 3)

    ids = smollm2.tokenizer("The Jargon File is a glossary of hacker slang. It was started in 1975 "
                            "and maintained for decades by many contributors.", return_tensors="pt").input_ids
    pruned = copy.deepcopy(smollm2.model)
    load_artifact(tmp_path / "wanda").apply_to(pruned)
    dense_nll, pruned_nll = _nll(smollm2.model, ids), _nll(pruned, ids)
    # 50% of a 135M model in 1x256 groups is brutal (held-out ppl ~1e5, docs/learning-bench.md):
    # only check that the masks really act and the numbers stay finite
    assert math.isfinite(pruned_nll) and dense_nll < pruned_nll
    weight = pruned.model.layers[0].self_attn.q_proj.weight
    assert (weight[~artifact.pattern.expand(q, tuple(weight.shape))] == 0).all()


def test_groupmask_learns_on_smollm2(smollm2, tmp_path):
    before = smollm2.model.model.layers[5].mlp.down_proj.weight.clone()
    artifact = prune(PruneConfig(model="smollm2-135m", output=str(tmp_path / "gm"), group="1x64",
                                 calib="bundled", nsamples=4, seq_len=32,
                                 learn=LearnConfig(steps=3, head="lowrank", progress=False)), smollm2)
    assert abs(artifact.manifest["global_sparsity"] - 0.5) <= 0.005
    assert torch.equal(before, smollm2.model.model.layers[5].mlp.down_proj.weight)
    log = (tmp_path / "gm" / "train_log.jsonl").read_text().splitlines()
    assert len(log) == 3
