"""The group selector: the module that an ``insert_group_selectors`` node calls.

``GroupSelector(x, weight, bias)`` computes ``linear(x, weight * expand(B), bias)`` when it holds
selectors ``B`` and is enabled, and the plain dense ``linear`` otherwise, so one traced graph
serves as student (masks on) and teacher (masks off) without re-tracing.

``masked_linear`` never keeps the full-size mask ``M`` or masked weight ``W * M`` alive for
backward. The selector gradient is the per-group sum of ``grad_W_hat * W`` (docs/design.md
section 5); where the per-group partial products fit, it is read off the forward's own partials,
which saves the ``grad_W_hat`` GEMM (one of the student's three per target).
"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from gmc.groups import GroupSpec, Pattern


PARTIALS_LIMIT = 4  # per-group partial products are kept when no larger than 4x the weight


def masked_weight(weight: torch.Tensor, selectors: torch.Tensor, pattern: Pattern) -> torch.Tensor:
    """``weight * expand(selectors)`` in one broadcast multiply (no full-size mask is built)."""
    if not isinstance(pattern, GroupSpec):
        return weight * pattern.expand(selectors.to(weight.dtype), tuple(weight.shape))
    d_out, d_in = weight.shape
    (G_out, G_in), g_out, g_in = pattern.grid((d_out, d_in)), pattern.g_out, pattern.g_in
    padded = F.pad(weight, (0, G_in * g_in - d_in, 0, G_out * g_out - d_out))
    grid = selectors.to(weight.dtype)[:, None, :, None]
    return (padded.view(G_out, g_out, G_in, g_in) * grid).view(G_out * g_out, G_in * g_in)[:d_out, :d_in]


def _partials_fit(tokens: int, weight: torch.Tensor, pattern: Pattern) -> bool:
    """Whether ``[G_in, tokens, d_out]`` partial products are at most ``PARTIALS_LIMIT`` weights."""
    if not isinstance(pattern, GroupSpec):
        return False
    G_in = pattern.grid(tuple(weight.shape))[1]
    return tokens * G_in <= PARTIALS_LIMIT * weight.shape[1]


def _group_partials(x2: torch.Tensor, weight: torch.Tensor, pattern: GroupSpec) -> torch.Tensor:
    """``P[g, t, o] = x[t, group g] . W[o, group g]``: ``[G_in, tokens, d_out]``, one batched GEMM."""
    d_out, d_in = weight.shape
    G_in, g_in = pattern.grid((d_out, d_in))[1], pattern.g_in
    pad = G_in * g_in - d_in
    if pad:  # ragged last group: zero columns add nothing
        x2, weight = F.pad(x2, (0, pad)), F.pad(weight, (0, pad))
    xg = x2.view(x2.shape[0], G_in, g_in).transpose(0, 1)  # [G_in, T, g_in]
    wg = weight.view(d_out, G_in, g_in).permute(1, 2, 0)  # [G_in, g_in, d_out]
    return torch.bmm(xg, wg)


def _row_selectors(selectors: torch.Tensor, pattern: GroupSpec, d_out: int, dtype) -> torch.Tensor:
    """``[G_in, d_out]``: each output row's selector in every input group."""
    return selectors.to(dtype).repeat_interleave(pattern.g_out, 0)[:d_out].t()


class _MaskedLinear(torch.autograd.Function):
    """Two forms, equal up to float rounding, chosen by size (``_partials_fit``):

    * partials: the forward keeps ``P[g, t, o]``, each input group's share of each output, and
      sums it under the selectors; the selector gradient is then ``sum_t grad[t, o] P[g, t, o]``,
      so the step runs two GEMMs (``P`` and ``grad_x``) instead of three;
    * recompute: the forward keeps ``x``, ``W`` and ``B`` only; backward recomputes ``W * M`` and
      forms the full ``grad_out^T x`` for the per-group sum of ``grad_W_hat * W``.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, selectors, pattern):
        # x [..., d_in], weight [d_out, d_in], selectors [G_out, G_in] (0/1 values, float)
        d_out, d_in = weight.shape
        x2 = x.reshape(-1, d_in)
        ctx.pattern, ctx.has_bias, ctx.x_shape = pattern, bias is not None, x.shape
        ctx.partials = (ctx.needs_input_grad[3] and not ctx.needs_input_grad[1]
                        and _partials_fit(x2.shape[0], weight, pattern))
        if ctx.partials:
            partials = _group_partials(x2, weight, pattern)  # [G_in, T, d_out]
            rows = _row_selectors(selectors, pattern, d_out, partials.dtype)
            out = partials[0] * rows[0]
            for g in range(1, partials.shape[0]):  # G_in passes over [T, d_out]: no [G_in, T, d_out] temporary
                out.addcmul_(partials[g], rows[g])
            if bias is not None:
                out += bias
            ctx.save_for_backward(weight, selectors, partials)
            return out.view(*x.shape[:-1], d_out)
        ctx.save_for_backward(x, weight, selectors)
        return F.linear(x, masked_weight(weight, selectors, pattern), bias)

    @staticmethod
    def backward(ctx, grad_out):
        pattern = ctx.pattern
        need_x, need_w, need_b, need_s = ctx.needs_input_grad[:4]
        grad_x = grad_w = grad_b = grad_s = None
        grad2 = grad_out.reshape(-1, grad_out.shape[-1])  # [T, d_out]
        if ctx.partials:
            weight, selectors, partials = ctx.saved_tensors
            if need_x:
                grad_x = (grad2 @ masked_weight(weight, selectors, pattern)).view(ctx.x_shape)
            rows = (partials * grad2).sum(1)  # [G_in, d_out]
            grad_s = _group_rows(rows.t(), pattern).to(selectors.dtype)
        else:
            x, weight, selectors = ctx.saved_tensors
            if need_x:
                grad_x = grad_out @ masked_weight(weight, selectors, pattern)  # [..., d_in]
            if need_w or need_s:
                # grad of the masked weight: [d_out, d_in], freed when backward of this node returns
                grad_w_hat = grad2.t() @ x.reshape(-1, x.shape[-1])
                if need_s:
                    grad_s = pattern.group_sum(grad_w_hat * weight).to(selectors.dtype)
                if need_w:
                    grad_w = masked_weight(grad_w_hat, selectors, pattern)
        if need_b and ctx.has_bias:
            grad_b = grad2.sum(0)
        return grad_x, grad_w, grad_b, grad_s, None


def _group_rows(values: torch.Tensor, pattern: GroupSpec) -> torch.Tensor:
    """``[d_out, G_in]`` -> ``[G_out, G_in]``: sum each group's ``g_out`` rows (ragged aware)."""
    d_out, G_in = values.shape
    G_out = -(-d_out // pattern.g_out)
    padded = F.pad(values, (0, 0, 0, G_out * pattern.g_out - d_out))
    return padded.view(G_out, pattern.g_out, G_in).sum(1)


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

    def forward(self, x, weight, bias=None):
        if self.observer is not None:
            self.observer(x)
        if not self.enabled or self.selectors is None:
            return F.linear(x, weight, bias)
        return masked_linear(x, weight, bias, self.selectors, self.pattern)

    def extra_repr(self) -> str:
        return f"{self.name}, group={self.pattern}, shape={self.shape}"


def selector_modules(gm: torch.nn.Module) -> dict[str, GroupSelector]:
    """Target name -> its GroupSelector, in graph (execution) order."""
    found = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            module = gm.get_submodule(node.target)
            if isinstance(module, GroupSelector):
                found[module.name] = module
    return found


def set_selectors(gm: torch.nn.Module, selectors: dict[str, torch.Tensor]) -> None:
    """Give each GroupSelector its selectors (float 0/1; may carry autograd history)."""
    modules = selector_modules(gm)
    unknown = set(selectors) - set(modules)
    if unknown:
        raise KeyError(f"no selector node for {sorted(unknown)[:3]}")
    for name, value in selectors.items():
        modules[name].selectors = value


@contextlib.contextmanager
def masks_disabled(model: torch.nn.Module):
    """Run ``model`` dense, every GroupSelector in it off: the self-distillation teacher. ``model``
    is a graph with selector nodes or an eager model with attached selectors (``gmc.masks.distributed``)."""
    selectors = [m for m in model.modules() if isinstance(m, GroupSelector)]
    for selector in selectors:
        selector.enabled = False
    try:
        yield
    finally:
        for selector in selectors:
            selector.enabled = True
