"""``gmc lower`` on a masks artifact of a tiny HF model directory: the torch round trip, one-line errors."""
import pytest
import torch
from conftest import (
    invoke_gmc,
    letters_tokenizer,
    mask_artifact,
    masked_copy,
    random_masks,
    tiny_model,
)

from gmc.formats.lowered import load_lowered
from gmc.groups import parse_pattern


@pytest.fixture
def masks_artifact(tmp_path):
    """``make(group, name) -> (artifact_dir, dense masked model)``: masks 'learned' on a tiny HF
    model directory."""
    from gmc.formats.artifact import save_artifact

    model = tiny_model("llama", intermediate_size=128, vocab_size=256)
    model_dir = tmp_path / "tiny"
    model.save_pretrained(model_dir)
    letters_tokenizer().save_pretrained(model_dir)

    def make(group="1x16", name="masks"):
        spec = parse_pattern(group)
        masks = random_masks(model, spec)
        artifact = mask_artifact(model, masks, spec, str(model_dir))
        return save_artifact(tmp_path / name, artifact), masked_copy(model, masks, spec)

    return make


@pytest.mark.slow
def test_cli_lower_torch_roundtrip(masks_artifact, tmp_path):
    artifact, dense = masks_artifact()
    result = invoke_gmc("lower", artifact, "--backend", "torch", "-o", tmp_path / "packed")
    assert result.exit_code == 0, result.output
    assert "x dense" in result.output
    model, tokenizer = load_lowered(tmp_path / "packed")
    assert tokenizer is not None
    ids = torch.tensor([tokenizer("abc")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, dense(ids).logits, atol=1e-5, rtol=1e-5)


def test_cli_lower_errors_are_one_line(masks_artifact, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    result = invoke_gmc("lower", empty, "-o", tmp_path / "x")
    assert result.exit_code == 2 and "masks.safetensors is missing" in result.output
    artifact, _ = masks_artifact()
    if not torch.cuda.is_available():
        result = invoke_gmc("lower", artifact, "--backend", "triton", "-o", tmp_path / "t")
        assert result.exit_code == 2 and "use --device cpu" in result.output
    result = invoke_gmc("lower", artifact, "--backend", "triton", "--compile", "-o", tmp_path / "t")
    assert result.exit_code == 2 and "for --device cuda it is refused" in result.output
    assert "gmc generate --compile --device cuda" in result.output
    result = invoke_gmc("lower", artifact, "--onnx-standard-ops", "-o", tmp_path / "t")
    assert result.exit_code == 2 and "--backend onnx" in result.output
    assert len(result.output.strip().splitlines()) == 1
    nm_artifact, _ = masks_artifact("2:4", name="nm")
    result = invoke_gmc("lower", nm_artifact, "-o", tmp_path / "t")
    assert result.exit_code == 2 and "N:M pattern 2:4" in result.output and "1x256" in result.output
    assert not (tmp_path / "t").exists()


@pytest.mark.slow
@pytest.mark.parametrize("how", ["int8", "int4"])
def test_cli_lower_quantize(masks_artifact, tmp_path, how):
    """``--quantize int8|int4``: quantized kept values with their scales, saved and reloaded; the
    lowered model equals the masked dense model up to each weight's rounding (half a step)."""
    from gmc.formats.lowered import load_program
    from gmc.graph.pipeline import LowerOptions, packed_head
    from gmc.kernels.linear import GroupSparseLinear, swap_group_sparse_linears

    artifact, dense = masks_artifact()
    result = invoke_gmc("lower", artifact, "--quantize", how, "-o", tmp_path / "q")
    assert result.exit_code == 0, result.output
    model, tokenizer = load_lowered(tmp_path / "q")
    layers = [m for m in model.modules() if isinstance(m, GroupSparseLinear)]
    values = {"int8": torch.int8, "int4": torch.uint8}[how]
    assert layers and all(m.values.dtype == values and m.scales is not None for m in layers)
    for name, module in model.named_modules():
        if isinstance(module, GroupSparseLinear):  # dequantized kept weights within half a step of the dense ones
            reference = dense.get_submodule(name).weight
            step = module.scales.max() if how == "int8" else (reference.max() - reference.min()) / 15
            assert (module.packed().unpack() - reference).abs().max() <= step / 2 + 1e-3 * reference.abs().max()
    ids = torch.tensor([tokenizer("abcd")["input_ids"]])
    with torch.no_grad():
        logits, expected = model(ids).logits, dense(ids).logits
        program = load_program(tmp_path / "q").module()(ids)
        # the program lowers the output head too, int8 (LowerOptions.head, packed_head): swap it in
        swap_group_sparse_linears(model, packed_head(model, {}, LowerOptions(quantize=how)))
        torch.testing.assert_close(program, model(ids).logits, atol=1e-5, rtol=1e-5)
    assert (logits - expected).abs().max() < (0.05 if how == "int8" else 0.25) * expected.abs().max()
    assert not torch.equal(logits, expected)  # it did quantize
    result = invoke_gmc("lower", artifact, "--backend", "dense", "--quantize", how, "-o", tmp_path / "x")
    assert result.exit_code == 2 and f"--quantize {how} applies to --backend packed, onnx, not dense" in result.output


@pytest.mark.slow
def test_cli_lower_shows_its_steps_and_prints_json(masks_artifact, tmp_path):
    import json

    artifact, _ = masks_artifact()
    result = invoke_gmc("lower", artifact, "-o", tmp_path / "packed")
    assert result.exit_code == 0, result.output
    assert "gmc lower (packed)" in result.stderr and "packing and lowering" in result.stderr
    result = invoke_gmc("lower", artifact, "--backend", "dense", "--json", "-o", tmp_path / "dense")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["backend"] == "dense" and summary["path"] == str(tmp_path / "dense")
    assert summary["packed_bytes"] == summary["dense_bytes"] > 0 and "gmc lower" not in result.stderr
