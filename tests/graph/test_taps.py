"""The decoder blocks' outputs found in a traced graph are the model's hidden states, and the
tapped graph and the tapped trunk return them beside the unchanged logits."""
import pytest
import torch
from conftest import tiny_model

from gmc.errors import GmcError
from gmc.graph.head import split_output_head
from gmc.graph.pipeline import prepare
from gmc.graph.taps import block_outputs, chosen_blocks, with_outputs
from gmc.graph.targets import TargetFilter
from gmc.groups import GroupSpec


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2", "mistral"])
def test_block_outputs_are_the_hidden_states_after_each_block(arch):
    model = tiny_model(arch, num_hidden_layers=3)
    gm = prepare(model, GroupSpec(1, 16), TargetFilter()).gm  # selectors inserted, as mask learning runs it
    names = block_outputs(gm)
    assert len(names) == 3
    ids = torch.randint(0, 300, (2, 9))
    logits, *taps = with_outputs(gm, names)(ids)
    with torch.no_grad():
        reference = model(input_ids=ids, output_hidden_states=True)
    assert torch.equal(logits, gm(ids))
    # HF's hidden_states: the embeddings, then each block's output, the last one after the final norm
    for tap, hidden in zip(taps[:-1], reference.hidden_states[1:-1]):
        assert torch.equal(tap, hidden)
    final_norm = model.model.norm(taps[-1])
    assert torch.equal(final_norm, reference.hidden_states[-1])
    trunk, head = split_output_head(gm, names[:2])
    hidden, *trunk_taps = trunk(ids)
    assert torch.equal(head(hidden), logits)
    assert all(torch.equal(a, b) for a, b in zip(trunk_taps, taps[:2]))


def test_chosen_blocks_count_back_from_the_last():
    assert chosen_blocks(30, 1) == list(range(30))
    assert chosen_blocks(30, 4) == [1, 5, 9, 13, 17, 21, 25, 29]
    assert chosen_blocks(2, 5) == [1]


def test_a_graph_without_decoder_blocks_is_refused_in_one_line():
    class NoBlocks(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.linear(x, torch.ones(3, 3))

    gm = torch.export.export(NoBlocks(), (torch.ones(2, 3),)).module()
    with pytest.raises(GmcError, match="decoder blocks' outputs.*--layer-kd 0"):
        block_outputs(gm)
