"""``gmc reconstruct`` (and ``gmc prune --method sparsegpt``) on a tiny HF model directory."""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from gmc.artifact import MaskArtifact, build_manifest, load_artifact, save_artifact
from gmc.groups import parse_pattern
from gmc.model import load_model, model_fingerprint
from tests.conftest import tiny_model

TEXT = "the quick brown fox jumps over the lazy dog and keeps running far away "


def _hf_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, " ": 2, **{chr(97 + i): 3 + i for i in range(26)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>")


@pytest.fixture
def workspace(tmp_path):
    """``(model_dir, artifact_dir, calib_txt)``: a tiny Llama, 1x16 magnitude masks, some text."""
    model = tiny_model("llama")
    model_dir = tmp_path / "tiny"
    model.save_pretrained(model_dir)
    _hf_tokenizer().save_pretrained(model_dir)
    pattern = parse_pattern("1x16")
    masks, shapes = {}, {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.endswith("_proj"):
            shapes[name] = tuple(module.weight.shape)
            scores = pattern.group_sum(module.weight.abs())
            masks[name] = scores >= scores.median()
    manifest = build_manifest(model_ref=str(model_dir), fingerprint=model_fingerprint(model), pattern=pattern,
                              masks=masks, shapes=shapes, method="magnitude", allocation="uniform",
                              target_sparsity=0.5, calibration="none", seed=0)
    artifact = save_artifact(tmp_path / "masks", MaskArtifact(masks, manifest), [("train_log.jsonl", b"{}\n")])
    calib = tmp_path / "calib.txt"
    calib.write_text("\n".join(TEXT * 3 for _ in range(20)))
    return model_dir, artifact, calib


def _gmc(*args):
    from gmc.cli.main import _register_commands, cli

    _register_commands()
    return CliRunner().invoke(cli, [str(a) for a in args])


def test_reconstruct_writes_weights_and_keeps_masks(workspace, tmp_path):
    model_dir, artifact, calib = workspace
    out = tmp_path / "rec"
    result = _gmc("reconstruct", artifact, "--calib", calib, "--nsamples", 4, "--seq-len", 32, "-o", out, "--quiet")
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


def test_reconstruct_errors_are_one_line(workspace, tmp_path):
    model_dir, artifact, calib = workspace
    missing = _gmc("reconstruct", tmp_path / "nope", "--calib", calib, "-o", tmp_path / "x")
    assert missing.exit_code == 2 and missing.output.startswith("gmc: error: masks artifact not found")
    same = _gmc("reconstruct", artifact, "--calib", calib, "-o", artifact)
    assert same.exit_code == 2 and "-o must differ" in same.output
    no_calib = _gmc("reconstruct", artifact, "-o", tmp_path / "x")
    assert no_calib.exit_code == 2 and "--calib" in no_calib.output
    other = tmp_path / "other"
    tiny_model("llama", seed=1).save_pretrained(other)
    _hf_tokenizer().save_pretrained(other)
    wrong = _gmc("reconstruct", artifact, "--calib", calib, "--model", other, "-o", tmp_path / "x")
    assert wrong.exit_code == 2 and "fingerprint" in wrong.output
    errors = [line for line in wrong.output.splitlines() if line.startswith("gmc:")]
    assert len(errors) == 1  # (transformers' own loading bar may precede it)
    assert not (tmp_path / "x").exists()


def test_prune_sparsegpt_2_4_via_cli(workspace, tmp_path):
    model_dir, _, calib = workspace
    out = tmp_path / "sgpt"
    result = _gmc("prune", model_dir, "--method", "sparsegpt", "--group", "2:4", "--calib", calib,
                  "--nsamples", 4, "--seq-len", 32, "-o", out, "--quiet")
    assert result.exit_code == 0, result.output
    artifact = load_artifact(out)
    assert artifact.manifest["weights_updated"] is True and artifact.manifest["method"] == "sparsegpt"
    assert len(artifact.weights) == len(artifact.masks) == 14
    for name, keep in artifact.masks.items():
        assert torch.all(keep.reshape(keep.shape[0], -1, 4).sum(-1) == 2)
        assert torch.all(artifact.weights[name][~keep] == 0)
