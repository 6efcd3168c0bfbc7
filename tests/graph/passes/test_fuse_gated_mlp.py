"""fuse_gated_mlp: each lowered MLP (gate/up op, silu, product, down op) becomes one op; logits unchanged."""
import pytest
import torch
from conftest import random_masks, tiny_model

from gmc.graph.passes.fuse_gated_mlp import fuse_gated_mlp
from gmc.graph.passes.fuse_siblings import fuse_siblings
from gmc.graph.passes.lower_group_sparse import lower_group_sparse
from gmc.graph.pipeline import pack_targets
from gmc.graph.trace import trace_model
from gmc.groups import parse_pattern
from gmc.kernels.quantize import quantize

GSL = torch.ops.gmc.group_sparse_linear.default
MLP = torch.ops.gmc.group_sparse_gated_mlp.default


def _count(gm, target):
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is target)


def _lowered(arch: str, group: str = "1x16", how: str = "none", **overrides):
    model = tiny_model(arch, **overrides)
    pattern = parse_pattern(group)
    packed = pack_targets(model, random_masks(model, pattern, seed=1), pattern)
    packed = {name: quantize(layer, how) for name, layer in packed.items()}
    return model, lower_group_sparse(trace_model(model), packed)


@pytest.mark.parametrize("arch,group,how", [("llama", "1x16", "none"), ("llama", "1x32", "int8"),
                                             ("llama", "1x32", "int4"), ("qwen3", "1x16", "none"),
                                             ("qwen2", "16x16", "none"), ("mistral", "1x16", "int8")])
@pytest.mark.slow
def test_each_mlp_becomes_one_op_with_the_same_logits(arch, group, how):
    """Per decoder layer: q/k/v and o stay ops, gate/up + silu * up + down become one op."""
    model, gm = _lowered(arch, group, how)
    layers = model.config.num_hidden_layers
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        fuse_siblings(gm)
        expected = gm(ids)
        fuse_gated_mlp(gm)
        got = gm(ids)
    assert _count(gm, MLP) == layers
    assert _count(gm, GSL) == 2 * layers
    assert _count(gm, torch.ops.aten.silu.default) == 0
    gm.graph.lint()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert _count(fuse_gated_mlp(gm), MLP) == layers  # a second run finds nothing more


def test_unfused_gate_and_up_are_left_alone():
    """Without fuse_siblings gate and up are two ops: no [gate | up] output to match."""
    _, gm = _lowered("llama")
    before = _count(gm, GSL)
    fuse_gated_mlp(gm)
    assert _count(gm, MLP) == 0 and _count(gm, GSL) == before


def test_other_activations_are_left_alone():
    """A GELU MLP (hidden_act="gelu_pytorch_tanh") is not the op's silu: nothing fused."""
    _, gm = _lowered("llama", hidden_act="gelu_pytorch_tanh")
    fuse_siblings(gm)
    before = _count(gm, GSL)
    fuse_gated_mlp(gm)
    assert _count(gm, MLP) == 0 and _count(gm, GSL) == before


def test_a_gate_read_elsewhere_is_left_alone():
    """The gate/up output feeding another node besides the MLP (here: the graph adds its gate half to
    the logits' first column) must not vanish into the op."""
    model, gm = _lowered("llama")
    fuse_siblings(gm)
    graph = gm.graph
    gate = next(n for n in graph.nodes if n.target is torch.ops.aten.silu.default).args[0]
    output = next(n for n in graph.nodes if n.op == "output")
    logits = output.args[0][0] if isinstance(output.args[0], (tuple, list)) else output.args[0]
    with graph.inserting_before(output):
        extra = graph.call_function(torch.ops.aten.sum.default, (gate,))
        total = graph.call_function(torch.ops.aten.add.Tensor, (logits, extra))
    output.args = ((total, *output.args[0][1:]),) if isinstance(output.args[0], (tuple, list)) else (total,)
    gm.recompile()
    fuse_gated_mlp(gm)
    assert _count(gm, MLP) == model.config.num_hidden_layers - 1  # only the untouched layer
