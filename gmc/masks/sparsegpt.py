"""SparseGPT (Frantar & Alistarh 2023) over a model: a one-shot mask *and* an update of the kept weights.

Why it is in gmc: GroupMask keeps the pretrained weights frozen; SparseGPT wins at 50% because it
moves the kept weights to compensate for the pruned ones. gmc offers it as a baseline
(``sparsegpt_prune``: choose the mask and update) and as a reconstruction pass after any given
mask (``reconstruct``: learned, heuristic or loaded masks; only the update).

Per decoder block in order (one block on the device at a time)::

    X   <- inputs of block b, produced by the already pruned blocks 0..b-1
    for each stage of the block's targets (q,k,v | o | gate,up | down: call order, shared input),
    for every target linear W of the stage (its input X_l computed with the earlier stages
    already updated, as GPTQ's "true sequential"):
        H = 2 X_l^T X_l / tokens, then the OBS sweep of W on H     (gmc.masks.obs: the math of one
                                                                    linear, its choosers and refinement)
    X   <- outputs of the pruned block

``sparsegpt_prune`` defaults to the paper's sweep (``refine_steps=0``); ``reconstruct`` defaults
to ``RECONSTRUCT_REFINE_STEPS`` conjugate-gradient steps towards the exact fit of the given masks.

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
from typing import Callable, Iterator, Mapping, Optional

import torch
from tqdm.auto import tqdm

from gmc.errors import GmcError
from gmc.graph.targets import TargetFilter, decoder_layers
from gmc.groups import Pattern, parse_pattern
from gmc.inputs.model import LoadedModel
from gmc.masks.obs import (
    DAMP,
    RECONSTRUCT_REFINE_STEPS,
    CrossAccumulator,
    HessianAccumulator,
    dense_target_weight,
    prune_linear,
    reconstruct_linear,
)


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

    def solve(name: str, weight: torch.Tensor, hessian: torch.Tensor,
              cross: Optional[torch.Tensor] = None) -> torch.Tensor:
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


def _check_sparsity(pattern: Pattern, sparsity: Optional[float]) -> float:
    fixed = pattern.fixed_sparsity
    if fixed is not None:
        if sparsity is not None and abs(sparsity - fixed) > 1e-9:
            raise GmcError(f"--group {pattern} fixes sparsity at {fixed}; got {sparsity}")
        return fixed
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
