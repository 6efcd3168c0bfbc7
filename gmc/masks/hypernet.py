"""The GroupMask hypernetwork and the selector relaxation (docs/design.md sections 2-3).

    z [L, 1, 32]  fixed buffer, N(0, 0.02), one vector per target (q,k,v,o,gate,up,down per layer)
      -> bi-GRU(32 -> 64 x 2)      [L, 1, 128]
      -> LayerNorm(128) -> GELU    shared
      -> head_l                    [G_out^l * G_in^l] selector logits of target l

Heads:
  * ``full`` (the paper's): a bias-free ``Linear(128, G^l)`` per target, 128 parameters per group;
  * ``lowrank``: ``P_l (Q_l h)`` with ``Q_l: 128 -> r`` and ``P_l: r -> G^l``, ``r`` parameters per
    group. Both can express any logit vector; they differ in size and in optimisation dynamics.

``DirectLogits`` is the "without hypernetwork" ablation: free logits initialised N(0, 1).

With a prior (``gmc.masks.prior``) both add a fixed per-group buffer to their output and start from it
exactly: the head's last layer (free logits: the logits) is zero at init.

Relaxation: ``y = sigmoid((l + offset + g1 - g2) / T)`` with ``g_i = -log(-log(u_i + eps) + eps)``,
``u_i ~ U(0, 1)``: the difference of two Gumbel samples is the logistic noise of the binary
Gumbel-Sigmoid (Maddison et al. 2017). A single Gumbel sample (docs/design.md section 3 explains the
departure) has so thin a left tail (P(g < -3) = 2e-9) that with the +3 offset it would never drop a
group; the logistic noise the paper describes drops about 5% at init. Noise off: ``g = 0``. The
forward uses ``hard = 1[y > 0.5]``, the backward flows through ``y`` (straight-through). Export: keep
iff ``l + offset > 0``. A target whose hard selectors are all zero keeps its highest-logit group.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

HEADS = ("full", "lowrank")
PAPER_OFFSET = 3.0  # the paper's: every group starts kept, its logit ~3 above the threshold (--recipe paper)
Z_DIM, GRU_HIDDEN = 32, 64
_EPS = 1e-20


class HyperNetwork(nn.Module):
    def __init__(self, grids: list[tuple[int, int]], head: str = "full", rank: int = 16, seed: int = 42,
                 prior: list[torch.Tensor] | None = None):
        super().__init__()
        if head not in HEADS:
            raise ValueError(f"unknown head {head!r}: expected one of {HEADS}")
        self.grids = [tuple(g) for g in grids]
        generator = torch.Generator().manual_seed(seed)
        self.register_buffer("z", torch.randn(len(grids), 1, Z_DIM, generator=generator) * 0.02)
        self.gru = nn.GRU(Z_DIM, GRU_HIDDEN, num_layers=1, bidirectional=True)
        self.norm = nn.LayerNorm(2 * GRU_HIDDEN)
        width = 2 * GRU_HIDDEN
        if head == "full":
            self.heads = nn.ModuleList(nn.Linear(width, g[0] * g[1], bias=False) for g in self.grids)
        else:
            self.heads = nn.ModuleList(
                nn.Sequential(nn.Linear(width, rank, bias=False), nn.Linear(rank, g[0] * g[1], bias=False))
                for g in self.grids
            )
        self.priors = _register_priors(self, self.grids, prior)
        if prior is not None:  # step 0's logits are the prior exactly (gmc.masks.prior)
            for module in self.heads:
                last = module if isinstance(module, nn.Linear) else module[-1]
                nn.init.zeros_(last.weight)

    def forward(self) -> list[torch.Tensor]:
        """Selector logits of every target, each ``[G_out, G_in]`` (plus the prior, if any)."""
        features, _ = self.gru(self.z)  # [L, 1, 128]
        features = F.gelu(self.norm(features[:, 0]))  # [L, 128]
        logits = [head(features[i]).view(grid) for i, (head, grid) in enumerate(zip(self.heads, self.grids))]
        return _add_priors(self, logits)


class DirectLogits(nn.Module):
    """Free per-group logits, N(0, 1) at init: the ablation without a hypernetwork."""

    def __init__(self, grids: list[tuple[int, int]], seed: int = 42, prior: list[torch.Tensor] | None = None):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        init = (lambda g: torch.zeros(g)) if prior is not None else (lambda g: torch.randn(g, generator=generator))
        self.logits = nn.ParameterList(nn.Parameter(init(tuple(g))) for g in grids)
        self.priors = _register_priors(self, [tuple(g) for g in grids], prior)

    def forward(self) -> list[torch.Tensor]:
        return _add_priors(self, list(self.logits))


def _register_priors(module: nn.Module, grids, prior) -> int:
    """Prior logits as buffers ``prior_<i>`` (saved with the state dict); returns their count."""
    if prior is None:
        return 0
    if len(prior) != len(grids) or any(tuple(p.shape) != tuple(g) for p, g in zip(prior, grids)):
        raise ValueError("one prior of each target's grid shape is needed")
    for i, p in enumerate(prior):
        module.register_buffer(f"prior_{i}", p.detach().float().clone())
    return len(prior)


def _add_priors(module: nn.Module, logits: list[torch.Tensor]) -> list[torch.Tensor]:
    if not module.priors:
        return logits
    return [logit + getattr(module, f"prior_{i}").to(logit.dtype) for i, logit in enumerate(logits)]


def relaxed_selectors(
    logits: torch.Tensor, temperature: float, offset: float, generator: torch.Generator | None
) -> torch.Tensor:
    """Hard 0/1 selectors in the forward, Gumbel-Sigmoid gradient in the backward."""
    shifted = logits + offset
    if generator is not None:
        # Gumbel-Sigmoid: the difference of two Gumbel(0, 1) samples is logistic noise
        u1, u2 = torch.rand((2, *logits.shape), generator=generator).to(logits.device, logits.dtype)
        shifted = shifted + _gumbel(u1) - _gumbel(u2)
    soft = torch.sigmoid(shifted / temperature)
    hard = never_empty((soft > 0.5).to(soft.dtype), logits)
    return hard + (soft - soft.detach())  # exactly hard in the forward (x - x == 0)


def _gumbel(u: torch.Tensor) -> torch.Tensor:
    return -torch.log(-torch.log(u + _EPS) + _EPS)


def logistic_noise(like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Logistic noise shaped like ``like``: the difference of two Gumbel samples, as above."""
    u1, u2 = torch.rand((2, *like.shape), generator=generator).to(like.device, like.dtype)
    return _gumbel(u1) - _gumbel(u2)


def export_selectors(logits: torch.Tensor, offset: float) -> torch.Tensor:
    """Noise-free binary selectors: keep iff ``sigmoid((l + offset) / T) > 0.5``."""
    keep = (logits.detach() + offset > 0).float()
    return never_empty(keep, logits.detach()).bool()


def never_empty(hard: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """``hard`` (0/1 or bool selectors of one target), or, when it keeps nothing, a copy keeping
    the highest-logit group: no target is ever pruned away whole."""
    if bool(hard.any()):
        return hard
    hard = hard.clone()
    hard.view(-1)[logits.detach().argmax()] = 1.0
    return hard


def parameter_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)
