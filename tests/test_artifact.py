import json

import pytest
import torch

from conftest import tiny_model
from gmc.artifact import MaskArtifact, atomic_dir, build_manifest, load_artifact, save_artifact
from gmc.errors import GmcError
from gmc.groups import parse_pattern
from gmc.model import model_fingerprint


def _artifact(model, group="1x32"):
    pattern = parse_pattern(group)
    shapes = {n: tuple(m.weight.shape) for n, m in model.named_modules() if n.endswith(("q_proj", "up_proj"))}
    masks = {n: torch.rand(pattern.grid(s)) > 0.5 for n, s in shapes.items()}
    manifest = build_manifest(model_ref="tiny", fingerprint=model_fingerprint(model), pattern=pattern,
                              masks=masks, shapes=shapes, method="magnitude", allocation="uniform",
                              target_sparsity=0.5, calibration="none", seed=0)
    return MaskArtifact(masks, manifest)


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


def test_atomic_dir_leaves_nothing_on_failure(tmp_path):
    with pytest.raises(RuntimeError):
        with atomic_dir(tmp_path / "out", "masks") as tmp:
            (tmp / "half").write_text("x")
            raise RuntimeError("crash mid-write")
    assert list(tmp_path.iterdir()) == []


def test_atomic_dir_replaces_its_own_kind_only_with_overwrite(tmp_path):
    with atomic_dir(tmp_path / "out", "report") as tmp:
        (tmp / "old").write_text("old")
    with pytest.raises(GmcError, match="pass --overwrite"):
        with atomic_dir(tmp_path / "out", "report") as tmp:
            (tmp / "new").write_text("new")
    with atomic_dir(tmp_path / "out", "report", overwrite=True) as tmp:
        (tmp / "new").write_text("new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [".gmc-output", "new"]
