"""fold_masks on tiny Llama and Qwen3 graphs, after insert_group_selectors (which it needs): the
inserted selectors (on, off, dense) then the folded graph match the eager masked model."""
import pytest
import torch
from conftest import masked_copy, set_selectors, tiny_model

from gmc.graph.passes.find_targets import find_targets
from gmc.graph.passes.fold_masks import fold_masks
from gmc.graph.passes.insert_group_selectors import insert_group_selectors
from gmc.graph.selector import GroupSelector, masks_disabled, selector_modules
from gmc.graph.trace import trace_model
from gmc.groups import parse_pattern


def _count(gm, predicate):
    return sum(1 for node in gm.graph.nodes if predicate(node))


def _is_linear(node):
    return node.op == "call_function" and node.target is torch.ops.aten.linear.default


def _is_selector(gm):
    return lambda node: node.op == "call_module" and isinstance(gm.get_submodule(node.target), GroupSelector)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("group", ["1x32", "16x16", "1x256"])
def test_selectors_then_fold_match_eager_masked_model(arch, group):
    spec = parse_pattern(group)
    model = tiny_model(arch)
    ids = torch.randint(0, 320, (2, 9))
    dense = model(ids).logits
    gm = trace_model(model)
    linears_before = _count(gm, _is_linear)
    targets = find_targets(gm)
    insert_group_selectors(gm, targets, spec)
    gm.graph.lint()
    assert _count(gm, _is_selector(gm)) == len(targets) == 14
    assert _count(gm, _is_linear) == linears_before - len(targets)  # lm_head untouched

    set_selectors(gm, {t.name: torch.ones(spec.grid(t.shape)) for t in targets})
    torch.testing.assert_close(gm(ids), dense, atol=1e-5, rtol=0)

    generator = torch.Generator().manual_seed(1)
    masks = {t.name: (torch.rand(spec.grid(t.shape), generator=generator) > 0.5).float() for t in targets}
    set_selectors(gm, masks)
    expected = masked_copy(model, masks, spec)(ids).logits
    torch.testing.assert_close(gm(ids), expected, atol=1e-5, rtol=0)
    with masks_disabled(gm):  # the teacher: same graph, dense
        torch.testing.assert_close(gm(ids), dense, atol=1e-5, rtol=0)

    fold_masks(gm)
    gm.graph.lint()
    assert _count(gm, _is_selector(gm)) == 0
    assert _count(gm, _is_linear) == linears_before
    assert not selector_modules(gm)
    torch.testing.assert_close(gm(ids), expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(model(ids).logits, dense, atol=0, rtol=0)  # eager weights untouched
