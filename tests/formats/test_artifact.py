import json

import pytest
import torch
from conftest import mask_artifact, tiny_model

from gmc.errors import GmcError
from gmc.formats.artifact import load_artifact, save_artifact
from gmc.groups import parse_pattern


def _artifact(model, group="1x32"):
    """Random masks over the q and up projections only."""
    pattern = parse_pattern(group)
    masks = {n: torch.rand(pattern.grid(tuple(m.weight.shape))) > 0.5
             for n, m in model.named_modules() if n.endswith(("q_proj", "up_proj"))}
    return mask_artifact(model, masks, pattern)


def test_roundtrip_and_apply(tmp_path):
    model = tiny_model("llama")
    artifact = _artifact(model)
    save_artifact(tmp_path / "a", artifact)
    loaded = load_artifact(tmp_path / "a")
    assert set(loaded.masks) == set(artifact.masks)
    assert all(torch.equal(loaded.masks[n], artifact.masks[n]) for n in artifact.masks)
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    for key in ("gmc_version", "model", "model_fingerprint", "group", "method", "allocation",
                "target_sparsity", "global_sparsity", "layer_sparsity", "calibration", "seed"):
        assert key in manifest
    loaded.apply_to(model)
    weight = model.model.layers[0].self_attn.q_proj.weight
    expected_zero = ~loaded.pattern.expand(loaded.masks["model.layers.0.self_attn.q_proj"], tuple(weight.shape))
    assert (weight[expected_zero] == 0).all()


def test_mismatched_model_is_refused(tmp_path):
    artifact = _artifact(tiny_model("llama"))
    with pytest.raises(GmcError, match="fingerprint"):
        artifact.apply_to(tiny_model("llama", seed=1))
    with pytest.raises(GmcError, match="has weight"):
        artifact.apply_to(tiny_model("llama", hidden_size=96))
    with pytest.raises(GmcError, match="no linear named"):
        artifact.apply_to(tiny_model("llama", num_hidden_layers=1))


@pytest.mark.parametrize("damage", ["manifest_json", "manifest_keys", "masks_bytes", "masks_missing"])
def test_corrupted_artifact_is_one_line_error(tmp_path, damage):
    save_artifact(tmp_path / "a", _artifact(tiny_model("llama")))
    if damage == "manifest_json":
        (tmp_path / "a" / "manifest.json").write_text("{not json")
    elif damage == "manifest_keys":
        (tmp_path / "a" / "manifest.json").write_text("{}")
    elif damage == "masks_bytes":
        (tmp_path / "a" / "masks.safetensors").write_bytes(b"\x00garbage")
    else:
        (tmp_path / "a" / "masks.safetensors").unlink()
    with pytest.raises(GmcError) as info:
        load_artifact(tmp_path / "a")
    assert "\n" not in str(info.value)
