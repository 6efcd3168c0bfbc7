"""The full head's update from its gradient's two factors.

A full head is ``logits_l = W_l f_l`` with one GRU feature ``f_l [128]`` per target
(``gmc.masks.hypernet``), so its weight gradient is the outer product ``g_l f_l^T`` of the logits'
gradient and the feature: rank one, yet ``[G_l, 128]`` numbers, 212M on SmolLM2-135M. Autograd
writes it out and AdamW reads it back. Here the head's backward keeps ``(g_l, f_l)``
(``RankOneLinear``) and ``RankOneAdamW`` updates the weight and both moments from them in one
compiled loop: six passes over the head's memory instead of eight, and no 850 MB allocation a
step. The arithmetic is torch's AdamW's, with the same state (``step``, ``exp_avg``,
``exp_avg_sq``), so a checkpoint loads into either optimizer; results equal AdamW's to float
rounding (tests/masks/test_rank_one.py).

The learner uses it with the compiled step (``--compile-step``): the update compiles in seconds,
and a run that compiles is long enough to pay for it. Where compiling fails the optimizer writes
the gradients out and runs torch's AdamW, and says so.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from tqdm.auto import tqdm

Factors = dict[int, tuple[torch.Tensor, torch.Tensor]]  # head index -> (g [G], f [128]) of this step


class RankOneLinear(torch.autograd.Function):
    """``weight @ feature`` whose backward stores the weight's gradient as ``factors[slot] = (g, f)``
    (and returns the feature's gradient ``weight^T g``) instead of the dense outer product."""

    @staticmethod
    def forward(ctx, feature: torch.Tensor, weight: torch.Tensor, factors: Factors, slot: int) -> torch.Tensor:
        ctx.save_for_backward(feature, weight)
        ctx.factors, ctx.slot = factors, slot
        return weight @ feature

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        feature, weight = ctx.saved_tensors
        if ctx.slot in ctx.factors:
            raise RuntimeError(f"head {ctx.slot} was used twice in one step; rank-one factors do not accumulate")
        ctx.factors[ctx.slot] = (grad.detach(), feature.detach())
        return (weight.t() @ grad if ctx.needs_input_grad[0] else None), None, None, None


def _update(weight, exp_avg, exp_avg_sq, g, f, scalars) -> None:
    """torch's AdamW step (weight decay first) with ``grad = g f^T`` formed inside the loop.

    ``scalars``: ``1 - lr * wd, 1 - beta1, beta2, 1 - beta2, sqrt(1 - beta2^t), eps, lr / (1 - beta1^t)``
    (a tensor, so that a new step's values do not recompile)."""
    grad = g[:, None] * f[None, :]
    weight.mul_(scalars[0])
    exp_avg.lerp_(grad, scalars[1])
    exp_avg_sq.mul_(scalars[2]).add_(grad * grad * scalars[3])
    weight.sub_(exp_avg / (exp_avg_sq.sqrt() / scalars[4] + scalars[5]) * scalars[6])


class RankOneAdamW(torch.optim.AdamW):
    """AdamW over ``params`` in which ``heads`` (parameter -> slot of ``factors``) update from the
    rank-one factors their ``RankOneLinear`` stored this step; every other parameter takes torch's
    AdamW step from its gradient."""

    def __init__(self, params, heads: dict[int, int], factors: Factors, **kwargs):
        """``heads``: ``id(parameter)`` -> its slot in ``factors``."""
        super().__init__(params, **kwargs)
        self.heads, self.factors = heads, factors
        self._compiled: Optional[object] = torch.compile(_update, dynamic=True)

    @torch.no_grad()
    def step(self, closure=None):
        pending = [(p, group, self.factors.pop(self.heads[id(p)]))
                   for group in self.param_groups for p in group["params"]
                   if self.heads.get(id(p)) in self.factors]
        if pending and self._compiled is not None:
            try:
                self._head_step(*pending[0])
                pending = pending[1:]
            except Exception as error:  # noqa: BLE001 - any compile failure falls back to torch's AdamW
                first = (str(error).strip().splitlines() or [type(error).__name__])[0]
                tqdm.write(f"gmc: compiling the head's rank-one update failed ({first[:200]}); "
                           "writing its gradients out for torch's AdamW")
                self._compiled = None
        dense = self._compiled is None
        if dense:  # the fallback: the gradients written out, torch's AdamW
            for p, _, (g, f) in pending:
                p.grad = torch.outer(g, f)
        loss = super().step(closure)
        for p, group, factors in ([] if dense else pending):
            self._head_step(p, group, factors)
        if dense:
            for p, _, _ in pending:
                p.grad = None
        return loss

    def _head_step(self, p: torch.Tensor, group: dict, factors: tuple[torch.Tensor, torch.Tensor]) -> None:
        state = self.state[p]
        if not state:  # the layout torch's AdamW gives its state, so either optimizer resumes the other's
            on_device = group.get("fused") or group.get("capturable")
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        t = float(state["step"]) + 1
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        scalars = torch.tensor([1 - lr * wd, 1 - beta1, beta2, 1 - beta2, math.sqrt(1 - beta2 ** t), eps,
                                lr / (1 - beta1 ** t)], dtype=torch.float32, device=p.device)
        g, f = factors
        self._compiled(p, state["exp_avg"], state["exp_avg_sq"], g.to(p.dtype), f.to(p.dtype), scalars)
        state["step"] += 1  # after the update: a compile that fails leaves the state to torch's AdamW
