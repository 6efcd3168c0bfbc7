"""Find the target linears of a traced causal LM.

Why: every later pass (selectors, folding, lowering) acts on the same set of linears, named by
the HF module names that masks are keyed by. A target is an ``aten.linear`` node whose weight is
a ``get_attr`` of a 2-D parameter. By default the targets are the q, k, v, o, gate, up and down
projections of every decoder layer (DESIGN.md section 1); ``include``/``ignore`` are regexes
searched in the module name. ``lm_head`` and embeddings are never targets.

Precondition: ``gm`` comes from ``gmc.trace.trace_model`` (parameters as ``get_attr`` nodes).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import torch

from gmc.errors import GmcError
from gmc.trace import hf_name

DEFAULT_TARGETS = r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)$"
_NEVER = re.compile(r"(^|\.)(lm_head|embed_tokens|wte|wpe)$")


@dataclass
class Target:
    name: str  # HF module name, e.g. model.layers.3.self_attn.q_proj
    shape: tuple[int, int]  # (d_out, d_in) of the weight
    node: torch.fx.Node  # the aten.linear node


def _compile(pattern: Optional[str], option: str) -> Optional[re.Pattern]:
    if pattern is None:
        return None
    try:
        return re.compile(pattern)
    except re.error as error:
        raise GmcError(f"bad {option} regex {pattern!r}: {error}") from error


def find_targets(
    gm: torch.fx.GraphModule, include: Optional[str] = None, ignore: Optional[str] = None
) -> list[Target]:
    """Target linears of ``gm`` in execution order."""
    include_re = _compile(include or DEFAULT_TARGETS, "--include")
    ignore_re = _compile(ignore, "--ignore")
    targets = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not torch.ops.aten.linear.default:
            continue
        weight = node.args[1]
        if not isinstance(weight, torch.fx.Node) or weight.op != "get_attr":
            continue
        name = hf_name(weight.target).removesuffix(".weight")
        if _NEVER.search(name) or not include_re.search(name):
            continue
        if ignore_re is not None and ignore_re.search(name):
            continue
        tensor = gm.get_parameter(weight.target) if _is_param(gm, weight.target) else gm.get_buffer(weight.target)
        targets.append(Target(name, tuple(tensor.shape), node))
    if not targets:
        raise GmcError(
            f"no target linears found in {gm.meta.get('gmc_model_class', 'the model')} "
            f"(include={include or DEFAULT_TARGETS!r}, ignore={ignore!r})"
        )
    return targets


def _is_param(gm: torch.nn.Module, target: str) -> bool:
    try:
        gm.get_parameter(target)
        return True
    except AttributeError:
        return False
