"""The pass lists every command runs, declared once as data (docs/design.md, "Pass lists").

Two program forms, one lowering list:

    logits graph (input_ids -> logits; gmc.graph.trace.trace_model -> find_targets):
        PREPARE  insert_group_selectors                     gmc prune learns on it (masks set the selectors)
        FOLD     insert_group_selectors -> fold_masks        --backend dense, --save-dense, eval of an artifact
        LOWER    lower_group_sparse -> fuse_siblings -> fuse_gated_mlp -> fuse_attention -> tile_for_cuda
                                                             --backend torch|triton: program.pt2
    step programs (prefill/decode over a static KV cache; gmc.graph.decode.export_decode):
        LOWER    the same list, then export_step             --compile, gmc generate

``lower_group_sparse`` lowers every target to its packed layer and, with ``LowerOptions.head``, the
output head too (every group kept), in both forms, so ``program.pt2`` and the
compiled packages compute the same function (the ONNX backend packs onnxruntime-genai's own graph:
``gmc.lower.onnx_pack``). ``run_passes`` is the one loop that applies a list:
the options skip a pass (``LowerOptions.fuse``), nothing else does.

The eager model a graph was traced from shares its weights with the graph: ``fold(..., in_place=True)``
leaves the eager model folded too (the eager form of the same pass, for ``save_pretrained``,
``generate`` and lm-eval).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, NamedTuple, Optional

import torch

from gmc.errors import GmcError
from gmc.graph.decode import export_decode, export_step
from gmc.graph.passes.find_targets import find_targets
from gmc.graph.passes.fold_masks import fold_masks
from gmc.graph.passes.fuse_attention import fuse_attention
from gmc.graph.passes.fuse_gated_mlp import fuse_gated_mlp
from gmc.graph.passes.fuse_siblings import fuse_siblings
from gmc.graph.passes.insert_group_selectors import insert_group_selectors
from gmc.graph.passes.lower_group_sparse import lower_group_sparse
from gmc.graph.passes.tile_for_cuda import tile_for_cuda
from gmc.graph.selector import GroupSelector, selector_modules
from gmc.graph.targets import Target, TargetFilter
from gmc.graph.trace import trace_model
from gmc.groups import Pattern, parse_pattern
from gmc.kernels.packed import PackedLinear, pack, pack_dense
from gmc.kernels.quantize import QUANTIZE, quantize

PREPARE = (insert_group_selectors,)
FOLD = (insert_group_selectors, fold_masks)
# tile_for_cuda last: it acts on CUDA buffers only
LOWER = (lower_group_sparse, fuse_siblings, fuse_gated_mlp, fuse_attention, tile_for_cuda)
FUSE_PASSES = (fuse_siblings, fuse_gated_mlp, fuse_attention)  # what LowerOptions.fuse=False skips
HEAD_GROUP = "1x256"  # the lowered output head's packing (every group kept: only the input block width matters)


@dataclass(frozen=True)
class LowerOptions:
    """What the lowering list does, for both program forms."""

    quantize: str = "none"  # kept values weight-only int8 or int4 (gmc.kernels.quantize.quantize), the lowered head too
    head: bool = True  # the output head (never a target) on gmc's op, every group kept: its GEMV streams faster
    fuse: bool = True  # ops reading one input (q/k/v, gate/up) as one, then each gated MLP as one op

    def __post_init__(self):
        if self.quantize not in QUANTIZE:
            raise GmcError(f"bad LowerOptions.quantize {self.quantize!r}: expected one of {', '.join(QUANTIZE)}")
        for name in ("head", "fuse"):
            if not isinstance(getattr(self, name), bool):
                raise GmcError(f"bad LowerOptions.{name} {getattr(self, name)!r}: expected True or False")


@dataclass
class PassInputs:
    """What the passes of one run read: the targets, masks, packed layers and options."""

    targets: list[Target]
    pattern: Optional[Pattern] = None
    masks: Optional[Mapping[str, torch.Tensor]] = None
    weights: Optional[Mapping[str, torch.Tensor]] = None
    packed: Optional[Mapping[str, PackedLinear]] = None
    options: LowerOptions = LowerOptions()
    in_place: bool = True


_APPLY: dict[Callable, Callable[[torch.fx.GraphModule, PassInputs], torch.fx.GraphModule]] = {
    insert_group_selectors: lambda gm, run: insert_group_selectors(gm, run.targets, run.pattern),
    fold_masks: lambda gm, run: fold_masks(gm, run.masks, run.weights, in_place=run.in_place),
    lower_group_sparse: lambda gm, run: lower_group_sparse(gm, run.packed),
    fuse_siblings: lambda gm, run: fuse_siblings(gm),
    fuse_gated_mlp: lambda gm, run: fuse_gated_mlp(gm),
    fuse_attention: lambda gm, run: fuse_attention(gm),
    tile_for_cuda: lambda gm, run: tile_for_cuda(gm),
}


def run_passes(gm: torch.fx.GraphModule, passes: tuple[Callable, ...], run: PassInputs) -> torch.fx.GraphModule:
    """Apply ``passes`` in order to a graph of either program form; ``run.options`` may skip the fusion passes."""
    for graph_pass in passes:
        if graph_pass in FUSE_PASSES and not run.options.fuse:
            continue
        gm = _APPLY[graph_pass](gm, run)
    return gm


class Prepared(NamedTuple):
    """What ``prepare`` made: the graph, its targets (in graph order) and their selectors by name."""

    gm: torch.fx.GraphModule
    targets: list[Target]
    selectors: dict[str, GroupSelector]


def prepare(model: torch.nn.Module, pattern: Pattern, chosen: Callable[[str], bool] = TargetFilter()) -> Prepared:
    """Trace ``model``, find its targets (the target set, computed once) and insert one selector
    per target. The selectors start empty: the graph computes the dense model."""
    gm = trace_model(model)
    targets = find_targets(gm, chosen)
    gm = run_passes(gm, PREPARE, PassInputs(targets, pattern))
    return Prepared(gm, targets, selector_modules(gm))


def fold(model: torch.nn.Module, masks: Mapping[str, torch.Tensor], pattern: Pattern,
         weights: Optional[Mapping[str, torch.Tensor]] = None, in_place: bool = True) -> torch.fx.GraphModule:
    """Masks (and updated weights) folded into ``model`` through its graph; returns the folded graph."""
    gm = trace_model(model)
    targets = find_targets(gm, _named(masks, model))
    _check_found(masks, targets, model)
    return run_passes(gm, FOLD, PassInputs(targets, pattern, masks, weights, in_place=in_place))


@torch.no_grad()
def fold_prepared(gm: torch.fx.GraphModule, masks: Mapping[str, torch.Tensor],
                  weights: Optional[Mapping[str, torch.Tensor]] = None) -> torch.fx.GraphModule:
    """The fold list's passes after ``PREPARE`` on a graph ``prepare`` made, in place: the eager
    model it shares weights with is folded too."""
    return run_passes(gm, FOLD[len(PREPARE):], PassInputs([], masks=masks, weights=weights))


def pack_targets(model: torch.nn.Module, masks: Mapping[str, torch.Tensor], pattern: Pattern,
                 weights: Optional[Mapping[str, torch.Tensor]] = None, how: str = "none",
                 ) -> dict[str, PackedLinear]:
    """Each masked target linear of ``model`` packed (its kept groups; ``weights`` replace the
    model's where given), keyed by module name: what ``lower_group_sparse`` puts in the graph and
    the lowered checkpoint stores."""
    _named(masks, model)
    pattern = parse_pattern(pattern)
    packed = {}
    for name, selectors in masks.items():
        linear = model.get_submodule(name)
        weight = linear.weight.detach()
        if weights and name in weights:
            weight = weights[name].to(weight)
        layer = pack(weight, selectors, pattern, linear.bias)
        packed[name] = quantize(layer, how)
    return packed


def lower(model: torch.nn.Module, masks: Mapping[str, torch.Tensor], pattern: Pattern,
          weights: Optional[Mapping[str, torch.Tensor]] = None, options: LowerOptions = LowerOptions(),
          ) -> tuple[torch.fx.GraphModule, dict[str, PackedLinear]]:
    """The lowered logits graph of ``model`` (the eager model is not changed) and its packed
    targets, keyed by module name (the lowered head, a program detail, is not among them)."""
    gm = trace_model(model)
    targets = find_targets(gm, _named(masks, model))
    _check_found(masks, targets, model)
    packed = pack_targets(model, masks, pattern, weights, options.quantize)
    layers = {**packed_head(model, packed, options), **packed}
    return run_passes(gm, LOWER, PassInputs(targets, pattern, masks, weights, layers, options)), packed


def lower_decode(model: torch.nn.Module, packed: Mapping[str, PackedLinear], max_len: int,
                 options: LowerOptions = LowerOptions()) -> dict[str, torch.export.ExportedProgram]:
    """The prefill and decode programs of ``model`` over a static KV cache of ``max_len``
    positions (``gmc.graph.decode``), lowered by ``LOWER`` on ``packed`` (from ``lower``); with
    ``packed`` empty, the dense programs, traced the same way (the head lowered all the same: like
    with like). A tied input embedding reads the lowered head's packed values, so the matrix is
    still stored once."""
    parameter = next(model.parameters())
    layers = {**packed_head(model, packed, options), **packed}
    programs = export_decode(model, max_len)
    if not layers:
        return programs
    lowered = {}
    for name, program in programs.items():
        gm = run_passes(program.module(), LOWER, PassInputs([], packed=layers, options=options))
        lowered[name] = export_step(gm, model.config, max_len, name, parameter.dtype, parameter.device)
    return lowered


def packed_head(model: torch.nn.Module, packed: Mapping[str, PackedLinear],
                options: LowerOptions) -> dict[str, PackedLinear]:
    """``{name: layer}`` of the output head packed whole, int8 when ``options.quantize`` (or the
    ``packed`` layers) are int8 or int4, or ``{}`` (no head option, no linear head, or the head is a
    target). With int4 targets an int4 head cost the bundled SmolLM2 6.5% held-out perplexity, an
    int8 one 0.06% (bench/bench_quantize_quality.py); llama.cpp's 4-bit files keep it at 8 bits too."""
    output = model.get_output_embeddings()
    name = next((name for name, module in model.named_modules() if module is output), None)
    if not options.head or not isinstance(output, torch.nn.Linear) or name is None or name in packed:
        return {}
    layer = pack_dense(output.weight.detach(), HEAD_GROUP, output.bias)
    how = options.quantize if options.quantize != "none" else next(
        (p.quantized for p in packed.values() if p.quantized != "none"), "none")
    layer = quantize(layer, "none" if how == "none" else "int8")
    return {name: layer}


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
