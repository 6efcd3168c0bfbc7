"""``gmc info``: tables with a total row, ``--json`` as one document equal to ``describe``, one-line refusals."""
import json

import pytest
from conftest import invoke_gmc, mask_artifact, random_masks, tiny_model

from gmc.formats.artifact import save_artifact
from gmc.groups import parse_pattern
from gmc.runtime.info import describe


@pytest.fixture
def paths(tmp_path):
    """``(checkpoint_dir, artifact_dir)``: a tiny Llama with some zeros, and 1x16 masks over it."""
    model = tiny_model("llama", intermediate_size=128, vocab_size=256)
    model.model.layers[0].mlp.up_proj.weight[:, :16] = 0
    model.save_pretrained(tmp_path / "ckpt")
    spec = parse_pattern("1x16")
    artifact = save_artifact(tmp_path / "masks", mask_artifact(model, random_masks(model, spec), spec, "tiny"))
    return tmp_path / "ckpt", artifact


def test_json_is_one_document_equal_to_describe(paths):
    checkpoint, artifact = paths
    for args, path, group in (((artifact,), artifact, None), ((checkpoint, "--group", "1x16"), checkpoint, "1x16")):
        result = invoke_gmc("info", *args, "--json")
        assert result.exit_code == 0, result.output
        assert json.loads(result.output) == describe(str(path), group)


def test_tables_list_every_layer_then_the_total_and_a_summary(paths):
    checkpoint, artifact = paths
    result = invoke_gmc("info", checkpoint, "--group", "1x16")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert any(line.startswith("│ model.layers.0.mlp.up_proj ") and "25.0%" in line for line in lines)
    assert any(line.startswith("│ total ") for line in lines)
    assert "zeros: 2.8% of 73,728 target weights; 2.8% of 1x16 groups are all zero, holding 100.0% of the zeros" \
        in result.output
    result = invoke_gmc("info", artifact)
    assert result.exit_code == 0 and "masks artifact" in result.output
    assert "method: magnitude (uniform allocation)" in result.output and "global_sparsity 0.5041," in result.output


def test_refusals_are_one_line(paths, tmp_path):
    checkpoint, artifact = paths
    cases = [(("info", tmp_path / "missing"), "does not exist"),
             (("info", artifact, "--group", "1x16"), "--group measures the zero groups of a HF checkpoint"),
             (("info", checkpoint, "--group", "2:4"), "--group 2:4 is N:M"),
             (("info", checkpoint, "--group", "big"), "bad group 'big'")]
    for args, message in cases:
        result = invoke_gmc(*args)
        assert result.exit_code == 2, result.output
        assert result.output.count("\n") == 1 and result.output.startswith("gmc: error: ") and message in result.output
