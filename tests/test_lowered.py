"""Eager lowered models: module swap, generate with KV cache, save/load, and `gmc lower`."""
import copy

import pytest
import torch
from click.testing import CliRunner

from gmc.groups import GroupSpec, parse_pattern
from gmc.lowered import GroupSparseLinear, load_lowered, pack_model, save_lowered, swap_group_sparse_linears

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tiny_llama(tie=False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, tie_word_embeddings=tie)
    return LlamaForCausalLM(config).eval()


def random_masks(model, spec, sparsity=0.5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {
        name: torch.rand(spec.grid(tuple(m.weight.shape)), generator=gen) >= sparsity
        for name, m in model.named_modules() if name.endswith(TARGETS)
    }


def folded(model, masks, spec):
    dense = copy.deepcopy(model)
    for name, module in dense.named_modules():
        if name in masks:
            module.weight.data *= spec.expand(masks[name].float(), tuple(module.weight.shape))
    return dense


@pytest.mark.parametrize("group", ["1x32", "32x32"])
def test_swapped_model_generates_like_the_folded_model(group):
    spec = GroupSpec(*map(int, group.split("x")))
    model = tiny_llama()
    masks = random_masks(model, spec)
    dense = folded(model, masks, spec)
    swap_group_sparse_linears(model, pack_model(model, masks, spec))
    assert sum(isinstance(m, GroupSparseLinear) for m in model.modules()) == 14
    ids = torch.randint(0, 256, (1, 6))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, dense(ids).logits, atol=1e-5, rtol=1e-5)
        expected = dense.generate(ids, max_new_tokens=8, do_sample=False, use_cache=True)
        got = model.generate(ids, max_new_tokens=8, do_sample=False, use_cache=True)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("tie", [False, True])
def test_save_and_load_lowered(tmp_path, tie):
    spec = GroupSpec(1, 16)
    model = tiny_llama(tie=tie)
    masks = random_masks(model, spec)
    dense = folded(model, masks, spec)
    save_lowered(tmp_path, model, None, pack_model(model, masks, spec), {"model": "tiny"})
    loaded, tokenizer = load_lowered(tmp_path)
    assert tokenizer is None
    if tie:
        assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    ids = torch.randint(0, 256, (2, 5))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, dense(ids).logits, atol=1e-5, rtol=1e-5)


def _hf_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, **{chr(97 + i): 2 + i for i in range(26)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>")


@pytest.fixture
def masks_artifact(tmp_path):
    """``(artifact_dir, model_dir)``: a tiny HF model directory and 1x16 masks learned 'on' it."""
    from gmc.artifact import MaskArtifact, build_manifest, save_artifact
    from gmc.model import model_fingerprint

    model = tiny_llama()
    model_dir = tmp_path / "tiny"
    model.save_pretrained(model_dir)
    _hf_tokenizer().save_pretrained(model_dir)

    def make(group="1x16", name="masks"):
        spec = parse_pattern(group)
        masks = random_masks(model, spec)
        shapes = {n: tuple(model.get_submodule(n).weight.shape) for n in masks}
        manifest = build_manifest(
            model_ref=str(model_dir), fingerprint=model_fingerprint(model), pattern=spec, masks=masks,
            shapes=shapes, method="magnitude", allocation="uniform", target_sparsity=0.5,
            calibration="none", seed=0,
        )
        return save_artifact(tmp_path / name, MaskArtifact(masks, manifest)), folded(model, masks, spec)

    return make


def _gmc(*args):
    from gmc.cli.lower import lower
    from gmc.cli.main import cli

    cli.add_command(lower)
    return CliRunner().invoke(cli, list(map(str, args)))


def test_cli_lower_torch_roundtrip(masks_artifact, tmp_path):
    artifact, dense = masks_artifact()
    result = _gmc("lower", artifact, "--backend", "torch", "-o", tmp_path / "packed")
    assert result.exit_code == 0, result.output
    assert "x dense" in result.output
    model, tokenizer = load_lowered(tmp_path / "packed")
    assert tokenizer is not None
    ids = torch.tensor([tokenizer("abc")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, dense(ids).logits, atol=1e-5, rtol=1e-5)


def test_cli_lower_errors_are_one_line(masks_artifact, tmp_path):
    from gmc.cli.main import cli  # noqa: F401

    empty = tmp_path / "empty"
    empty.mkdir()
    result = _gmc("lower", empty, "-o", tmp_path / "x")
    assert result.exit_code == 2 and "masks.safetensors is missing" in result.output
    artifact, _ = masks_artifact()
    if not torch.cuda.is_available():
        result = _gmc("lower", artifact, "--backend", "triton", "-o", tmp_path / "t")
        assert result.exit_code == 2 and "--backend torch" in result.output
    result = _gmc("lower", artifact, "--onnx-standard-ops", "-o", tmp_path / "t")
    assert result.exit_code == 2 and "--backend onnx" in result.output
    assert len(result.output.strip().splitlines()) == 1
    nm_artifact, _ = masks_artifact("2:4", name="nm")
    result = _gmc("lower", nm_artifact, "-o", tmp_path / "t")
    assert result.exit_code == 2 and "N:M pattern 2:4" in result.output and "1x256" in result.output
    assert not (tmp_path / "t").exists()


def test_exported_lowered_model_keeps_one_op_per_target():
    spec = GroupSpec(1, 32)
    model = tiny_llama()
    masks = random_masks(model, spec)
    swap_group_sparse_linears(model, pack_model(model, masks, spec))
    from gmc.trace import trace_model

    gm = trace_model(model)
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert ops.count(torch.ops.gmc.group_sparse_linear.default) == 14
