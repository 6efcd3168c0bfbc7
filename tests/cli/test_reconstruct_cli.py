"""``gmc reconstruct`` on a tiny HF model directory and magnitude masks of it."""
from __future__ import annotations

import json

import torch
from conftest import invoke_gmc, letters_tokenizer, tiny_model

from gmc.formats.artifact import load_artifact
from gmc.inputs.model import load_model


def test_reconstruct_writes_weights_and_keeps_masks(magnitude_workspace, tmp_path):
    model_dir, artifact, calib = magnitude_workspace
    out = tmp_path / "rec"
    result = invoke_gmc("reconstruct", artifact, "--calib", calib, "--nsamples", 4, "--seq-len", 32, "-o", out,
                        "--quiet")
    assert result.exit_code == 0, result.output
    source, rebuilt = load_artifact(artifact), load_artifact(out)
    assert set(rebuilt.masks) == set(source.masks)
    assert all(torch.equal(rebuilt.masks[n], source.masks[n]) for n in source.masks)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["weights_updated"] is True
    assert manifest["reconstruction"]["nsamples"] == 4 and manifest["reconstruction"]["seq_len"] == 32
    assert str(calib) in manifest["reconstruction"]["calibration"]
    assert manifest["global_sparsity"] == source.manifest["global_sparsity"]
    assert (out / "weights.safetensors").is_file() and (out / "train_log.jsonl").read_bytes() == b"{}\n"

    dense = load_model(str(model_dir)).model
    folded = rebuilt.apply_to(load_model(str(model_dir)).model)
    modules, dense_modules = dict(folded.named_modules()), dict(dense.named_modules())
    pattern = rebuilt.pattern
    for name, selectors in rebuilt.masks.items():
        weight = modules[name].weight
        keep = pattern.expand(selectors, tuple(weight.shape))
        assert torch.all(weight[~keep] == 0)
        assert not torch.equal(weight[keep], dense_modules[name].weight[keep])  # kept weights moved


def test_reconstruct_errors_are_one_line(magnitude_workspace, tmp_path):
    model_dir, artifact, calib = magnitude_workspace
    missing = invoke_gmc("reconstruct", tmp_path / "nope", "--calib", calib, "-o", tmp_path / "x")
    assert missing.exit_code == 2 and missing.output.startswith("gmc: error: masks artifact not found")
    same = invoke_gmc("reconstruct", artifact, "--calib", calib, "-o", artifact)
    assert same.exit_code == 2 and "-o must differ" in same.output
    no_calib = invoke_gmc("reconstruct", artifact, "-o", tmp_path / "x")
    assert no_calib.exit_code == 2 and "--calib" in no_calib.output
    other = tmp_path / "other"
    tiny_model("llama", seed=1).save_pretrained(other)
    letters_tokenizer().save_pretrained(other)
    wrong = invoke_gmc("reconstruct", artifact, "--calib", calib, "--model", other, "-o", tmp_path / "x")
    assert wrong.exit_code == 2 and "fingerprint" in wrong.output
    errors = [line for line in wrong.output.splitlines() if line.startswith("gmc:")]
    assert len(errors) == 1  # (transformers' own loading bar may precede it)
    assert not (tmp_path / "x").exists()
