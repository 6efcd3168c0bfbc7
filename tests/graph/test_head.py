"""Splitting a logits graph at its output head gives back the same function."""
import pytest
import torch
from conftest import tiny_model

from gmc.graph.head import split_output_head
from gmc.graph.pipeline import prepare
from gmc.graph.targets import TargetFilter
from gmc.groups import GroupSpec


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2", "mistral"])
def test_head_of_trunk_is_the_whole_graph(arch):
    gm = prepare(tiny_model(arch), GroupSpec(1, 16), TargetFilter()).gm
    trunk, head = split_output_head(gm)
    ids = torch.randint(0, 300, (2, 7))
    hidden = trunk(ids)
    assert hidden.shape == (2, 7, gm.get_parameter("model.lm_head.weight").shape[1])
    assert torch.equal(head(hidden), gm(ids))
    linears = [n for n in head.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.linear.default]
    assert len(linears) == 1  # the head runs the output projection only


def test_graph_without_a_final_linear_is_not_split():
    class NoHead(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.linear(x, torch.ones(3, 3)).relu() + x

    gm = torch.export.export(NoHead(), (torch.ones(2, 3),)).module()
    assert split_output_head(gm) is None
