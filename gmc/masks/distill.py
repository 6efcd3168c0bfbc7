"""The self-distillation losses of mask learning and weight recovery.

``soft_cross_entropy``: the cross-entropy of the student's logits against the dense teacher's softmax
over the full vocabulary, chunked over tokens so that neither pass holds a ``[tokens, V]`` fp32 copy
of the logits. ``hidden_distance`` (layer-wise distillation, ``--layer-kd``): how far the student's
residual stream after chosen decoder blocks is from the teacher's."""
from __future__ import annotations

import torch


class _SoftCrossEntropy(torch.autograd.Function):
    """``-mean_t sum_v softmax(t)_v log_softmax(s)_v`` computed ``chunk`` tokens at a time.

    Autograd of the plain expression would keep ``[tokens, V]`` fp32 softmax and log-softmax
    copies of both logits; here forward and backward each hold one chunk at a time, and the
    backward writes ``(softmax(s) - softmax(t)) / N`` straight into the gradient.
    """

    @staticmethod
    def forward(ctx, student, teacher, chunk):
        s2, t2 = student.reshape(-1, student.shape[-1]), teacher.reshape(-1, teacher.shape[-1])
        total = student.new_zeros((), dtype=torch.float32)
        for i in range(0, s2.shape[0], chunk):
            p_t = torch.softmax(t2[i:i + chunk].float(), -1)
            total += -(p_t * torch.log_softmax(s2[i:i + chunk].float(), -1)).sum()
        ctx.save_for_backward(student, teacher)
        ctx.chunk = chunk
        return total / s2.shape[0]

    @staticmethod
    def backward(ctx, grad):
        student, teacher = ctx.saved_tensors
        s2, t2 = student.reshape(-1, student.shape[-1]), teacher.reshape(-1, teacher.shape[-1])
        out = torch.empty_like(s2)
        scale = grad / s2.shape[0]
        for i in range(0, s2.shape[0], ctx.chunk):
            diff = torch.softmax(s2[i:i + ctx.chunk].float(), -1) - torch.softmax(t2[i:i + ctx.chunk].float(), -1)
            out[i:i + ctx.chunk] = (diff * scale).to(out.dtype)
        return out.view_as(student), None, None


def soft_cross_entropy(student: torch.Tensor, teacher: torch.Tensor, chunk: int = 512) -> torch.Tensor:
    """Self-distillation loss over the full vocabulary, averaged over tokens."""
    return _SoftCrossEntropy.apply(student, teacher.detach(), chunk)


def hidden_distance(student: list[torch.Tensor], teacher: list[torch.Tensor], eps: float = 1e-6) -> torch.Tensor:
    """``mean_depth mean_token |s - t|^2 / |t|^2`` over pairs of hidden states ``[..., d]``.

    Each token's squared error is relative to its own teacher norm: a residual stream's tokens differ
    in norm by orders of magnitude (the first token's "massive activations"), and an absolute error
    would learn little but those tokens. Computed in fp32 whatever the forward's precision."""
    if len(student) != len(teacher) or not student:
        raise ValueError(f"hidden_distance needs equal, non-empty lists ({len(student)} vs {len(teacher)})")
    terms = []
    for s, t in zip(student, teacher):
        s, t = s.float(), t.detach().float()
        terms.append(((s - t).square().sum(-1) / (t.square().sum(-1) + eps)).mean())
    return torch.stack(terms).mean()
