"""tile_for_cuda: op buffers of the named device become the tiled layout; the logits do not change.

There is no GPU here, so the pass tiles a CPU graph (``device_type="cpu"``): the op then runs the tiled
layout through its torch implementation, which computes with the layout's own dense weight, so the
logits check the conversion of every buffer (values, indices, int8/int4 scales, both layers of a gated
MLP) against the model with every lowered weight dense (dequantized: the CPU kernel's int8 activations
would blur a comparison with the untiled graph), and a whole output head becomes a dense
``aten.linear`` on the same values.
"""
import copy

import pytest
import torch
from conftest import random_masks, tiny_model

from gmc.graph.passes.fuse_gated_mlp import fuse_gated_mlp
from gmc.graph.passes.fuse_siblings import fuse_siblings
from gmc.graph.passes.lower_group_sparse import lower_group_sparse
from gmc.graph.passes.tile_for_cuda import tile_for_cuda
from gmc.graph.pipeline import LowerOptions, pack_targets, packed_head
from gmc.graph.trace import attr_tensor, trace_model
from gmc.groups import parse_pattern
from gmc.kernels.quantize import quantize

GSL = torch.ops.gmc.group_sparse_linear.default
MLP = torch.ops.gmc.group_sparse_gated_mlp.default
LINEAR = torch.ops.aten.linear.default


def _ops(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in (GSL, MLP)]


@pytest.mark.parametrize("how", ["none", "int8", "int4"])
@pytest.mark.parametrize("fuse", [False, True])
def test_tiled_graph_computes_the_same_logits(how, fuse):
    model = tiny_model("llama")
    pattern = parse_pattern("1x16" if how == "none" else "1x32")
    packed = {name: quantize(layer, how)
              for name, layer in pack_targets(model, random_masks(model, pattern), pattern).items()}
    layers = {**packed_head(model, packed, LowerOptions()), **packed}
    gm = lower_group_sparse(trace_model(model), layers)
    if fuse:
        gm = fuse_gated_mlp(fuse_siblings(gm))
    ids = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0))
    reference = copy.deepcopy(model)  # every lowered weight as the layer stores it (dequantized), dense
    for name, layer in layers.items():
        reference.get_submodule(name).weight.data = layer.unpack().float()
    with torch.no_grad():
        expected = reference(ids).logits
        ops = len(_ops(gm))
        tile_for_cuda(gm, device_type="cpu")
        got = gm(ids)
    tiled = _ops(gm)
    assert all(attr_tensor(gm, node.args[2].target).dim() == 2 for node in tiled)  # entries tables
    if how == "none":  # the whole bf16/fp32 head: a dense linear on the packed values, no op
        assert len(tiled) == ops - 1 and sum(n.target is LINEAR for n in gm.graph.nodes) >= 1
    else:
        assert len(tiled) == ops  # an int8 head stays an op (half the bytes of a dense one)
    gm.graph.lint()
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)


def test_other_devices_are_left_alone():
    model = tiny_model("llama")
    pattern = parse_pattern("1x16")
    gm = lower_group_sparse(trace_model(model), pack_targets(model, random_masks(model, pattern), pattern))
    before = {name: buffer.data_ptr() for name, buffer in gm.named_buffers()}
    tile_for_cuda(gm)  # CPU buffers: nothing is CUDA's
    assert {name: buffer.data_ptr() for name, buffer in gm.named_buffers()} == before
