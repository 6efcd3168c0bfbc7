"""SparseGPT (Frantar & Alistarh 2023): a one-shot mask *and* an update of the kept weights.

Why it is in gmc: GroupMask keeps the pretrained weights frozen; SparseGPT wins at 50% because it
moves the kept weights to compensate for the pruned ones. gmc offers it as a baseline
(``sparsegpt_prune``: choose the mask and update) and as a reconstruction pass after any given
mask (``reconstruct``: learned, heuristic or loaded masks; only the update).

Algorithm, per decoder block in order (one block on the device at a time)::

    X   <- inputs of block b, produced by the already pruned blocks 0..b-1
    for each stage of the block's targets (q,k,v | o | gate,up | down: call order, shared input),
    for every target linear W [d_out, d_in] of the stage (its input X_l [tokens, d_in], computed
    with the earlier stages already updated, as GPTQ's "true sequential"):
        H      = 2 X_l^T X_l / tokens                  fp32, accumulated over calibration tokens
        dead   = diag(H) == 0  ->  H[j, j] = 1          (inputs that are always zero)
        H     += 0.01 * mean(diag(H)) * I               dampening
        U      = cholesky(H^-1, upper)                  rows of U = the OBS update directions
        for each column block [i1, i2) (128 columns, aligned to the pattern):
            choose the pruned set of the block from saliency w^2 / U_jj^2   (or take the given mask)
            for each column j of the block, left to right:
                err_j  = (w_j - q_j) / U_jj             q_j = 0 if pruned else w_j
                W[:, j:i2] -= err_j U[j, j:i2]          then W[:, j] = q_j exactly
            W[:, i2:] -= Err U[i1:i2, i2:]              lazy update of the later columns
    X   <- outputs of the pruned block

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
``sparsegpt_prune`` defaults to the paper's sweep (``refine_steps=0``); ``reconstruct`` defaults
to ``RECONSTRUCT_REFINE_STEPS`` (perplexities in docs/sparsegpt.md).

Model state: both entry points work *in place*: each target weight of ``loaded.model`` is replaced
by its pruned and updated value (pruned entries exactly zero), and the returned weights are those
tensors (on CPU; for a model on CPU they share storage with the model). Callers that need the
dense model afterwards must copy it first. All calibration blocks must have the same length and
no padding (``gmc.inputs.calib.token_blocks``), so the decoder-layer keyword arguments (causal mask,
rotary embeddings) captured from the first block serve every block.
"""
from __future__ import annotations

import contextlib
import copy
import math
from typing import Callable, Iterator, Mapping, Optional

import torch
from tqdm.auto import tqdm

from gmc.errors import GmcError
from gmc.graph.targets import TargetFilter, decoder_layers
from gmc.groups import GroupSpec, NMSpec, Pattern, parse_pattern
from gmc.inputs.model import LoadedModel

DAMP = 0.01  # dampening, fraction of the mean Hessian diagonal
BLOCK = 128  # column block of the lazy batched update
SOLVE_WIDTH = 16  # columns per batched triangular solve inside a strip (speed only)
RECONSTRUCT_REFINE_STEPS = 20  # measured: docs/sparsegpt.md

# chooser(start column, current weights of the strip [d_out, w], U_jj of the strip [w]) -> pruned [d_out, w]
Chooser = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]


# ---------------------------------------------------------------- one linear: Hessian -> update


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
    (``_strip_errors``): the same result as ``obs_sweep_columns`` without a Python loop per column.
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
def obs_sweep_columns(
    weight: torch.Tensor, U: torch.Tensor, choose: Chooser, block: int, strip: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference twin of ``obs_sweep``: the column-by-column loop of the SparseGPT paper (slow)."""
    W = weight.float().clone()  # [d_out, d_in]
    d_in = W.shape[1]
    pruned_all = torch.zeros_like(W, dtype=torch.bool)
    for i1 in range(0, d_in, block):
        i2 = min(i1 + block, d_in)
        W1, U1 = W[:, i1:i2].clone(), U[i1:i2, i1:i2]  # [d_out, c], [c, c]
        diag = U1.diagonal()  # [c]
        pruned = torch.zeros_like(W1, dtype=torch.bool)
        errors = torch.zeros_like(W1)  # [d_out, c]
        for i in range(i2 - i1):
            if i % strip == 0:
                pruned[:, i:i + strip] = choose(i1 + i, W1[:, i:i + strip], diag[i:i + strip])
            err = torch.where(pruned[:, i], W1[:, i], 0.0) / diag[i]  # [d_out]
            W1[:, i:].sub_(err[:, None] * U1[i, i:][None, :])
            W1[:, i].masked_fill_(pruned[:, i], 0.0)
            errors[:, i] = err
        W[:, i1:i2] = W1
        W[:, i2:].sub_(errors @ U[i1:i2, i2:])
        pruned_all[:, i1:i2] = pruned
    return W, pruned_all


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
    width = pattern.m if isinstance(pattern, NMSpec) else pattern.g_in
    return width * max(1, round(base / width))


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


# ---------------------------------------------------------------- the model, block by block


def sparsegpt_prune(
    loaded: LoadedModel, pattern: Pattern | str, sparsity: Optional[float], blocks: torch.Tensor,
    chosen: Callable[[str], bool] = TargetFilter(), progress: bool = True,
    damp: float = DAMP, device: Optional[str | torch.device] = None, refine_steps: int = 0,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """SparseGPT with uniform per-layer ``sparsity`` (implied by N:M patterns; pass it or None).

    ``blocks``: calibration tokens ``[n, seq]``; ``chosen``: which module names are targets (a
    ``TargetFilter``, or the target set's ``names.__contains__``). Returns ``(selectors, weights)``: bool selectors
    on the pattern grid and the updated target weights, keyed by module name. Modifies
    ``loaded.model`` in place (module docstring).
    """
    found = decoder_layers(loaded.model, chosen)  # the blocks solved one by one, and their name prefix
    pattern = parse_pattern(pattern)
    sparsity = _check_sparsity(pattern, sparsity)
    selectors: dict[str, torch.Tensor] = {}

    def solve(name: str, weight: torch.Tensor, hessian: torch.Tensor) -> torch.Tensor:
        W, selectors[name] = prune_linear(weight, hessian, pattern, sparsity, damp, name, refine_steps)
        return W

    weights = _blockwise(loaded.model, found, blocks, chosen, solve, progress, device, "sparsegpt")
    return selectors, weights


TARGETS = ("pruned", "dense")  # what a reconstructed layer's output is fitted to (``--target``)


def reconstruct(
    loaded: LoadedModel, masks: Mapping[str, torch.Tensor], pattern: Pattern | str, blocks: torch.Tensor,
    progress: bool = True, damp: float = DAMP, refine_steps: int = RECONSTRUCT_REFINE_STEPS,
    device: Optional[str | torch.device] = None, target: str = "pruned",
) -> dict[str, torch.Tensor]:
    """Update the kept weights of every target in ``masks`` (selectors on the ``pattern`` grid).

    ``loaded.model`` must hold the dense weights. ``target``:
      * ``pruned`` (SparseGPT's): fit ``W' X_p`` to ``W X_p``, the dense weights on the inputs the
        pruned model produces, ``X_p`` from the already reconstructed earlier blocks;
      * ``dense``: fit ``W' X_p`` to ``W X_d``, the *dense model's* output, ``X_d`` the inputs the
        dense model produces. With ``H = X_p^T X_p`` and ``C = X_p^T X_d`` the unconstrained optimum
        is ``W* = W C^T H^-1``, and ``||W' X_p - W X_d||^2 = ||(W' - W*) X_p||^2 + const``, so the
        same masked OBS sweep + CG runs on ``W*`` instead of ``W``. Errors the earlier layers made
        are then compensated instead of being fitted (docs/sparsegpt.md).
    Returns the updated weights (pruned entries exactly zero), keyed by module name; modifies
    ``loaded.model`` in place.
    """
    if target not in TARGETS:
        raise GmcError(f"bad --target {target!r}: expected one of {', '.join(TARGETS)}")
    pattern = parse_pattern(pattern)
    modules = dict(loaded.model.named_modules())
    missing = [name for name in masks if name not in modules]
    if missing:
        raise GmcError(f"masks do not match the model: it has no linear named {missing[0]!r}")

    def solve(name: str, weight: torch.Tensor, hessian: torch.Tensor, cross: Optional[torch.Tensor] = None) -> torch.Tensor:
        keep = pattern.expand(masks[name].bool(), tuple(weight.shape))
        if cross is not None:
            weight = dense_target_weight(weight, hessian, cross, damp)
        return reconstruct_linear(weight, hessian, keep, damp, refine_steps, name)

    found = decoder_layers(loaded.model, masks.__contains__)
    weights = _blockwise(loaded.model, found, blocks, masks.__contains__, solve, progress, device, "reconstruct",
                         dense_target=target == "dense")
    absent = set(masks) - set(weights)
    if absent:
        raise GmcError(f"reconstruct: {sorted(absent)[0]} is not a linear inside a decoder layer")
    return weights


def dense_target_weight(weight: torch.Tensor, hessian: torch.Tensor, cross: torch.Tensor,
                        damp: float = DAMP) -> torch.Tensor:
    """``W* = W C^T H^-1``: the dense-input least-squares target (``reconstruct(target="dense")``)."""
    H, _ = damped_hessian(hessian, damp)
    # W* H = W C^T  ->  H W*^T = C W^T (H symmetric)
    return torch.linalg.solve(H, cross.float() @ weight.float().T).T


def _check_sparsity(pattern: Pattern, sparsity: Optional[float]) -> float:
    if isinstance(pattern, NMSpec):
        if sparsity is not None and abs(sparsity - pattern.sparsity) > 1e-9:
            raise GmcError(f"--group {pattern} fixes sparsity at {pattern.sparsity}; got {sparsity}")
        return pattern.sparsity
    if sparsity is None or not 0.0 < sparsity < 1.0:
        raise GmcError(f"bad sparsity {sparsity}: must be strictly between 0 and 1")
    return float(sparsity)


Solve = Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor]


@torch.no_grad()
def _blockwise(
    model: torch.nn.Module, found: tuple[torch.nn.ModuleList, str], blocks: torch.Tensor,
    is_target: Callable[[str], bool], solve: Solve, progress: bool, device, desc: str, dense_target: bool = False,
) -> dict[str, torch.Tensor]:
    """Run ``solve(name, weight, H)`` on every target, decoder block after decoder block (``found``:
    ``decoder_layers``' blocks and their name prefix).

    ``dense_target``: also carry the dense model's hidden states (a dense copy of each block) and
    call ``solve(name, weight, H, C)`` with ``C = X_p^T X_d``, the pruned/dense input cross-covariance."""
    layers, prefix = found
    device = torch.device(device) if device is not None else next(layers[0].parameters()).device
    hidden, kwargs = _first_layer_inputs(model, layers[0], blocks, device)  # [n, seq, hidden]
    dense_hidden = hidden.clone() if dense_target else None
    weights: dict[str, torch.Tensor] = {}
    for index, layer in enumerate(tqdm(layers, desc=desc, unit="block", disable=not progress)):
        with _on_device(layer, device):
            dense_layer = copy.deepcopy(layer) if dense_target else None
            targets = {f"{prefix}.{index}.{rel}": module for rel, module in layer.named_modules()
                       if isinstance(module, torch.nn.Linear) and is_target(f"{prefix}.{index}.{rel}")}
            for stage in _stages(layer, targets, hidden, kwargs):
                if dense_target:
                    rel = {n: n[len(f"{prefix}.{index}."):] for n in stage}
                    accs = _stage_cross(layer, dense_layer, {n: targets[n] for n in stage},
                                        {n: dense_layer.get_submodule(rel[n]) for n in stage},
                                        hidden, dense_hidden, kwargs)
                    for name in stage:
                        weight = targets[name].weight
                        acc = accs.pop(name)
                        weight.copy_(solve(name, weight, acc.hessian, acc.cross).to(weight.dtype))
                    continue
                hessians = _stage_hessians(layer, {n: targets[n] for n in stage}, hidden, kwargs)
                for name in stage:
                    weight = targets[name].weight
                    weight.copy_(solve(name, weight, hessians.pop(name).hessian).to(weight.dtype))
            hidden = _layer_outputs(layer, hidden, kwargs)
            if dense_target:
                dense_hidden = _layer_outputs(dense_layer, dense_hidden, kwargs)
                del dense_layer
        weights.update({name: module.weight.detach().to("cpu") for name, module in targets.items()})
    if not weights:
        raise GmcError(f"{desc}: no target linears found in the decoder layers")
    return weights


class _FirstLayerInputs(Exception):
    """Raised by a pre-hook on the first decoder block to stop the forward there."""

    def __init__(self, args: tuple, kwargs: dict):
        super().__init__()
        self.args, self.kwargs = args, kwargs


def _first_layer_inputs(model, first, blocks: torch.Tensor, device) -> tuple[torch.Tensor, dict]:
    """Hidden states entering the first block for every calibration block, and its kwargs."""

    def stop(module, args, kwargs):
        raise _FirstLayerInputs(args, kwargs)

    hidden, kwargs = [], {}
    handle = first.register_forward_pre_hook(stop, with_kwargs=True)
    try:
        with contextlib.ExitStack() as stack:
            for module in _embedding_modules(model):
                stack.enter_context(_on_device(module, device))
            for row in blocks:
                try:
                    model(input_ids=row[None].to(device), use_cache=False)
                except _FirstLayerInputs as captured:
                    args, kwargs = captured.args, captured.kwargs
                    hidden.append(args[0] if args else kwargs.pop("hidden_states"))
                    kwargs = {k: v for k, v in kwargs.items() if k != "hidden_states"}
    finally:
        handle.remove()
    if not hidden:
        raise GmcError("SparseGPT: the model never reached its first decoder layer")
    return torch.cat(hidden), kwargs


def _embedding_modules(model) -> list[torch.nn.Module]:
    """The modules that run before the first decoder block (moved to the device for capture)."""
    inner = model.model
    return [module for name, module in inner.named_children() if name not in ("layers", "norm")]


class _StageDone(Exception):
    """Raised after the last target of a stage has run: the rest of the block is not needed."""


def _stages(layer, targets: dict, hidden: torch.Tensor, kwargs: dict) -> list[list[str]]:
    """Targets of one block in call order, grouped by shared input (q,k,v | o | gate,up | down).

    Each stage is solved on inputs produced by the already updated earlier stages of the same
    block (GPTQ's "true sequential" order), so a target is fitted to the inputs it will see.
    """
    calls: list[tuple[str, tuple]] = []

    def record(name):
        return lambda module, args, output: calls.append((name, (id(args[0]), args[0].data_ptr())))

    handles = [module.register_forward_hook(record(name)) for name, module in targets.items()]
    try:
        _layer_outputs(layer, hidden[:1], kwargs)
    finally:
        for handle in handles:
            handle.remove()
    stages, seen, last = [], set(), None
    for name, source in calls:
        if name in seen:
            continue
        if source == last:
            stages[-1].append(name)
        else:
            stages.append([name])
        seen.add(name)
        last = source
    if seen != set(targets):
        raise GmcError(f"SparseGPT: {sorted(set(targets) - seen)[0]} is never called by its decoder layer")
    return stages


def _stage_hessians(layer, targets: dict, hidden: torch.Tensor, kwargs: dict) -> dict[str, HessianAccumulator]:
    """Hessians of one stage's targets over every calibration block, stopping the block after them."""
    accumulators = {name: HessianAccumulator(m.in_features, m.weight.device) for name, m in targets.items()}
    handles = [targets[name].register_forward_hook(acc) for name, acc in accumulators.items()]

    def stop(module, args, output):
        raise _StageDone

    handles.append(list(targets.values())[-1].register_forward_hook(stop))
    try:
        for j in range(hidden.shape[0]):
            with contextlib.suppress(_StageDone):
                layer(hidden[j:j + 1], **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return accumulators


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


def _stage_inputs(layer, targets: dict, hidden_j: torch.Tensor, kwargs: dict) -> dict[str, torch.Tensor]:
    """The inputs of a stage's targets for one calibration block (the block stops after them)."""
    inputs = {}

    def capture(name):
        return lambda module, args, output: inputs.__setitem__(name, args[0])

    handles = [module.register_forward_hook(capture(name)) for name, module in targets.items()]

    def stop(module, args, output):
        raise _StageDone

    handles.append(list(targets.values())[-1].register_forward_hook(stop))
    try:
        with contextlib.suppress(_StageDone):
            layer(hidden_j, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return inputs


def _stage_cross(layer, dense_layer, targets: dict, dense_targets: dict, hidden, dense_hidden,
                 kwargs: dict) -> dict[str, CrossAccumulator]:
    """Hessians and pruned/dense cross-covariances of one stage, block by block."""
    accumulators = {name: CrossAccumulator(m.in_features, m.weight.device) for name, m in targets.items()}
    for j in range(hidden.shape[0]):
        pruned = _stage_inputs(layer, targets, hidden[j:j + 1], kwargs)
        dense = _stage_inputs(dense_layer, dense_targets, dense_hidden[j:j + 1], kwargs)
        for name, acc in accumulators.items():
            acc.add(pruned[name], dense[name])
    return accumulators


def _layer_outputs(layer, hidden: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """``layer`` applied to each calibration block's hidden states ``[n, seq, hidden]``."""
    outputs = torch.empty_like(hidden)
    for j in range(hidden.shape[0]):
        out = layer(hidden[j:j + 1], **kwargs)
        outputs[j] = (out[0] if isinstance(out, tuple) else out)[0]
    return outputs


@contextlib.contextmanager
def _on_device(module: torch.nn.Module, device: torch.device) -> Iterator[torch.nn.Module]:
    """Move ``module`` to ``device`` for the duration, then back where it was."""
    home = next(iter(module.parameters()), torch.empty(0)).device
    if home == device:
        yield module
        return
    module.to(device)
    try:
        yield module
    finally:
        module.to(home)
