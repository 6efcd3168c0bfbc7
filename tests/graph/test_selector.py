"""The masked linear of a GroupSelector keeps no full-size mask or masked weight for backward."""
import copy

import torch
from conftest import tiny_model

from gmc.graph.passes.find_targets import find_targets
from gmc.graph.passes.insert_group_selectors import insert_group_selectors
from gmc.graph.selector import set_selectors
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
