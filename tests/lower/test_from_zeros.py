"""``gmc lower HF_DIR --group``: a checkpoint pruned elsewhere lowers by its all-zero groups, to what its own
masks artifact lowers to; checkpoints whose zeros do not form the groups, and misplaced options, are refused."""
import pytest
import torch
from conftest import invoke_gmc, letters_tokenizer, tiny_model
from safetensors.torch import load_file

from gmc.errors import GmcError
from gmc.formats.hf_checkpoint import packed_config
from gmc.formats.lowered import load_lowered
from gmc.groups import GroupSpec
from gmc.inputs.model import LoadedModel, load_model
from gmc.lower.from_zeros import ZeroGroups, artifact_from_zeros, zero_groups
from gmc.lower.stage import LowerConfig
from gmc.masks.prune import PruneConfig, prune
from gmc.runtime.info import describe


@pytest.fixture(scope="module")
def pruned(tmp_path_factory):
    """``(model_dir, artifact_dir, dense_dir)``: a tiny Llama, its Wanda 1x16 masks and the checkpoint with
    them folded in (``--save-dense``), as another tool would write it."""
    tmp = tmp_path_factory.mktemp("from_zeros")
    tiny_model("llama", intermediate_size=128, vocab_size=256).save_pretrained(tmp / "tiny")
    letters_tokenizer().save_pretrained(tmp / "tiny")
    prune(PruneConfig(str(tmp / "tiny"), str(tmp / "masks"), method="wanda", group="1x16", calib="bundled",
                      nsamples=4, seq_len=32, save_dense=str(tmp / "dense")))
    return tmp / "tiny", tmp / "masks", tmp / "dense"


def _error_lines(result) -> list[str]:
    assert "Traceback" not in result.output
    return [line for line in result.output.splitlines() if line.startswith("gmc: error:")]


def test_the_masks_read_from_the_zeros_are_the_pruning_tools_masks(pruned):
    from gmc.formats.artifact import load_artifact

    _, artifact, dense = pruned
    derived = artifact_from_zeros(load_model(str(dense)), GroupSpec(1, 16), tolerance=0.0)
    masks = load_artifact(artifact).masks
    assert derived.masks.keys() == masks.keys()
    for name, mask in masks.items():
        assert torch.equal(derived.masks[name], mask), name
    assert derived.manifest["global_sparsity"] == pytest.approx(0.5)


@pytest.mark.slow  # lowers (and exports) twice
def test_a_pruned_checkpoint_lowers_to_what_its_masks_artifact_lowers_to(pruned, tmp_path):
    _, artifact, dense = pruned
    for source, extra, out in ((dense, ["--group", "1x16"], "a"), (artifact, [], "b")):
        result = invoke_gmc("lower", source, *extra, "--quiet", "-o", tmp_path / out)
        assert result.exit_code == 0, result.output
    stored = [load_file(tmp_path / out / "model.safetensors") for out in ("a", "b")]
    assert stored[0].keys() == stored[1].keys() and any(key.endswith(".group_idx") for key in stored[0])
    for key in stored[0]:
        assert torch.equal(stored[0][key], stored[1][key]), key
    configs = [packed_config(tmp_path / out) for out in ("a", "b")]
    assert configs[0]["layers"] == configs[1]["layers"]
    assert configs[0]["provenance"]["method"] == "zeros" and configs[0]["provenance"]["model"] == str(dense)
    ids = torch.tensor([[1, 5, 9, 2, 14, 3, 20, 7]])
    with torch.no_grad():
        logits = [load_lowered(tmp_path / out)[0](ids).logits for out in ("a", "b")]
        checkpoint = load_model(str(dense)).model(ids).logits
    torch.testing.assert_close(logits[0], logits[1], atol=0, rtol=0)
    torch.testing.assert_close(logits[0], checkpoint, atol=1e-5, rtol=1e-5)


def test_zeros_that_do_not_form_the_groups_are_refused_in_one_line(pruned, tmp_path):
    model_dir, _, dense = pruned
    result = invoke_gmc("lower", model_dir, "--group", "1x16", "--quiet", "-o", tmp_path / "x")
    assert result.exit_code == 2
    assert _error_lines(result) == [f"gmc: error: no all-zero 1x16 groups in {model_dir}'s targets: nothing to "
                                    f"lower; 0.0% of groups are zero (0.0% of weights)"]
    result = invoke_gmc("lower", dense, "--group", "1x32", "--quiet", "-o", tmp_path / "x")
    assert result.exit_code == 2
    (line,) = _error_lines(result)
    assert f"the zeros of {dense}'s targets do not form 1x32 groups" in line and "below 99.0%" in line
    assert not (tmp_path / "x").exists()


def test_group_goes_with_a_checkpoint_and_only_there(pruned, tmp_path):
    model_dir, artifact, dense = pruned
    out = str(tmp_path / "x")
    with pytest.raises(GmcError, match="--group applies to a HF checkpoint pruned elsewhere; .* is a masks artifact"):
        LowerConfig(str(artifact), out, group="1x16")
    with pytest.raises(GmcError, match="is a HF checkpoint, not a masks artifact: pass --group GOUTxGIN"):
        LowerConfig(str(dense), out)
    with pytest.raises(GmcError, match="--zero-tolerance applies with --group"):
        LowerConfig(str(artifact), out, zero_tolerance=0.1)
    with pytest.raises(GmcError, match="--group 2:4 is N:M"):
        LowerConfig(str(dense), out, group="2:4")
    with pytest.raises(GmcError, match="--model names the base model of a masks artifact"):
        LowerConfig(str(dense), out, group="1x16", model=str(model_dir))
    result = invoke_gmc("lower", dense, "-o", out)
    assert result.exit_code == 2 and len(_error_lines(result)) == 1 and "--group" in result.output


def test_zero_groups_count_ragged_groups_at_their_real_size():
    spec = GroupSpec(2, 16)
    weight = torch.ones(5, 40)  # grid 3 x 3: the last row of groups holds 1 row, the last column 8 columns
    weight[0:2, 0:16] = 0  # a full group: 32 weights
    weight[4:5, 32:40] = 0  # the ragged corner group: 8 weights
    weight[2, 20] = 0  # a stray zero in a kept group
    empty, counts = zero_groups(weight, spec)
    assert empty.tolist() == [[True, False, False], [False, False, False], [False, False, True]]
    assert counts == ZeroGroups(params=200, zeros=41, groups=9, zero_groups=2, in_zero_groups=40)
    assert counts.grouped_fraction == 40 / 41 and counts.zero_group_fraction == 2 / 9


def test_the_derived_artifact_carries_the_checkpoints_weights_and_fingerprint():
    from gmc.formats.artifact import model_fingerprint

    model = tiny_model("llama", intermediate_size=128, vocab_size=256)
    spec = GroupSpec(1, 16)
    q = model.model.layers[0].self_attn.q_proj.weight  # [64, 64]
    q[:, :16] = 0  # 64 all-zero groups
    q[0, 20] = 0  # 1 stray zero of 1025
    loaded = LoadedModel(model, None, "tiny")
    with pytest.raises(GmcError, match=r"99\.9% of its 1,025 zero weights lie in all-zero groups, below 100\.0%"):
        artifact_from_zeros(loaded, spec, tolerance=0.0)
    artifact = artifact_from_zeros(loaded, spec, tolerance=0.01)
    name = "model.layers.0.self_attn.q_proj"
    assert artifact.masks[name][:, 0].sum() == 0 and artifact.masks[name][:, 1:].all()
    assert artifact.weights[name] is not None and torch.equal(artifact.weights[name], q)
    assert artifact.manifest["model_fingerprint"] == model_fingerprint(model)
    assert artifact.manifest["provenance"] == "derived from zeros of tiny"
    artifact.check_matches(model, model_fingerprint(model))


def test_info_reports_the_zero_groups_of_the_pruned_checkpoint(pruned):
    _, artifact, dense = pruned
    found = describe(str(dense), "1x16")
    masks = {layer["name"]: layer for layer in describe(str(artifact))["layers"]}
    assert found["kind"] == "checkpoint" and found["group"] == "1x16"
    assert [layer["name"] for layer in found["layers"]] == list(masks)
    for layer in found["layers"]:
        assert layer["zero_groups"] == 1 - masks[layer["name"]]["kept_groups"] / masks[layer["name"]]["groups"]
        assert layer["grouped"] == 1.0
    assert found["total"]["zeros"] == pytest.approx(0.5) and found["total"]["grouped"] == 1.0
