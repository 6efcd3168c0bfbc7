"""The group selector: the module that an ``insert_group_selectors`` node calls.

``GroupSelector(x, weight, bias)`` computes ``linear(x, weight * expand(B), bias)`` when it holds
selectors ``B`` and is enabled, and the plain dense ``linear`` otherwise, so one traced graph
serves as student (masks on) and teacher (masks off) without re-tracing. A selector given a
``delta`` (mask learning with ``--learn-weights``) uses ``weight + delta`` as the student's weight;
the teacher keeps the pretrained one.

``masked_linear`` never keeps the full-size mask ``M`` or masked weight ``W * M`` alive for
backward: it saves ``x``, the frozen ``W`` and the small ``B``, and recomputes ``W * M`` in
backward. The selector gradient is the per-group sum of ``grad_W_hat * W`` (docs/design.md section 5).

``attach_selectors`` gives an eager model the same selectors without a graph: each target
``nn.Linear``'s forward becomes a call of its ``GroupSelector`` (the torchrun path shards that model).
"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from gmc.graph.targets import Target
from gmc.groups import GroupSpec, Pattern

SELECTOR_ATTR = "gmc_selector"  # the child module name of a selector attached to an eager linear


def masked_weight(weight: torch.Tensor, selectors: torch.Tensor, pattern: Pattern) -> torch.Tensor:
    """``weight * expand(selectors)`` in broadcast multiplies (no full-size mask is built).

    A ragged last group (``d_in`` or ``d_out`` not a multiple of the group) is multiplied apart and
    joined on, not padded: inductor (torch 2.13, CPU) fuses ``pad -> multiply -> slice -> bf16 cast``
    into a kernel that reads garbage in the ragged columns (NaN losses in a compiled bf16 step of a
    1x256 run on SmolLM2's 576 inputs).
    """
    if not isinstance(pattern, GroupSpec):
        return weight * pattern.expand(selectors.to(weight.dtype), tuple(weight.shape))
    d_out, d_in = weight.shape
    (G_out, G_in), g_out, g_in = pattern.grid((d_out, d_in)), pattern.g_out, pattern.g_in
    grid = selectors.to(weight.dtype)
    if d_out % g_out == 0 and d_in % g_in == 0:
        return (weight.view(G_out, g_out, G_in, g_in) * grid[:, None, :, None]).view(d_out, d_in)
    rows = grid.repeat_interleave(g_out, 0)[:d_out] if g_out > 1 else grid  # [d_out, G_in]
    whole = d_in // g_in  # input groups without a ragged end
    parts = [(weight[:, :whole * g_in].unflatten(1, (whole, g_in)) * rows[:, :whole, None]).flatten(1)] if whole else []
    if whole < G_in:
        parts.append(weight[:, whole * g_in:] * rows[:, whole:])
    return torch.cat(parts, 1) if len(parts) > 1 else parts[0]


class _MaskedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, selectors, pattern):
        # x [..., d_in], weight [d_out, d_in], selectors [G_out, G_in] (0/1 values, float)
        out = F.linear(x, masked_weight(weight, selectors, pattern), bias)
        ctx.pattern = pattern
        ctx.has_bias = bias is not None
        # backward's products run under the forward's autocast (bf16 GEMMs in, grad_out bf16), as
        # torch.amp.custom_bwd does, for whichever device x is on
        device = x.device.type
        ctx.autocast = (device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device))
        ctx.save_for_backward(x, weight, selectors)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        device, dtype, enabled = ctx.autocast
        with torch.autocast(device, dtype=dtype, enabled=enabled):
            return _MaskedLinear._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        x, weight, selectors = ctx.saved_tensors
        pattern = ctx.pattern
        need_x, need_w, need_b, need_s = ctx.needs_input_grad[:4]
        grad_x = grad_w = grad_b = grad_s = None
        if need_x:
            grad_x = grad_out @ masked_weight(weight, selectors, pattern)  # [..., d_in]
        if need_w or need_s:
            # grad of the masked weight: [d_out, d_in], freed when backward of this node returns
            grad_w_hat = grad_out.reshape(-1, grad_out.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
            if need_s:
                grad_s = pattern.group_sum(grad_w_hat * weight).to(selectors.dtype)
            if need_w:
                grad_w = masked_weight(grad_w_hat, selectors, pattern)
        if need_b and ctx.has_bias:
            grad_b = grad_out.reshape(-1, grad_out.shape[-1]).sum(0)
        return grad_x, grad_w, grad_b, grad_s, None


def masked_linear(x, weight, bias, selectors, pattern: Pattern) -> torch.Tensor:
    """``F.linear(x, weight * expand(selectors), bias)`` with a memory-lean backward."""
    return _MaskedLinear.apply(x, weight, bias, selectors, pattern)


class GroupSelector(torch.nn.Module):
    """One per target linear; holds that target's selectors for the current step."""

    def __init__(self, name: str, pattern: Pattern, shape: tuple[int, int]):
        super().__init__()
        self.name = name  # HF module name of the target linear, e.g. model.layers.0.mlp.up_proj
        self.pattern = pattern
        self.shape = tuple(shape)  # (d_out, d_in)
        self.selectors: Optional[torch.Tensor] = None  # [G_out, G_in]; None = dense
        self.enabled = True
        self.observer: Optional[Callable[[torch.Tensor], None]] = None  # sees the input x
        self.delta: Optional[torch.Tensor] = None  # [d_out, d_in] trained change of the kept weights

    def forward(self, x, weight, bias=None):
        if self.observer is not None:
            self.observer(x)
        if not self.enabled or self.selectors is None:
            return F.linear(x, weight, bias)  # the teacher: the pretrained weight, never the delta
        if self.delta is not None:
            weight = weight + self.delta.to(weight.dtype)
        return masked_linear(x, weight, bias, self.selectors, self.pattern)

    def extra_repr(self) -> str:
        return f"{self.name}, group={self.pattern}, shape={self.shape}"


def attach_selectors(model: torch.nn.Module, targets: list[Target], pattern: Pattern) -> dict[str, GroupSelector]:
    """The eager model's counterpart of ``insert_group_selectors`` (``gmc.masks.distributed`` shards
    it): route each target linear through a ``GroupSelector``; return them keyed by target name.

    The linear keeps its class, parameters and state-dict keys; the selector (no parameters) is a
    child module, so FSDP2 leaves it alone, and it reads ``weight`` at call time, after FSDP2 has
    all-gathered it.
    """
    selectors = {}
    for target in targets:
        linear = model.get_submodule(target.name)
        selector = GroupSelector(target.name, pattern, target.shape)
        linear.add_module(SELECTOR_ATTR, selector)
        linear.forward = _selected_forward(linear, selector)
        selectors[target.name] = selector
    return selectors


def _selected_forward(linear: torch.nn.Linear, selector: GroupSelector):
    def forward(x):
        return selector(x, linear.weight, linear.bias)

    return forward


def selector_modules(gm: torch.nn.Module) -> dict[str, GroupSelector]:
    """Target name -> its GroupSelector, in graph (execution) order."""
    found = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            module = gm.get_submodule(node.target)
            if isinstance(module, GroupSelector):
                found[module.name] = module
    return found


@contextlib.contextmanager
def masks_disabled(model: torch.nn.Module):
    """Run ``model`` dense, every GroupSelector in it off: the self-distillation teacher. ``model``
    is a graph with selector nodes or an eager model with attached selectors (``attach_selectors``)."""
    selectors = [m for m in model.modules() if isinstance(m, GroupSelector)]
    for selector in selectors:
        selector.enabled = False
    try:
        yield
    finally:
        for selector in selectors:
            selector.enabled = True
