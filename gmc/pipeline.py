"""The pass pipeline every command runs, one ordered step per line (docs/design.md, "The pipeline").

    trace_model -> find_targets -> insert_group_selectors        prepare: the graph with selectors
        -> mask source sets the selectors                        gmc prune (learned | heuristic | SparseGPT)
        -> fold_masks                                            convert: dense weights with zeros
        -> lower_group_sparse                                    convert: one group-sparse op per target
        -> fuse_siblings                                         (decode programs) ops on one input fused
        -> fuse_gated_mlp                                        (decode programs) gate/up, silu, down: one op

``prepare`` is what ``gmc prune`` learns on; ``fold`` is what ``--save-dense``, ``gmc lower
--backend dense`` and ``gmc eval`` of an artifact run; ``lower`` is what ``gmc lower --backend
torch|triton|onnx`` runs, and ``lower_decode`` runs the same pass on the prefill and decode programs
over a static KV cache (``gmc.decode``) that ``gmc lower --compile`` compiles. The eager model the graph was traced from shares its weights with the
graph: ``fold(..., in_place=True)`` therefore leaves the eager model folded too (the eager form of
the same pass, for ``save_pretrained``, ``generate`` and lm-eval).
"""
from __future__ import annotations

from typing import Callable, Mapping, Optional

import torch

from gmc.decode import export_decode, export_step
from gmc.errors import GmcError
from gmc.groups import Pattern
from gmc.packed import PackedLinear, pack, pack_dense, quantize_int8
from gmc.passes.find_targets import find_targets
from gmc.passes.fold_masks import fold_masks
from gmc.passes.fuse_gated_mlp import fuse_gated_mlp
from gmc.passes.fuse_siblings import fuse_siblings
from gmc.passes.insert_group_selectors import insert_group_selectors
from gmc.passes.lower_group_sparse import lower_group_sparse
from gmc.targets import Target, TargetFilter
from gmc.trace import attr_tensor, trace_model


HEAD = True  # lower_decode: the output head on gmc's GEMV (docs/lowering.md, "Output head")
HEAD_GROUP = "1x256"  # its packing (every group kept: only the input block width matters)
# lower_decode: ops reading one input fused into one (docs/lowering.md, "Session 7"), then each gated
# MLP's two ops and activation into one ("Session 14")
FUSE = True


def prepare(model: torch.nn.Module, pattern: Pattern, chosen: Callable[[str], bool] = TargetFilter(),
            ) -> tuple[torch.fx.GraphModule, list[Target]]:
    """Trace ``model``, find its targets (the target set, computed once) and insert one selector
    per target. The selectors start empty: the graph computes the dense model."""
    gm = trace_model(model)
    targets = find_targets(gm, chosen)
    insert_group_selectors(gm, targets, pattern)
    return gm, targets


def fold(model: torch.nn.Module, masks: Mapping[str, torch.Tensor], pattern: Pattern,
         weights: Optional[Mapping[str, torch.Tensor]] = None, in_place: bool = True) -> torch.fx.GraphModule:
    """Masks (and updated weights) folded into ``model`` through its graph; returns the folded graph."""
    gm, targets = prepare(model, pattern, _named(masks, model))
    _check_found(masks, targets, model)
    return fold_masks(gm, masks, weights, in_place=in_place)


def lower(model: torch.nn.Module, masks: Mapping[str, torch.Tensor], pattern: Pattern,
          weights: Optional[Mapping[str, torch.Tensor]] = None, int8: bool = False,
          ) -> tuple[torch.fx.GraphModule, dict[str, PackedLinear]]:
    """The lowered graph of ``model``: each target an op node on its packed kept groups (the
    eager model is not changed); ``int8``: the kept values weight-only int8 (``quantize_int8``).
    Returns the graph and the packed layers, keyed by module name."""
    gm = trace_model(model)
    targets = find_targets(gm, _named(masks, model))
    _check_found(masks, targets, model)
    packed = _pack(gm, targets, masks, pattern, weights)
    if int8:
        packed = {name: quantize_int8(layer) for name, layer in packed.items()}
    return lower_group_sparse(gm, packed), packed


def lower_decode(model: torch.nn.Module, packed: Mapping[str, PackedLinear], max_len: int, head: bool = HEAD,
                 fuse: bool = FUSE) -> dict[str, torch.export.ExportedProgram]:
    """The prefill and decode programs of ``model`` over a static KV cache of ``max_len``
    positions (``gmc.decode``), each target lowered to the op on its ``packed`` layer (from
    ``lower``); with ``packed`` empty, the dense programs, traced the same way.

    ``head``: the output head (dense, never a target) runs on the op too, every group kept
    (``pack_dense``; int8 when the packed layers are), and a tied input embedding reads those
    packed values, so the matrix is still stored once. The dense programs get it too: like with like.
    ``fuse``: ops that read one input (q/k/v, gate/up) run as one (``fuse_siblings``), and a gated
    MLP's gate/up op, activation and down op as one (``fuse_gated_mlp``)."""
    parameter = next(model.parameters())
    if head:
        packed = {**_packed_head(model, packed), **packed}
    programs = export_decode(model, max_len)
    if not packed:
        return programs
    lowered = {}
    for name, program in programs.items():
        gm = lower_group_sparse(program.module(), packed)
        if fuse:
            gm = fuse_gated_mlp(fuse_siblings(gm))
        lowered[name] = export_step(gm, model.config, max_len, name, parameter.dtype, parameter.device)
    return lowered


def _packed_head(model: torch.nn.Module, packed: Mapping[str, PackedLinear]) -> dict[str, PackedLinear]:
    """``{name: layer}`` of the output head packed whole (int8 if ``packed`` is), or ``{}``."""
    output = model.get_output_embeddings()
    name = next((name for name, module in model.named_modules() if module is output), None)
    if not isinstance(output, torch.nn.Linear) or name is None or name in packed:
        return {}
    layer = pack_dense(output.weight.detach(), HEAD_GROUP, output.bias)
    if any(p.scales is not None for p in packed.values()):
        layer = quantize_int8(layer)
    return {name: layer}


def _pack(gm: torch.fx.GraphModule, targets: list[Target], masks: Mapping[str, torch.Tensor], pattern: Pattern,
          weights: Optional[Mapping[str, torch.Tensor]]) -> dict[str, PackedLinear]:
    packed = {}
    for target in targets:
        weight_node = target.node.args[1]
        bias_node = target.node.args[2] if len(target.node.args) > 2 else None
        weight = attr_tensor(gm, weight_node.target)
        if weights and target.name in weights:
            weight = weights[target.name].to(weight)
        bias = attr_tensor(gm, bias_node.target) if isinstance(bias_node, torch.fx.Node) else None
        packed[target.name] = pack(weight, masks[target.name], pattern, bias)
    return packed


def _named(masks: Mapping[str, torch.Tensor], model: torch.nn.Module) -> Callable[[str], bool]:
    """The target set of an artifact: its mask names, each of which must be a linear of ``model``."""
    names = set(masks)
    linears = {name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    missing = sorted(names - linears)
    if missing:
        raise GmcError(f"masks do not match the model: {type(model).__name__} has no linear named {missing[0]!r}")
    return names.__contains__


def _check_found(masks: Mapping[str, torch.Tensor], targets: list[Target], model: torch.nn.Module) -> None:
    absent = sorted(set(masks) - {t.name for t in targets})
    if absent:
        raise GmcError(f"masks name {absent[0]!r}, a linear that the traced {type(model).__name__} never runs "
                       f"as aten.linear: it cannot be a target")
