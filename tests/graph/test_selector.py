"""The masked linear of a GroupSelector: autograd's gradients, and no full-size mask or masked weight
kept for backward."""
import copy

import pytest
import torch
from conftest import set_selectors, tiny_model

from gmc.graph import selector
from gmc.graph.passes.find_targets import find_targets
from gmc.graph.passes.insert_group_selectors import insert_group_selectors
from gmc.graph.trace import trace_model
from gmc.groups import GroupSpec


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
    for t in targets:
        linear = modules[t.name]

        def forward(x, linear=linear, sel=selectors[t.name]):
            return torch.nn.functional.linear(x, linear.weight * spec.expand(sel, tuple(linear.weight.shape)))

        linear.forward = forward
    naive_total, _ = saved_bytes(lambda: naive(ids).logits)
    # naive saves the expanded mask and the masked weight of every target; ours saves x and B
    target_weight_bytes = sum(t.shape[0] * t.shape[1] * 4 for t in targets)
    assert ours_max < min(t.shape[0] * t.shape[1] * 4 for t in targets)
    assert naive_total - ours_total >= 1.5 * target_weight_bytes


@pytest.mark.parametrize("spec, shape", [(GroupSpec(1, 16), (24, 48)), (GroupSpec(1, 16), (20, 40)),
                                         (GroupSpec(4, 8), (22, 36)), (GroupSpec(3, 64), (10, 20))])
@pytest.mark.parametrize("bias", [False, True])
def test_masked_linear_matches_autograd_of_the_naive_form(spec, shape, bias):
    """Output and gradients equal autograd of ``linear(x, W * expand(B))``, ragged groups included."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(shape, generator=generator, dtype=torch.float64)
    b = torch.randn(shape[0], generator=generator, dtype=torch.float64) if bias else None
    x0 = torch.randn(2, 5, shape[1], generator=generator, dtype=torch.float64)
    s0 = (torch.rand(spec.grid(shape), generator=generator) > 0.4).double()

    def run():
        x, s = x0.clone().requires_grad_(), s0.clone().requires_grad_()
        bb = None if b is None else b.clone().requires_grad_()
        out = selector.masked_linear(x, weight, bb, s, spec)
        out.backward(torch.cos(out.detach()))
        return out.detach(), x.grad, s.grad, None if bb is None else bb.grad

    x, s = x0.clone().requires_grad_(), s0.clone().requires_grad_()
    bb = None if b is None else b.clone().requires_grad_()
    out = torch.nn.functional.linear(x, weight * spec.expand(s, shape), bb)
    out.backward(torch.cos(out.detach()))
    naive = (out.detach(), x.grad, s.grad, None if bb is None else bb.grad)
    for got, want in zip(run(), naive):
        if want is None:
            assert got is None
        else:
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("spec, shape", [(GroupSpec(4, 8), (22, 36)), (GroupSpec(1, 256), (8, 576)),
                                         (GroupSpec(32, 32), (100, 96)), (GroupSpec(7, 300), (20, 200)),
                                         (GroupSpec(1, 16), (24, 48))])
def test_masked_weight_is_the_expanded_mask(spec, shape):
    """Whole groups, a ragged input or output end (or both), one group wider than the layer."""
    weight, s = torch.randn(shape), (torch.rand(spec.grid(shape)) > 0.5).float()
    assert torch.equal(selector.masked_weight(weight, s, spec), weight * spec.expand(s, shape))


@pytest.mark.slow
def test_compiled_bf16_masked_linear_with_a_ragged_group_matches_eager():
    """SmolLM2's 576 inputs in 1x256 groups (two whole, one of 64) under a compiled bf16 step: the
    ragged group's columns are the pretrained weight's, not garbage (a padded form read them wrong)."""
    spec, shape = GroupSpec(1, 256), (192, 576)
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(shape, generator=generator)
    x = torch.randn(2, 8, shape[1], generator=generator)
    s0 = (torch.rand(spec.grid(shape), generator=generator) > 0.5).float()

    def step(x, s):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = selector.masked_linear(x, weight, None, s, spec).float()
        out.backward(torch.cos(out.detach()))
        return out.detach()

    results = []
    for run in (step, torch.compile(step)):
        s = s0.clone().requires_grad_()
        results.append((run(x, s), s.grad))
    (eager, eager_grad), (compiled, compiled_grad) = results
    assert torch.isfinite(compiled).all() and torch.isfinite(compiled_grad).all()
    torch.testing.assert_close(compiled, eager, rtol=0.02, atol=0.02 * eager.abs().max().item())
    torch.testing.assert_close(compiled_grad, eager_grad, rtol=0.02, atol=0.02 * eager_grad.abs().max().item())
