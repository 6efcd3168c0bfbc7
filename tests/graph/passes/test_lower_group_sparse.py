"""lower_group_sparse: tiny model -> trace -> lower -> node counts, numerics, lint."""
import pytest
import torch
from conftest import masked_copy, x_quantized

from gmc.errors import GmcError
from gmc.graph.passes.find_targets import find_targets
from gmc.graph.passes.lower_group_sparse import lower_group_sparse
from gmc.graph.pipeline import pack_targets
from gmc.graph.trace import trace_model
from gmc.groups import GroupSpec
from gmc.kernels.quantize import quantize_int8

GSL = torch.ops.gmc.group_sparse_linear.default
LINEAR = torch.ops.aten.linear.default


def _count(gm, target):
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is target)


@pytest.mark.parametrize("group", ["1x32", "16x16"])
def test_lowered_graph_matches_folded_dense_model(tiny_llama, group):
    spec = GroupSpec(*map(int, group.split("x")))
    gm = trace_model(tiny_llama)
    targets = find_targets(gm)
    gen = torch.Generator().manual_seed(0)
    masks = {t.name: torch.rand(spec.grid(t.shape), generator=gen) < 0.5 for t in targets}
    dense = masked_copy(tiny_llama, masks, spec)
    linears_before = _count(gm, LINEAR)

    lower_group_sparse(gm, pack_targets(tiny_llama, masks, spec))

    assert _count(gm, GSL) == len(targets) == 14
    assert _count(gm, LINEAR) == linears_before - len(targets)  # lm_head untouched
    gm.graph.lint()
    ids = torch.randint(0, 320, (2, 9), generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(gm(ids), dense(ids).logits, atol=1e-5, rtol=1e-5)
    lowered = next(n for n in gm.graph.nodes if n.target is GSL)
    assert "val" in lowered.meta


def test_only_named_layers_are_lowered(tiny_llama):
    spec = GroupSpec(1, 32)
    gm = trace_model(tiny_llama)
    target = find_targets(gm)[0]
    masks = {target.name: torch.ones(spec.grid(target.shape), dtype=torch.bool)}
    lower_group_sparse(gm, pack_targets(tiny_llama, masks, spec))
    assert _count(gm, GSL) == 1


def test_unknown_layer_is_a_gmc_error(tiny_llama):
    spec = GroupSpec(1, 32)
    gm = trace_model(tiny_llama)
    packed = pack_targets(tiny_llama, {"model.layers.0.mlp.up_proj": torch.ones(96, 2, dtype=torch.bool)}, spec)
    packed["model.layers.9.mlp.up_proj"] = packed.pop("model.layers.0.mlp.up_proj")
    with pytest.raises(GmcError, match="layers.9"):
        lower_group_sparse(gm, packed)


def test_int8_layers_are_lowered_with_their_scales(tiny_llama):
    spec = GroupSpec(1, 32)
    gm = trace_model(tiny_llama)
    gen = torch.Generator().manual_seed(1)
    masks = {t.name: torch.rand(spec.grid(t.shape), generator=gen) < 0.5 for t in find_targets(gm)}
    packed = {name: quantize_int8(layer) for name, layer in pack_targets(tiny_llama, masks, spec).items()}
    dense = masked_copy(tiny_llama, masks, spec)
    for name, layer in packed.items():
        dense.get_submodule(name).weight.data = layer.unpack()

    lower_group_sparse(gm, packed)

    lowered = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is GSL]
    assert len(lowered) == 14
    for node in lowered:  # (x, values, row_idx, row_ptr, bias, d_out, g_in, scales)
        assert len(node.args) == 8 and node.args[7].op == "get_attr" and node.args[7].target.endswith(".scales")
        assert gm.get_buffer(node.args[7].target).dtype == torch.float32
        assert gm.get_buffer(node.args[1].target).dtype == torch.int8
    gm.graph.lint()
    ids = torch.randint(0, 320, (2, 9), generator=gen)
    with torch.no_grad():
        expected = dense(ids).logits
        torch.testing.assert_close(gm(ids), expected, **x_quantized(expected))
