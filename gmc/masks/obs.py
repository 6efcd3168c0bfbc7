"""The OBS math of SparseGPT (Frantar & Alistarh 2023) on one linear: its Hessian, the left-to-right
sweep that prunes and updates its weight, the choosers of the pruned set, and conjugate-gradient
refinement. ``gmc.masks.sparsegpt`` runs it over a model, decoder block by decoder block.

For a target linear W [d_out, d_in] with inputs X [tokens, d_in]::

    H      = 2 X^T X / tokens                      fp32, accumulated over calibration tokens
    dead   = diag(H) == 0  ->  H[j, j] = 1          (inputs that are always zero)
    H     += 0.01 * mean(diag(H)) * I               dampening
    U      = cholesky(H^-1, upper)                  rows of U = the OBS update directions
    for each column block [i1, i2) (128 columns, aligned to the pattern):
        choose the pruned set of the block from saliency w^2 / U_jj^2   (or take the given mask)
        for each column j of the block, left to right:
            err_j  = (w_j - q_j) / U_jj             q_j = 0 if pruned else w_j
            W[:, j:i2] -= err_j U[j, j:i2]          then W[:, j] = q_j exactly
        W[:, i2:] -= Err U[i1:i2, i2:]              lazy update of the later columns

Patterns all go through that one sweep; only "choose the pruned set" differs:
  * gmc groups ``g_out x g_in`` (``1x1`` is unstructured SparseGPT): the column block size is
    aligned to a multiple of ``g_in`` (``g_in * max(1, round(128 / g_in))``), so no group ever
    spans a block boundary (a ragged last group is the end of the last block). At the start of
    each block its groups are scored by the sum of their entries' saliencies (the current, already
    updated weights) and compared per parameter, so a smaller ragged group competes fairly; the
    lowest are pruned until the pruned count *up to the end of this block* is closest to
    ``sparsity * d_out * i2``. Carrying the rounding from block to block keeps each layer within
    one group of the uniform target, and the final mask is exactly group-structured. A layer is
    never emptied: it keeps at least one group (docs/design.md section 1).
  * N:M: at the first column of each run of ``m`` inputs, the ``m - n`` entries of lowest saliency
    in each row are pruned (as in the reference code, with the weights updated so far).
  * a given mask (``reconstruct``): the pruned set is read from the mask.
Inputs that are dead on the calibration data have saliency 0 (pruning them costs nothing there);
their kept weights are left as they were (no information to update them).

Exactness. For a *fixed* mask the left-to-right sweep only moves weights to the right of each
pruned one: it is the exact least-squares reconstruction ``min ||W X - W' X||`` over each row's
kept entries only when every row's pruned entries precede its kept ones (e.g. d_in = 2, keep
column 0 and prune column 1: the sweep leaves column 0 as it was, the optimum moves it by
``H_01 / H_00 * w_1``). ``refine_steps > 0`` adds batched, Jacobi-preconditioned conjugate-gradient
steps from the sweep's result on the same damped quadratic, which converge to that exact
solution (one ``[d_out, d_in] x [d_in, d_in]`` matmul per step). The gap is large for group masks
given from outside: on SmolLM2 with Wanda-style 1x64 masks the sweep leaves 64-68% of the
masked-only layer error, the exact fit 28-46%, and 20 CG steps come within 0.5% of the exact fit.
``prune_linear`` defaults to the paper's sweep (``refine_steps=0``); ``reconstruct_linear`` defaults
to ``RECONSTRUCT_REFINE_STEPS`` (perplexities in docs/sparsegpt.md).
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from gmc.errors import GmcError
from gmc.groups import GroupSpec, NMSpec, Pattern

DAMP = 0.01  # dampening, fraction of the mean Hessian diagonal
BLOCK = 128  # column block of the lazy batched update
SOLVE_WIDTH = 16  # columns per batched triangular solve inside a strip (speed only)
RECONSTRUCT_REFINE_STEPS = 20  # measured: docs/sparsegpt.md

# chooser(start column, current weights of the strip [d_out, w], U_jj of the strip [w]) -> pruned [d_out, w]
Chooser = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]


# ---------------------------------------------------------------- statistics and the sweep


class HessianAccumulator:
    """Forward hook of an ``nn.Linear``: ``H = 2 X^T X / tokens`` in fp32 over every call."""

    def __init__(self, d_in: int, device: torch.device):
        self.hessian = torch.zeros(d_in, d_in, dtype=torch.float32, device=device)
        self.tokens = 0

    def __call__(self, module, args, output) -> None:
        x = args[0].detach().reshape(-1, args[0].shape[-1]).float()  # [t, d_in]
        total = self.tokens + x.shape[0]
        self.hessian.mul_(self.tokens / total)
        self.tokens = total
        x = x * math.sqrt(2.0 / total)
        self.hessian.addmm_(x.T, x)  # [d_in, d_in]


class CrossAccumulator:
    """``H = 2 X_p^T X_p / t`` and ``C = 2 X_p^T X_d / t`` (fp32) of one target over paired calls."""

    def __init__(self, d_in: int, device: torch.device):
        self.hessian = torch.zeros(d_in, d_in, dtype=torch.float32, device=device)
        self.cross = torch.zeros(d_in, d_in, dtype=torch.float32, device=device)
        self.tokens = 0

    def add(self, x_pruned: torch.Tensor, x_dense: torch.Tensor) -> None:
        xp = x_pruned.detach().reshape(-1, x_pruned.shape[-1]).float()  # [t, d_in]
        xd = x_dense.detach().reshape(-1, x_dense.shape[-1]).float()
        total = self.tokens + xp.shape[0]
        self.hessian.mul_(self.tokens / total)
        self.cross.mul_(self.tokens / total)
        self.tokens = total
        scale = 2.0 / total
        self.hessian.addmm_(xp.T, xp, alpha=scale)
        self.cross.addmm_(xp.T, xd, alpha=scale)


def damped_hessian(hessian: torch.Tensor, damp: float = DAMP) -> tuple[torch.Tensor, torch.Tensor]:
    """``(H', dead)``: dead inputs get ``H'[j, j] = 1``, then ``damp * mean(diag)`` on the diagonal."""
    H = hessian.float().clone()  # [d_in, d_in]
    dead = H.diagonal() == 0  # [d_in]
    H[dead, dead] = 1.0
    H.diagonal().add_(damp * H.diagonal().mean())
    return H, dead


def inverse_cholesky(H: torch.Tensor, name: str = "a target") -> torch.Tensor:
    """Upper Cholesky factor ``U`` of ``H^-1`` (``H^-1 = U^T U``)."""
    L, info = torch.linalg.cholesky_ex(H)
    if int(info) == 0:
        L, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(L), upper=True)
    if int(info) != 0:
        raise GmcError(f"SparseGPT: the Hessian of {name} is not positive definite even after "
                       f"dampening; use more calibration samples or a larger damp")
    return L


@torch.no_grad()
def obs_sweep(
    weight: torch.Tensor, U: torch.Tensor, choose: Chooser, block: int, strip: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prune ``weight [d_out, d_in]`` left to right with OBS updates: ``(new fp32 W, pruned)``.

    ``choose`` is called at the first column of every ``strip`` (which divides ``block``) with the
    strip's current weights and ``U``'s diagonal there; it returns the strip's pruned entries.
    Inside a strip the pruned set is fixed, so the column recursion of the module docstring,
    ``err_i = p_i (w_i - sum_{k<i} err_k U_ki) / U_ii``, is one lower-triangular solve per row
    (``_strip_errors``): the column-by-column loop of the paper without a Python loop per column.
    """
    W = weight.float().clone()  # [d_out, d_in]
    d_in = W.shape[1]
    pruned_all = torch.zeros_like(W, dtype=torch.bool)
    for i1 in range(0, d_in, block):
        i2 = min(i1 + block, d_in)
        W1, U1 = W[:, i1:i2].clone(), U[i1:i2, i1:i2]  # [d_out, c], [c, c]
        errors = torch.zeros_like(W1)  # [d_out, c]
        for j1 in range(0, i2 - i1, strip):
            j2 = min(j1 + strip, i2 - i1)
            pruned_all[:, i1 + j1:i1 + j2] = choose(i1 + j1, W1[:, j1:j2], U1.diagonal()[j1:j2])
            for k1 in range(j1, j2, SOLVE_WIDTH):  # narrow solves: M costs d_out * width^2
                k2 = min(k1 + SOLVE_WIDTH, j2)
                pruned = pruned_all[:, i1 + k1:i1 + k2]  # [d_out, t]
                err = _strip_errors(W1[:, k1:k2], U1[k1:k2, k1:k2], pruned)  # [d_out, t]
                W1[:, k1:].sub_(err @ U1[k1:k2, k1:])
                W1[:, k1:k2].masked_fill_(pruned, 0.0)  # exactly zero, not w - (w/d)*d
                errors[:, k1:k2] = err
        W[:, i1:i2] = W1
        W[:, i2:].sub_(errors @ U[i1:i2, i2:])
    return W, pruned_all


def _strip_errors(W: torch.Tensor, U: torch.Tensor, pruned: torch.Tensor, max_elements: int = 1 << 24) -> torch.Tensor:
    """OBS errors ``[d_out, s]`` of one strip: per row ``M e = p * w`` with ``M`` lower triangular,
    row ``i`` of ``M`` = column ``i`` of ``U`` if ``i`` is pruned, else the identity row (``e_i = 0``).
    Rows are solved in chunks of at most ``max_elements`` entries of ``M``."""
    errors = torch.zeros_like(W)
    if not pruned.any():
        return errors
    s = W.shape[1]
    eye = torch.eye(s, dtype=W.dtype, device=W.device)
    rows = max(1, max_elements // (s * s))
    for r1 in range(0, W.shape[0], rows):
        p = pruned[r1:r1 + rows]  # [r, s]
        M = torch.where(p[:, :, None], U.T[None], eye[None])  # [r, s, s]
        rhs = (W[r1:r1 + rows] * p)[:, :, None]  # [r, s, 1]
        errors[r1:r1 + rows] = torch.linalg.solve_triangular(M, rhs, upper=False)[..., 0]
    return errors


@torch.no_grad()
def refine(weight: torch.Tensor, dense: torch.Tensor, H: torch.Tensor, keep: torch.Tensor, steps: int) -> torch.Tensor:
    """Conjugate-gradient steps on ``min_V tr((V - W) H (V - W)^T)``, ``V`` zero off ``keep``.

    Batched over rows (each row is an independent problem on its kept entries), Jacobi
    preconditioned, started from ``weight`` (the sweep's result); converges to the exact masked
    least-squares solution of the damped objective. Entries off ``keep`` stay exactly zero.
    """
    V = weight.float() * keep  # [d_out, d_in]
    keep = keep.float()
    precond = 1.0 / H.diagonal()  # [d_in]
    residual = -((V - dense.float()) @ H) * keep  # b - A v, [d_out, d_in]
    z = residual * precond
    direction, rz = z, (residual * z).sum(1)  # [d_out, d_in], [d_out]
    for _ in range(steps):
        Ap = (direction @ H) * keep
        curvature = (direction * Ap).sum(1)
        alpha = torch.where(curvature > 0, rz / curvature.clamp_min(1e-30), 0.0)  # [d_out]
        V.add_(alpha[:, None] * direction)
        residual.sub_(alpha[:, None] * Ap)
        z = residual * precond
        rz_next = (residual * z).sum(1)
        beta = torch.where(rz > 0, rz_next / rz.clamp_min(1e-30), 0.0)
        direction, rz = z + beta[:, None] * direction, rz_next
    return V


# ---------------------------------------------------------------- choosing the pruned set


def block_size(pattern: Pattern, base: int = BLOCK) -> int:
    """Column block aligned so that no group (or run of ``m``) spans two blocks."""
    return pattern.block_width * max(1, round(base / pattern.block_width))


class GroupChooser:
    """Per column block, prune the groups of lowest saliency per parameter (module docstring)."""

    def __init__(self, pattern: GroupSpec, shape: tuple[int, int], sparsity: float, dead: torch.Tensor):
        self.pattern, self.shape, self.sparsity, self.dead = pattern, shape, sparsity, dead
        self.pruned_params = 0
        self.kept_groups = 0

    def __call__(self, start: int, W1: torch.Tensor, diag: torch.Tensor) -> torch.Tensor:
        d_out, width = W1.shape
        saliency = W1.pow(2) / diag.pow(2)[None, :]  # [d_out, c]
        saliency[:, self.dead[start:start + width]] = 0.0
        sizes = self.pattern.group_sizes((d_out, width)).reshape(-1)  # [G]
        density = self.pattern.group_sum(saliency).reshape(-1) / sizes  # [G]
        order = density.argsort(stable=True)  # lowest saliency first
        count = self._count(sizes[order], start + width)
        prune = torch.zeros_like(density, dtype=torch.bool)
        prune[order[:count]] = True
        self.pruned_params += int(sizes[order[:count]].sum())
        self.kept_groups += prune.numel() - count
        grid = self.pattern.grid((d_out, width))
        return self.pattern.expand(prune.reshape(grid), (d_out, width))

    def _count(self, sorted_sizes: torch.Tensor, end: int) -> int:
        """Groups to prune so that pruned params up to column ``end`` are closest to the target."""
        budget = self.sparsity * self.shape[0] * end - self.pruned_params
        cumulative = torch.cat([sorted_sizes.new_zeros(1), sorted_sizes.cumsum(0)]).double()
        count = int((cumulative - budget).abs().argmin())
        if end == self.shape[1] and self.kept_groups == 0:
            count = min(count, sorted_sizes.numel() - 1)  # never empty a target
        return count


class NMChooser:
    """Prune the ``m - n`` lowest-saliency entries of each row in a run of ``m`` inputs."""

    def __init__(self, pattern: NMSpec, dead: torch.Tensor):
        self.pattern, self.dead = pattern, dead

    def __call__(self, start: int, W1: torch.Tensor, diag: torch.Tensor) -> torch.Tensor:
        saliency = W1.pow(2) / diag.pow(2)[None, :]  # [d_out, m]
        saliency[:, self.dead[start:start + W1.shape[1]]] = 0.0
        lowest = saliency.topk(self.pattern.m - self.pattern.n, dim=1, largest=False).indices
        return torch.zeros_like(W1, dtype=torch.bool).scatter_(1, lowest, True)


class FixedChooser:
    """The pruned set of a given full-resolution keep mask ``[d_out, d_in]``."""

    def __init__(self, keep: torch.Tensor):
        self.pruned = ~keep.bool()

    def __call__(self, start: int, W1: torch.Tensor, diag: torch.Tensor) -> torch.Tensor:
        return self.pruned[:, start:start + W1.shape[1]].to(W1.device)


def selectors_from_keep(pattern: Pattern, keep: torch.Tensor) -> torch.Tensor:
    """Selectors ``[G_out, G_in]`` of a full-resolution keep mask that is exactly structured."""
    keep = keep.bool().cpu()
    selectors = pattern.group_sum(keep.float()) > 0
    if not torch.equal(pattern.expand(selectors, tuple(keep.shape)), keep):
        raise RuntimeError(f"internal error: SparseGPT mask is not {pattern}-structured")
    return selectors


# ---------------------------------------------------------------- one linear: entry points


def prune_linear(
    weight: torch.Tensor, hessian: torch.Tensor, pattern: Pattern, sparsity: float,
    damp: float = DAMP, name: str = "a target", refine_steps: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SparseGPT on one weight ``[d_out, d_in]``: ``(updated fp32 weight, selectors)``.

    ``refine_steps > 0`` adds conjugate-gradient steps towards the exact fit for the chosen mask."""
    H, dead = damped_hessian(hessian, damp)
    U = inverse_cholesky(H, name)
    if isinstance(pattern, NMSpec):
        if weight.shape[1] % pattern.m:
            raise GmcError(f"{pattern} needs input sizes divisible by {pattern.m}; {name} has {weight.shape[1]}")
        choose, strip = NMChooser(pattern, dead), pattern.m
    else:
        choose, strip = GroupChooser(pattern, tuple(weight.shape), sparsity, dead), block_size(pattern)
    W, pruned = obs_sweep(weight, U, choose, block_size(pattern), strip)
    if refine_steps > 0:
        W = refine(W, weight, H, ~pruned, refine_steps)
    return W, selectors_from_keep(pattern, ~pruned)


def reconstruct_linear(
    weight: torch.Tensor, hessian: torch.Tensor, keep: torch.Tensor, damp: float = DAMP,
    refine_steps: int = RECONSTRUCT_REFINE_STEPS, name: str = "a target",
) -> torch.Tensor:
    """OBS update of ``weight [d_out, d_in]`` for a given full-resolution ``keep`` mask (fp32 result)."""
    H, dead = damped_hessian(hessian, damp)
    U = inverse_cholesky(H, name)
    keep = keep.bool().to(weight.device)
    W, _ = obs_sweep(weight, U, FixedChooser(keep), BLOCK, BLOCK)
    if refine_steps > 0:
        W = refine(W, weight, H, keep, refine_steps)
    return W


def dense_target_weight(weight: torch.Tensor, hessian: torch.Tensor, cross: torch.Tensor,
                        damp: float = DAMP) -> torch.Tensor:
    """``W* = W C^T H^-1``: the dense-input least-squares target (``reconstruct(target="dense")``)."""
    H, _ = damped_hessian(hessian, damp)
    # W* H = W C^T  ->  H W*^T = C W^T (H symmetric)
    return torch.linalg.solve(H, cross.float() @ weight.float().T).T
