"""insert_group_selectors + fold_masks on tiny Llama and Qwen3 graphs."""
import copy

import pytest
import torch

from conftest import tiny_model
from gmc.groups import GroupSpec, parse_pattern
from gmc.passes.find_targets import find_targets
from gmc.passes.fold_masks import fold_masks
from gmc.passes.insert_group_selectors import insert_group_selectors
from gmc.selector import GroupSelector, masks_disabled, selector_modules, set_selectors
from gmc.trace import trace_model


def _count(gm, predicate):
    return sum(1 for node in gm.graph.nodes if predicate(node))


def _is_linear(node):
    return node.op == "call_function" and node.target is torch.ops.aten.linear.default


def _is_selector(gm):
    return lambda node: node.op == "call_module" and isinstance(gm.get_submodule(node.target), GroupSelector)


def _masked_eager(model, masks, spec):
    masked = copy.deepcopy(model)
    modules = dict(masked.named_modules())
    with torch.no_grad():
        for name, selectors in masks.items():
            weight = modules[name].weight
            weight.mul_(spec.expand(selectors.float(), tuple(weight.shape)))
    return masked


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
    expected = _masked_eager(model, masks, spec)(ids).logits
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


def test_masked_linear_backward_keeps_no_full_size_tensor():
    """Saved-for-backward bytes of a masked step vs a naive W * M implementation."""
    spec = GroupSpec(1, 32)
    model = tiny_model("llama", hidden_size=128, intermediate_size=256)
    gm = trace_model(model)
    targets = find_targets(gm)
    insert_group_selectors(gm, targets, spec)
    ids = torch.randint(0, 320, (1, 4))
    selectors = {t.name: torch.ones(spec.grid(t.shape), requires_grad=True) for t in targets}

    frozen = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def saved_bytes(run):
        """Bytes saved for backward that are new allocations (not the frozen weights)."""
        sizes = [0]

        def pack(tensor):
            if tensor.untyped_storage().data_ptr() not in frozen:
                sizes.append(tensor.numel() * tensor.element_size())
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run().sum().backward()
        return sum(sizes), max(sizes)

    set_selectors(gm, selectors)
    ours_total, ours_max = saved_bytes(lambda: gm(ids))

    naive = copy.deepcopy(model)
    modules = dict(naive.named_modules())
    hooks = []
    for t in targets:
        linear = modules[t.name]

        def forward(x, linear=linear, sel=selectors[t.name]):
            return torch.nn.functional.linear(x, linear.weight * spec.expand(sel, tuple(linear.weight.shape)))

        linear.forward = forward
        hooks.append(linear)
    naive_total, naive_max = saved_bytes(lambda: naive(ids).logits)
    # naive saves the expanded mask and the masked weight of every target; ours saves x and B
    target_weight_bytes = sum(t.shape[0] * t.shape[1] * 4 for t in targets)
    assert ours_max < min(t.shape[0] * t.shape[1] * 4 for t in targets)
    assert naive_total - ours_total >= 1.5 * target_weight_bytes
    print(f"saved-for-backward bytes: ours {ours_total:,} naive {naive_total:,} ratio {ours_total / naive_total:.2f}")
