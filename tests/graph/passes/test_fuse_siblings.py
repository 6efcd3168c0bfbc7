"""fuse_siblings: ops reading one input become one op and slices; logits unchanged."""
import pytest
import torch
from conftest import random_masks, tiny_model

from gmc.graph.passes.fuse_siblings import fuse_siblings
from gmc.graph.passes.lower_group_sparse import lower_group_sparse
from gmc.graph.pipeline import pack_targets
from gmc.graph.trace import trace_model
from gmc.groups import parse_pattern
from gmc.kernels.packed import KernelInputs, concat_outputs, pack
from gmc.kernels.quantize import quantize

GSL = torch.ops.gmc.group_sparse_linear.default
SLICE = torch.ops.aten.slice.Tensor


def _count(gm, target):
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is target)


def _lowered(arch: str, group: str, how: str = "none", seed: int = 0):
    model = tiny_model(arch)
    pattern = parse_pattern(group)
    packed = pack_targets(model, random_masks(model, pattern, seed=seed), pattern)
    packed = {name: quantize(layer, how) for name, layer in packed.items()}
    return model, lower_group_sparse(trace_model(model), packed)


@pytest.mark.parametrize("arch,group,how", [("llama", "1x16", "none"), ("llama", "1x32", "int8"),
                                             ("llama", "1x32", "int4"),
                                             ("qwen2", "1x16", "none"), ("llama", "16x16", "none")])
@pytest.mark.slow
def test_q_k_v_and_gate_up_become_one_op_each_with_the_same_logits(arch, group, how):
    """Per decoder layer: q/k/v one op, gate/up one op, o and down alone (7 ops -> 4); qwen2's
    q/k/v biases go into the fused bias."""
    model, gm = _lowered(arch, group, how)
    layers = model.config.num_hidden_layers
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = gm(ids)
        fuse_siblings(gm)
        got = gm(ids)
    assert _count(gm, GSL) == 4 * layers
    assert _count(gm, SLICE) >= 5 * layers  # q, k, v, gate, up
    assert not any("_proj" in name for name, _ in gm.named_buffers())  # the unfused buffers are gone
    gm.graph.lint()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_ops_on_different_inputs_or_widths_stay_apart():
    """o_proj and down_proj read their own inputs: nothing to fuse after the q/k/v and gate/up sets."""
    _, gm = _lowered("llama", "1x16")
    fuse_siblings(gm)
    before = _count(gm, GSL)
    fuse_siblings(gm)  # a second run finds no siblings left
    assert _count(gm, GSL) == before


def test_concat_outputs_is_the_layers_side_by_side():
    """One layer with a bias and one without, ragged d_in (40 = 16 + 16 + 8): the fused layer's output is
    both outputs concatenated, its row_idx ascending in every block."""
    gen = torch.Generator().manual_seed(2)
    pattern = parse_pattern("1x16")
    a = pack(torch.randn(24, 40, generator=gen), torch.rand(24, 3, generator=gen) < 0.5, pattern, torch.randn(24))
    b = pack(torch.randn(8, 40, generator=gen), torch.rand(8, 3, generator=gen) < 0.5, pattern)
    parts = [KernelInputs(p.values, p.row_idx, p.row_ptr, p.shape[0], p.scales, p.bias) for p in (a, b)]
    fused = concat_outputs(parts, 40, 16)
    x = torch.randn(3, 40, generator=gen)
    expected = torch.cat([torch.nn.functional.linear(x, a.unpack(), a.bias),
                          torch.nn.functional.linear(x, b.unpack())], dim=-1)
    got = GSL(x, fused.values, fused.row_idx, fused.row_ptr, fused.bias, fused.d_out, 16)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    for v in range(3):
        rows = fused.row_idx[fused.row_ptr[v]:fused.row_ptr[v + 1]]
        assert bool((rows[1:] > rows[:-1]).all())
