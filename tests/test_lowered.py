"""Eager lowered models: module swap, generate with KV cache, save/load, export."""
import pytest
import torch

from conftest import masked_copy, random_masks, tiny_model
from gmc.groups import GroupSpec
from gmc.lowered import GroupSparseLinear, load_lowered, pack_model, save_lowered, swap_group_sparse_linears


@pytest.mark.parametrize("group", ["1x32", "32x32"])
def test_swapped_model_generates_like_the_folded_model(group):
    spec = GroupSpec(*map(int, group.split("x")))
    model = tiny_model("llama", intermediate_size=128, vocab_size=256)
    masks = random_masks(model, spec)
    dense = masked_copy(model, masks, spec)
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
    model = tiny_model("llama", intermediate_size=128, vocab_size=256, tie_word_embeddings=tie)
    masks = random_masks(model, spec)
    dense = masked_copy(model, masks, spec)
    save_lowered(tmp_path, model, None, pack_model(model, masks, spec), {"model": "tiny"})
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
    swap_group_sparse_linears(model, pack_model(model, masks, spec))
    from gmc.trace import trace_model

    gm = trace_model(model)
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert ops.count(torch.ops.gmc.group_sparse_linear.default) == 14
