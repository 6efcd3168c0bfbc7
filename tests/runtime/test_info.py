"""``describe``: each form gmc reads, described from its files: a masks artifact, a lowered directory (kept
weights counted from the group indices, bytes from the headers), an ONNX file and a HF checkpoint's zeros."""
import json

import pytest
import torch
from conftest import letters_tokenizer, mask_artifact, random_masks, tiny_model

from gmc.errors import GmcError
from gmc.formats.artifact import save_artifact
from gmc.graph.pipeline import pack_targets
from gmc.groups import parse_pattern
from gmc.lower.stage import LowerConfig, lower_artifact
from gmc.runtime.info import describe, path_kind, render, summary_lines

GROUP = parse_pattern("1x64")  # down_proj [64, 96]: a ragged last block of 32 columns


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """``(model, masks, model_dir, artifact_dir)``: random 1x64 masks over a tiny Llama saved as a HF directory."""
    tmp = tmp_path_factory.mktemp("info")
    model = tiny_model("llama", intermediate_size=96, vocab_size=256)
    model.save_pretrained(tmp / "tiny")
    letters_tokenizer().save_pretrained(tmp / "tiny")
    masks = random_masks(model, GROUP, seed=3)
    artifact = save_artifact(tmp / "masks", mask_artifact(model, masks, GROUP, str(tmp / "tiny"), method="wanda"))
    return model, masks, tmp / "tiny", artifact


@pytest.fixture(scope="module")
def lowered(made, tmp_path_factory):
    """The artifact of ``made`` lowered with int4 values (two codes a byte: kept weights are not the values)."""
    out = tmp_path_factory.mktemp("lowered") / "int4"
    lower_artifact(LowerConfig(str(made[3]), str(out), quantize="int4", progress=False))
    return out


def test_a_masks_artifact_gives_each_targets_kept_share_and_its_provenance(made):
    model, masks, _, artifact = made
    info = describe(str(artifact))
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert (info["kind"], info["group"], info["method"], info["allocation"]) == ("masks", "1x64", "wanda", "uniform")
    assert [layer["name"] for layer in info["layers"]][:7] == [f"model.layers.0.{block}.{p}_proj" for block, p in (
        ("self_attn", "q"), ("self_attn", "k"), ("self_attn", "v"), ("self_attn", "o"), ("mlp", "gate"),
        ("mlp", "up"), ("mlp", "down"))]
    for layer in info["layers"]:
        assert layer["kept"] == pytest.approx(1 - manifest["layer_sparsity"][layer["name"]], abs=1e-12)
        assert layer["kept_groups"] == int(masks[layer["name"]].sum())
    assert info["total"]["kept"] == pytest.approx(1 - manifest["global_sparsity"], abs=1e-12)
    assert info["provenance"]["model"] == manifest["model"] and info["provenance"]["seed"] == 0
    assert set(info["files"]) == {".gmc-output", "manifest.json", "masks.safetensors"}
    assert info["bytes_on_disk"] == sum((artifact / name).stat().st_size for name in info["files"])
    assert json.loads(json.dumps(info)) == info


def test_a_lowered_directory_gives_kept_weights_bytes_and_what_it_carries(made, lowered):
    model, masks, _, artifact = made
    info = describe(str(lowered))
    expected = pack_targets(model, masks, GROUP, how="int4")
    kept = {layer["name"]: layer["kept_params"] for layer in describe(str(artifact))["layers"]}
    assert info["kind"] == "lowered" and info["format"] == {"name": "gmc-packed-bsc", "version": 3}
    assert [layer["name"] for layer in info["layers"]] == list(kept)
    for layer in info["layers"]:
        packed = expected[layer["name"]]
        assert (layer["dtype"], layer["group"], layer["kept_params"]) == ("int4", "1x64", kept[layer["name"]])
        assert layer["disk_bytes"] == packed.nbytes
        assert layer["memory_bytes"] == packed.nbytes + packed.row_idx.nbytes + packed.row_ptr.nbytes
        assert layer["dense_bytes"] == 4 * layer["params"]
    assert info["total"]["disk_bytes"] == sum(p.nbytes for p in expected.values())
    assert info["provenance"]["method"] == "wanda" and info["provenance"]["quantize"] == "int4"
    assert info["program_bytes"] == (lowered / "program.pt2").stat().st_size and info["compiled"] is None
    assert json.loads(json.dumps(info)) == info


def test_compiled_packages_are_read_from_compiled_json(lowered, tmp_path):
    import shutil

    out = shutil.copytree(lowered, tmp_path / "lowered")
    (out / "compiled").mkdir()
    stated = {"max_len": 64, "dtype": "float32", "device": "cpu", "torch": torch.__version__}
    (out / "compiled" / "compiled.json").write_text(json.dumps({**stated, "aliases": {}}))
    info = describe(str(out))
    assert info["compiled"] == {**stated, "bytes": (out / "compiled" / "compiled.json").stat().st_size}
    assert ("compiled", f"max_len 64, dtype float32, device cpu, torch {torch.__version__}, "
                        f"{info['compiled']['bytes']} B") in summary_lines(info)


def test_a_checkpoint_gives_its_zeros_and_the_groups_they_fill(tmp_path):
    model = tiny_model("llama", intermediate_size=96, vocab_size=256)
    q = model.model.layers[1].self_attn.q_proj.weight  # [64, 64]: 64 groups of 1x64
    q[:8] = 0  # 8 all-zero groups
    q[9, :4] = 0  # 4 zeros in a group with nonzero weights
    down = model.model.layers[0].mlp.down_proj.weight  # [64, 96]: the ragged block holds 32 columns
    down[:, 64:] = 0  # 64 all-zero ragged groups of 32 weights
    model.save_pretrained(tmp_path / "ckpt")
    info = describe(str(tmp_path / "ckpt"), "1x64")
    layers = {layer["name"]: layer for layer in info["layers"]}
    assert info["kind"] == "checkpoint" and info["group"] == "1x64" and len(layers) == 14
    q_info = layers["model.layers.1.self_attn.q_proj"]
    assert (q_info["zeros"], q_info["zero_groups"], q_info["grouped"]) == (516 / 4096, 8 / 64, 512 / 516)
    down_info = layers["model.layers.0.mlp.down_proj"]
    assert (down_info["zeros"], down_info["zero_groups"], down_info["grouped"]) == (1 / 3, 1 / 2, 1.0)
    assert layers["model.layers.0.self_attn.k_proj"]["grouped"] is None  # no zeros at all
    params = sum(layer["params"] for layer in layers.values())
    assert info["total"]["zeros"] == (516 + 2048) / params and info["total"]["grouped"] == 2560 / 2564
    assert describe(str(tmp_path / "ckpt"))["group"] == "1x256"  # gmc prune's default group
    assert json.loads(json.dumps(info)) == info


def test_paths_of_no_known_form_and_misplaced_groups_are_refused(made, tmp_path):
    _, _, model_dir, artifact = made
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(GmcError, match="is none of the forms gmc reads: expected a masks artifact"):
        describe(str(tmp_path / "notes.txt"))
    with pytest.raises(GmcError, match="does not exist"):
        path_kind(tmp_path / "missing")
    with pytest.raises(GmcError, match="--group measures the zero groups of a HF checkpoint; .* is a masks artifact"):
        describe(str(artifact), "1x16")
    (tmp_path / "pickled").mkdir()
    (tmp_path / "pickled" / "config.json").write_text("{}")
    (tmp_path / "pickled" / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(GmcError, match="holds no \\*.safetensors weights"):
        describe(str(tmp_path / "pickled"))


def test_render_prints_every_layer_and_the_total(made):
    from rich.console import Console

    console = Console(width=200, record=True)
    render(describe(str(made[3])), console)
    text = console.export_text()
    assert "model.layers.1.mlp.down_proj" in text and "total" in text and "method: wanda (uniform allocation)" in text


