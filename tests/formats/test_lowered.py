"""Eager lowered models: module swap, generate with KV cache, save/load, export."""
import pytest
import torch
from conftest import masked_copy, random_masks, tiny_model, x_quantized

from gmc.formats.lowered import load_lowered, save_lowered
from gmc.graph.pipeline import pack_targets
from gmc.groups import GroupSpec
from gmc.kernels.linear import GroupSparseLinear, swap_group_sparse_linears
from gmc.kernels.quantize import quantize_int8


@pytest.mark.parametrize("group", ["1x32", "32x32"])
def test_swapped_model_generates_like_the_folded_model(group):
    spec = GroupSpec(*map(int, group.split("x")))
    model = tiny_model("llama", intermediate_size=128, vocab_size=256)
    masks = random_masks(model, spec)
    dense = masked_copy(model, masks, spec)
    swap_group_sparse_linears(model, pack_targets(model, masks, spec))
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
    model = tiny_model("llama", intermediate_size=128, vocab_size=256, tie_word_embeddings=tie)
    masks = random_masks(model, spec)
    dense = masked_copy(model, masks, spec)
    save_lowered(tmp_path, model, None, pack_targets(model, masks, spec), {"model": "tiny"})
    loaded, tokenizer = load_lowered(tmp_path)
    assert tokenizer is None
    if tie:
        assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    ids = torch.randint(0, 256, (2, 5))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, dense(ids).logits, atol=1e-5, rtol=1e-5)


def test_exported_lowered_model_keeps_one_op_per_target():
    spec = GroupSpec(1, 32)
    model = tiny_model("llama", intermediate_size=128, vocab_size=256)
    masks = random_masks(model, spec)
    swap_group_sparse_linears(model, pack_targets(model, masks, spec))
    from gmc.graph.trace import trace_model

    gm = trace_model(model)
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert ops.count(torch.ops.gmc.group_sparse_linear.default) == 14


def _int8_case(group="1x32"):
    """A tiny model, its int8-quantized packed targets and the dense model with their dequantized weights."""
    spec = GroupSpec(*map(int, group.split("x")))
    model = tiny_model("llama", intermediate_size=128, vocab_size=256)
    masks = random_masks(model, spec)
    packed = {name: quantize_int8(layer) for name, layer in pack_targets(model, masks, spec).items()}
    dense = masked_copy(model, masks, spec)
    for name, layer in packed.items():
        dense.get_submodule(name).weight.data = layer.unpack()
    return model, packed, dense


def test_int8_swapped_model_matches_the_dequantized_model():
    model, packed, dense = _int8_case()
    swap_group_sparse_linears(model, packed)
    layers = [m for m in model.modules() if isinstance(m, GroupSparseLinear)]
    assert len(layers) == 14 and all(m.scales is not None and m.values.dtype == torch.int8 for m in layers)
    assert "int8" in repr(layers[0])
    ids = torch.randint(0, 256, (2, 6))
    with torch.no_grad():
        expected = dense(ids).logits
        torch.testing.assert_close(model(ids).logits, expected, **x_quantized(expected))
        model.to(torch.bfloat16)  # activations bf16; values stay int8 and scales fp32
        assert all(m.scales.dtype == torch.float32 and m.values.dtype == torch.int8 for m in layers)
        got, expected = model(ids).logits.float(), dense(ids).logits
    assert (got - expected).abs().max() < 0.05 * expected.abs().max()


def test_int8_lowered_model_saves_and_loads(tmp_path):
    model, packed, dense = _int8_case("32x32")
    save_lowered(tmp_path, model, None, packed, {"model": "tiny"})
    loaded, _ = load_lowered(tmp_path)
    layer = loaded.get_submodule(next(iter(packed)))
    assert layer.values.dtype == torch.int8 and torch.equal(layer.scales, packed[next(iter(packed))].scales)
    ids = torch.randint(0, 256, (1, 5))
    with torch.no_grad():
        expected = dense(ids).logits
        torch.testing.assert_close(loaded(ids).logits, expected, **x_quantized(expected))
